"""The engine's matrix multiply, ``y = x W^T + b``, on the fastest kernel torch has here.

On CPU, ``F.linear`` in float32 calls MKL's sgemm. On the AMD EPYC VMs this project runs on,
that ran at about 40% of one core's float32 peak at every decode and prefill shape of the
bench model (86-94 GFLOP/s on one thread), while oneDNN's matmul (torch's
``mkldnn._linear_pointwise``, the library vLLM's CPU build calls through its own ``onednn_mm``)
ran 1.8x faster with the weight as it is, and 2.3x with the weight reordered into oneDNN's
blocked layout (docs/benchmarks.md, "GEMM kernels"). tandem keeps the weight as it is: a
reordered copy would have to be rebuilt after every write into the live parameters (pushes,
reloads, a trainer on the same host writing the shared arena), and a stale copy serves wrong
tokens silently. In bfloat16 ``F.linear`` already runs oneDNN.

Which kernel runs float32 is measured, not assumed: the first call times both at a decode
batch's shape (64 x 512 by 512 x 1280, best of a few, about 20 ms) and keeps oneDNN unless
``F.linear`` is clearly faster (`choose`); ``TANDEM_GEMM=onednn|torch`` skips the probe. The
choice is per process and logged. bfloat16 and other dtypes, and tensors off the CPU, always
take ``F.linear`` (bfloat16 ``F.linear`` already runs oneDNN where the CPU has bf16 units,
and oneDNN's float32-exact inner product is the one that MKL loses to here).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

Kernel = Literal["onednn", "torch"]
KERNELS: tuple[Kernel, ...] = ("onednn", "torch")
PROBE_SHAPE = (64, 512, 1280)  # rows, in, out: a decode batch through an MLP projection
PROBE_REPEATS = 5
ONEDNN_MARGIN = 1.1  # F.linear must be this much faster to be chosen


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


def probe() -> dict[Kernel, float]:
    """Best seconds per float32 call of each kernel at `PROBE_SHAPE`, the two alternating."""
    rows, inp, out = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, inp, generator=gen), torch.randn(out, inp, generator=gen)
    calls = {"onednn": lambda: _onednn(x, w, None), "torch": lambda: F.linear(x, w)}
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


def _kernel() -> Kernel:
    forced = os.environ.get("TANDEM_GEMM", "")
    if forced and forced not in KERNELS:
        raise ValueError(f"TANDEM_GEMM must be one of {KERNELS}, got {forced!r}")
    if not torch.backends.mkldnn.is_available():
        return "torch"
    if forced:
        return forced  # type: ignore[return-value]
    seconds = probe()
    chosen = choose(seconds)
    rows, inp, out = PROBE_SHAPE
    logger.info(
        "float32 GEMM kernel: %s (%dx%d by %dx%d: oneDNN %.0f us, F.linear %.0f us)",
        chosen, rows, inp, inp, out, seconds["onednn"] * 1e6, seconds["torch"] * 1e6,
    )  # fmt: skip
    return chosen


_chosen: Kernel | None = None


def kernel() -> Kernel:
    """The float32 CPU kernel of this process (probed on first use)."""
    global _chosen
    if _chosen is None:
        _chosen = _kernel()
    return _chosen


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight.T + bias`` for x of shape [..., in] and weight [out, in]."""
    if (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.numel()
        and x.numel()
        and not torch.is_grad_enabled()
        and kernel() == "onednn"
    ):
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)
