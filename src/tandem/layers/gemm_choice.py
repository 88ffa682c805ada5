"""Which kernel runs the engine's matmuls (`tandem.layers.gemm`), measured per regime.

A matmul's regime is set by its rows: ``one`` (a lone decode row), ``few`` (2 to
`tandem.kernels.gemv.MAX_ROWS` rows: the small decode batches at the tail of a workload) and
``batch`` (more). In ``one`` and ``few`` a call is one pass over the weight, and a decode
step's weights (the bench model's 105 MB in float32) do not fit in the last-level cache: the
kernel that wins on one cached weight is not the one that wins on the model. Measured on an
AVX2 EPYC VM, one row by 512 x 1280, float32: MKL 115 us against packed oneDNN's 158 us on
one cached weight, 240 against 150 cycling through 104 MB of them (docs/benchmarks.md, "A
GEMV kernel for small decode batches"). So these regimes are probed over a working set past
the last-level cache (`working_set_bytes`), each call on the next weight, among packed oneDNN,
``F.linear`` and tandem's GEMV kernel (`tandem.kernels.gemv`). A ``batch`` is compute-bound
and probed on one weight, oneDNN against ``F.linear`` (float32), as before; bfloat16 batches
take oneDNN where it runs bfloat16 natively, else ``F.linear``.

Timings on a shared VM are noisy, so one kernel per regime is preferred and stays unless
another is faster by `MARGIN`: oneDNN for batches (what vLLM's CPU build runs), the GEMV kernel
for ``one``/``few``, where the engine gained more than the probe shows (bench model, float32,
batch1 on the AVX2 VM: 0.51-0.56 s on the kernel, 0.73 on packed oneDNN, which probed
1.2-1.3x slower), by `STACK_MARGIN` where the decode stack serves (`margin`).
``TANDEM_GEMM=onednn|torch|gemv`` skips the probe in every regime the named kernel serves.
The choice is per process, dtype and regime, made on first use (0.1-0.2 s for a regime past
the cache) and logged.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from tandem.kernels import decode_stack, gemv

logger = logging.getLogger(__name__)

Kernel = Literal["onednn", "torch", "gemv"]
KERNELS: tuple[Kernel, ...] = ("onednn", "torch", "gemv")
Regime = Literal["one", "few", "batch"]
PROBE_ROWS: dict[Regime, int] = {"one": 1, "few": gemv.MAX_ROWS, "batch": 64}
PROBE_WEIGHTS = ((1280, 512), (512, 1280))  # out, in: the bench model's MLP up and down
PROBE_REPEATS = 5
# each repeat times a kernel over at least this long: a batch's call on one cached weight takes
# under a millisecond, and a repeat of two calls could fall wholly inside one moment of another
# process's work (a peer engine spinning) and pick a kernel for the whole process on it
MIN_PROBE_SECONDS = 0.005
MARGIN = 1.1  # another kernel must be this much faster to be chosen over the preferred one
# ... at one and a few rows where the decode stack serves (`margin`)
STACK_MARGIN = 1.3
PACK_ROWS = 64  # the batch size oneDNN picks a packed layout for (it serves every row count)
MIN_WORKING_SET = 32 << 20
MAX_WORKING_SET = 256 << 20
DEFAULT_LAST_LEVEL_CACHE = 32 << 20  # where sysfs does not say


def regime(rows: int) -> Regime:
    if rows == 1:
        return "one"
    return "few" if rows <= gemv.MAX_ROWS else "batch"


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's inner product (``weight`` plain or packed by `pack`)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered into oneDNN's blocked layout (raises RuntimeError where refused)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs ``dtype`` here (bfloat16 only on native bfloat16 units)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and _bf16_native()


def _bf16_native() -> bool:
    global _bf16
    if _bf16 is None:
        _bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return _bf16


_bf16: bool | None = None


def candidates(dtype: torch.dtype, where: Regime) -> list[Kernel]:
    """The kernels that can run ``dtype`` in regime ``where`` here."""
    found: list[Kernel] = ["onednn"] if onednn_serves(dtype) else []
    found.append("torch")
    if where != "batch" and dtype in gemv.SUFFIX and gemv.available():
        found.append("gemv")
    return found


def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs lists for cpu0 (`DEFAULT_LAST_LEVEL_CACHE` if none)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=DEFAULT_LAST_LEVEL_CACHE)


def working_set_bytes() -> int:
    """Bytes of weights the ``one``/``few`` probes cycle through: twice the last-level cache,
    within `MIN_WORKING_SET` .. `MAX_WORKING_SET`."""
    return min(max(2 * last_level_cache_bytes(), MIN_WORKING_SET), MAX_WORKING_SET)


def probe(dtype: torch.dtype, where: Regime) -> dict[Kernel, float]:
    """Best seconds per call of each candidate kernel with the regime's rows: one weight of
    each of `PROBE_WEIGHTS` for ``batch``, else `working_set_bytes` of them cycled (a fresh one
    each call, as a decode step meets its layers); the kernels alternate, `PROBE_REPEATS`
    times, each time over the weights as often as `MIN_PROBE_SECONDS` takes."""
    rows = PROBE_ROWS[where]
    per_pair = sum(o * i for o, i in PROBE_WEIGHTS) * torch.empty((), dtype=dtype).element_size()
    count = len(PROBE_WEIGHTS) * (1 if where == "batch" else -(-working_set_bytes() // per_pair))
    # filled, not zeros: untouched zero pages would all read one cached page
    weights = [
        torch.full(PROBE_WEIGHTS[i % len(PROBE_WEIGHTS)], 0.5 + i / count, dtype=dtype)
        for i in range(count)
    ]
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, w.shape[1], generator=gen).to(dtype) for w in weights]
    kernels = candidates(dtype, where)
    packed = [pack(w) for w in weights] if "onednn" in kernels else []
    calls = {
        "onednn": lambda i: onednn(xs[i], packed[i], None),
        "torch": lambda i: F.linear(xs[i], weights[i]),
        "gemv": lambda i: gemv.gemv(xs[i], weights[i], None),
    }
    best = {name: float("inf") for name in kernels}
    with torch.inference_mode():
        for name in kernels:
            calls[name](0)  # first calls build primitives, widen nothing else
        for _ in range(PROBE_REPEATS):
            for name in kernels:
                done, start = 0, time.perf_counter()
                while True:
                    for i in range(count):
                        calls[name](i)
                    done += count
                    elapsed = time.perf_counter() - start
                    if elapsed >= MIN_PROBE_SECONDS:
                        break
                best[name] = min(best[name], elapsed / done)
    return best


def preferred(where: Regime) -> Kernel:
    return "onednn" if where == "batch" else "gemv"


def margin(where: Regime) -> float:
    """How much faster than the preferred kernel another must be to be chosen: `STACK_MARGIN`
    at one and a few rows where the decode stack serves (`tandem.kernels.decode_stack`: a step
    of those rows on the GEMV kernel runs every Llama layer in one C call, which a probe of
    single calls does not see; on the generate bench's mixed requests, 2-4 rows on the GEMV
    kernel ran 3-4% faster than on oneDNN, which the probe had timed up to 1.19x faster a
    call), else `MARGIN`."""
    return STACK_MARGIN if where != "batch" and decode_stack.available() else MARGIN


def choose(seconds: dict[Kernel, float], prefer: Kernel, by: float = MARGIN) -> Kernel:
    """The fastest kernel, except that ``prefer`` stays unless beaten by the factor ``by``."""
    fastest = min(seconds, key=seconds.__getitem__)
    if prefer in seconds and seconds[fastest] * by >= seconds[prefer]:
        return prefer
    return fastest


def _forced() -> Kernel | None:
    forced = os.environ.get("TANDEM_GEMM", "")
    if forced and forced not in KERNELS:
        raise ValueError(f"TANDEM_GEMM must be one of {KERNELS}, got {forced!r}")
    return forced or None  # type: ignore[return-value]


def _decide(dtype: torch.dtype, where: Regime) -> Kernel:
    kernels = candidates(dtype, where)
    forced = _forced()
    if forced in kernels:
        return forced
    if len(kernels) == 1:
        return kernels[0]
    if where == "batch" and dtype != torch.float32:
        return "onednn"  # native bfloat16 (candidates): packed oneDNN, not probed
    try:
        seconds = probe(dtype, where)
    except RuntimeError as exc:  # oneDNN will not pack here
        logger.warning("GEMM kernel (%s, %s): F.linear (the probe failed: %s)", dtype, where, exc)
        return "torch"
    chosen = choose(seconds, preferred(where), margin(where))
    logger.info(
        "GEMM kernel for %s at %s row(s): %s (%d rows by %s weights, %s: %s)",
        dtype,
        where,
        chosen,
        PROBE_ROWS[where],
        " and ".join(map(str, PROBE_WEIGHTS)),
        "one each" if where == "batch" else f"{working_set_bytes() >> 20} MiB of them",
        ", ".join(f"{name} {s * 1e6:.0f} us" for name, s in seconds.items()),
    )
    return chosen


_chosen: dict[tuple[torch.dtype, Regime], Kernel] = {}


def chosen() -> dict[str, Kernel]:
    """The kernels this process has chosen so far, as ``"<dtype>/<regime>"``: what a benchmark
    records beside its figures."""
    return {f"{str(d).removeprefix('torch.')}/{r}": k for (d, r), k in _chosen.items()}


def kernel(dtype: torch.dtype, rows: int) -> Kernel:
    """The kernel this process runs a ``rows``-row CPU matmul of ``dtype`` on (decided on first
    use per dtype and regime)."""
    key = (dtype, regime(rows))
    if key not in _chosen:
        _chosen[key] = _decide(*key)
    return _chosen[key]
