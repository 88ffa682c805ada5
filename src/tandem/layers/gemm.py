"""The engine's matrix multiply, ``y = x W^T + b``, on the fastest kernel torch has here.

On CPU, ``F.linear`` in float32 calls MKL's sgemm. On the AMD EPYC VMs this project runs on,
that ran at about 40% of one core's float32 peak at every decode and prefill shape of the
bench model (86-94 GFLOP/s on one thread), while oneDNN's matmul (torch's
``mkldnn._linear_pointwise``, the library vLLM's CPU build calls through its own ``onednn_mm``)
ran 1.8x faster with the weight as it is (docs/benchmarks.md, "GEMM kernels").

oneDNN is faster still on a copy of the weight reordered into its blocked layout (vLLM's CPU
build packs every weight at load and drops the original): 1.2-2.5x at decode batches of 7-64
rows, within 10% at prefill sizes (docs/benchmarks.md, "Packed weights and pointwise
kernels"). tandem keeps the live weight where it is, in its canonical layout (pushes and
reloads write into it; a trainer on the same host writes the shared arena), and the blocked
copy beside it (`PackedWeight`: 2x the weights' memory, ``packed_weights=False`` turns it
off). A copy is remade on its first use after the weight may have changed: whoever writes the
live weights calls `drop_packed` (the engine's push receiver after every phase, sleep / wake /
reload), and each use also checks the weight's storage and torch's version counter, which
catches in-process writes through torch. A stale copy would serve wrong tokens silently, so
both guards stay. A weight oneDNN will not reorder runs as it is (logged once).

Which kernel runs a call is measured per regime of rows (`tandem.layers.gemm_choice`):
oneDNN, ``F.linear`` (MKL) or, at a few decode rows, tandem's own GEMV kernel, which reads the
live weight once (`tandem.kernels.gemv`). bfloat16 batches take oneDNN on a packed copy
wherever oneDNN runs bfloat16 natively (AVX512-BF16 or AMX; ``F.linear`` there runs oneDNN on
the plain weight, re-packing it each call): on an AMX VM packed ran 1.7-2.5x ``F.linear`` at
1-96 rows and the same at 2048, the output equal (docs/benchmarks.md, "bfloat16 on an AMX
VM"). Other dtypes, autograd and tensors off the CPU take ``F.linear``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import gemv
from tandem.layers.gemm_choice import Kernel, kernel, onednn, onednn_serves, pack

logger = logging.getLogger(__name__)


def _kernel(x: torch.Tensor, weight: torch.Tensor) -> Kernel:
    """The kernel that runs ``x @ weight.T`` here (`gemm_choice` for CPU inference)."""
    if x.dtype != weight.dtype or x.device.type != "cpu" or torch.is_grad_enabled():
        return "torch"
    if x.dtype not in (torch.float32, torch.bfloat16) or not (weight.numel() and x.numel()):
        return "torch"
    chosen = kernel(x.dtype, x.numel() // x.shape[-1])
    if chosen == "gemv" and not gemv.fits(x, weight):  # a strided view: the library serves
        return "onednn" if onednn_serves(x.dtype) else "torch"
    return chosen


class PackedWeight:
    """A live weight's copy in oneDNN's blocked layout, remade on first use after the weight
    may have changed (`drop`, or a new storage or version counter value). Owned by the layer
    that holds the weight; the layer passes it to `linear`."""

    __slots__ = ("_copy", "_dense", "_key", "_refused", "_source_key")

    def __init__(self) -> None:
        self._copy: torch.Tensor | None = None
        self._key: tuple[int, int] = (0, -1)  # the weight's (data_ptr, _version) when packed
        self._refused = False
        self._dense: torch.Tensor | None = None  # a weight made from others (`source`)
        self._source_key: tuple = ()

    def source(self, made_from: tuple, make) -> torch.Tensor:
        """The weight ``make()`` builds from the tensors in ``made_from`` (a block-FP8
        weight dequantized; a dtype may close the tuple), kept like the packed copy: remade
        after `drop` or when one of them has a new storage or version counter value."""
        key = tuple(
            (t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else t for t in made_from
        )
        if self._dense is None or key != self._source_key:
            self._dense, self._source_key = make(), key
        return self._dense

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` (made now if missing or stale), or ``weight`` itself
        where oneDNN refuses to reorder it."""
        if self._refused:
            return weight
        # a weight made in inference mode (`source`) has no version counter: only its maker
        # writes it
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)
        if self._copy is None or key != self._key:
            try:
                self._copy = pack(weight)
            except RuntimeError as exc:
                self._refused = True
                logger.warning("a %s weight runs unpacked: %s", tuple(weight.shape), exc)
                return weight
            self._key = key
        return self._copy

    def drop(self) -> None:
        self._copy = None
        self._dense = None

    @property
    def held(self) -> bool:
        return self._copy is not None


def _packing_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of ``model`` that keep a packed copy of their weight."""
    return [m for m in model.modules() if isinstance(getattr(m, "packed", None), PackedWeight)]


def packed_weights(model: nn.Module) -> list[PackedWeight]:
    """The model's packed copies (one per layer that keeps one)."""
    return [m.packed for m in _packing_layers(model)]


def drop_packed(model: nn.Module) -> None:
    """Forget every packed copy of ``model``'s weights (they were or may be rewritten)."""
    for packed in packed_weights(model):
        packed.drop()


def disable_packing(model: nn.Module) -> None:
    """Run ``model``'s matmuls on the live weights only (no second copy in memory)."""
    for m in _packing_layers(model):
        m.packed = None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for x of shape [..., in] and weight [out, in]; ``packed`` is the
    layer's blocked copy of ``weight`` (used where oneDNN runs the call)."""
    chosen = _kernel(x, weight)
    if chosen == "gemv":
        return gemv.gemv(x, weight, bias)
    if chosen == "onednn":
        return onednn(x, packed.get(weight) if packed is not None else weight, bias)
    return F.linear(x, weight, bias)
