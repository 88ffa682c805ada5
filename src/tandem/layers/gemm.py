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

Which kernel runs float32 is measured, not assumed: the first call times both, oneDNN on a
packed copy, at a decode batch's shape (64 x 512 by 512 x 1280, best of a few, about 20 ms)
and again at one row (a lone decode: on an Intel AMX VM MKL's sgemm ran 1.3x packed oneDNN
there, and packed oneDNN 2x MKL at 16 rows), keeping oneDNN unless ``F.linear`` is clearly
faster (`choose`); ``TANDEM_GEMM=onednn|torch`` skips the probe. The
choice is per process and logged. bfloat16 takes oneDNN on a packed copy wherever oneDNN runs
bfloat16 natively (AVX512-BF16 or AMX; ``F.linear`` there runs oneDNN on the plain weight,
re-packing it each call): on an AMX VM packed ran 1.7-2.5x ``F.linear`` at 1-96 rows and the
same at 2048, the output equal (docs/benchmarks.md, "bfloat16 on an AMX VM"). Other dtypes,
autograd and tensors off the CPU take ``F.linear``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

Kernel = Literal["onednn", "torch"]
KERNELS: tuple[Kernel, ...] = ("onednn", "torch")
PROBE_SHAPE = (64, 512, 1280)  # rows, in, out: a decode batch through an MLP projection
PROBE_REPEATS = 5
ONEDNN_MARGIN = 1.1  # F.linear must be this much faster to be chosen
PACK_ROWS = 64  # the batch size oneDNN picks a packed layout for (it serves every row count)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


def probe(rows: int = PROBE_SHAPE[0]) -> dict[Kernel, float]:
    """Best seconds per float32 call of each kernel at `PROBE_SHAPE` with ``rows`` rows,
    oneDNN on a packed copy as the layers run it, the two alternating."""
    _, inp, out = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, inp, generator=gen), torch.randn(out, inp, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
    calls = {"onednn": lambda: _onednn(x, packed, None), "torch": lambda: F.linear(x, w)}
    best = {name: float("inf") for name in calls}
    with torch.inference_mode():
        for fn in calls.values():
            fn()  # first calls build the primitive / touch the pages
        for _ in range(PROBE_REPEATS):
            for name, fn in calls.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def choose(seconds: dict[Kernel, float]) -> Kernel:
    """oneDNN unless ``F.linear`` beats it by `ONEDNN_MARGIN`."""
    return "torch" if seconds["torch"] * ONEDNN_MARGIN < seconds["onednn"] else "onednn"


def _kernel(rows: int = PROBE_SHAPE[0]) -> Kernel:
    forced = os.environ.get("TANDEM_GEMM", "")
    if forced and forced not in KERNELS:
        raise ValueError(f"TANDEM_GEMM must be one of {KERNELS}, got {forced!r}")
    if not torch.backends.mkldnn.is_available():
        return "torch"
    if forced:
        return forced  # type: ignore[return-value]
    try:
        seconds = probe(rows)
    except RuntimeError as exc:  # oneDNN will not pack here: MKL it is
        logger.warning("float32 GEMM kernel: F.linear (oneDNN failed the probe: %s)", exc)
        return "torch"
    chosen = choose(seconds)
    _, inp, out = PROBE_SHAPE
    logger.info(
        "float32 GEMM kernel at %d row(s): %s (%dx%d by %dx%d: oneDNN packed %.0f us, "
        "F.linear %.0f us)",
        rows, chosen, rows, inp, inp, out, seconds["onednn"] * 1e6, seconds["torch"] * 1e6,
    )  # fmt: skip
    return chosen


_chosen: Kernel | None = None  # batches (probed at PROBE_SHAPE's rows)
_single: Kernel | None = None  # one row (a lone decode), probed apart: MKL won it on Intel


def kernel(rows: int = PROBE_SHAPE[0]) -> Kernel:
    """The float32 CPU kernel of this process for a call of ``rows`` rows (probed on first
    use: one row, and batches)."""
    global _chosen, _single
    if rows == 1:
        if _single is None:
            _single = _kernel(1)
        return _single
    if _chosen is None:
        _chosen = _kernel()
    return _chosen


def _bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 on this CPU (native bf16 units: AVX512-BF16 or AMX)."""
    global _bf16
    if _bf16 is None:
        mkldnn = torch.backends.mkldnn.is_available()
        _bf16 = mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return _bf16


_bf16: bool | None = None


def _onednn_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dtype != weight.dtype or x.device.type != "cpu" or torch.is_grad_enabled():
        return False
    if not (weight.numel() and x.numel()):
        return False
    if x.dtype == torch.float32:
        return kernel(x.numel() // x.shape[-1]) == "onednn"
    return x.dtype == torch.bfloat16 and _bf16_supported()


class PackedWeight:
    """A live weight's copy in oneDNN's blocked layout, remade on first use after the weight
    may have changed (`drop`, or a new storage or version counter value). Owned by the layer
    that holds the weight; the layer passes it to `linear`."""

    __slots__ = ("_copy", "_key", "_refused")

    def __init__(self) -> None:
        self._copy: torch.Tensor | None = None
        self._key: tuple[int, int] = (0, -1)  # the weight's (data_ptr, _version) when packed
        self._refused = False

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` (made now if missing or stale), or ``weight`` itself
        where oneDNN refuses to reorder it."""
        if self._refused:
            return weight
        key = (weight.data_ptr(), weight._version)
        if self._copy is None or key != self._key:
            try:
                self._copy = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
            except RuntimeError as exc:
                self._refused = True
                logger.warning("a %s weight runs unpacked: %s", tuple(weight.shape), exc)
                return weight
            self._key = key
        return self._copy

    def drop(self) -> None:
        self._copy = None

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
    layer's blocked copy of ``weight`` (used where oneDNN serves the dtype)."""
    if _onednn_serves(x, weight):
        return _onednn(x, packed.get(weight) if packed is not None else weight, bias)
    return F.linear(x, weight, bias)
