"""Layout of a tandem model: every parameter already declares its pieces."""

from __future__ import annotations

from torch import nn

from tandem.exchange.adapters.hf import dtype_name
from tandem.exchange.layout import RankLayout
from tandem.exchange.transports.memory import ParamArena


def engine_layout(model: nn.Module, rank: int, arena: ParamArena | None = None) -> RankLayout:
    """Keys are the parameters' dotted names in ``model`` (a tied tensor once); ``arena``: the
    shared memory the parameters live in, if any (trainers on this host write into it)."""
    params = list(model.named_parameters())
    missing = [name for name, param in params if not hasattr(param, "pieces")]
    if missing:
        raise TypeError(f"parameters without placement pieces: {missing}")
    layout = RankLayout(rank, dtype=dtype_name(params), arena=arena and arena.handle())
    for name, param in params:
        layout.add(name, tuple(param.shape), list(param.pieces))
    return layout
