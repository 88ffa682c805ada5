"""Layout of a tandem model: every parameter already declares its pieces."""

from __future__ import annotations

from torch import nn

from tandem.dtypes import DTYPE_NAMES
from tandem.exchange.adapters.hf import dtype_name
from tandem.exchange.layout import RankLayout
from tandem.exchange.transports.memory import ParamArena
from tandem.layers.linear import fp8_blocks
from tandem.layers.lora import LoRAStack


def engine_layout(model: nn.Module, rank: int, arena: ParamArena | None = None) -> RankLayout:
    """Keys are the parameters' dotted names in ``model`` (a tied tensor once); ``arena``: the
    shared memory the parameters live in, if any (trainers on this host write into it). The
    layout's dtype is the compute dtype; block-FP8 values and their scales are listed apart."""
    params = list(model.named_parameters())
    missing = [name for name, param in params if not hasattr(param, "pieces")]
    if missing:
        raise TypeError(f"parameters without placement pieces: {missing}")
    plain = [(n, p) for n, p in params if not getattr(p, "keeps_dtype", False)]
    layout = RankLayout(rank, dtype=dtype_name(plain or params), arena=arena and arena.handle())
    for name, param in params:
        layout.add(name, tuple(param.shape), list(param.pieces))
        if DTYPE_NAMES[param.dtype] != layout.dtype:
            layout.dtypes[name] = DTYPE_NAMES[param.dtype]
    layout.fp8_blocks = fp8_blocks(model)
    layout.lora_sites = [m.site for m in model.modules() if isinstance(m, LoRAStack)]
    return layout
