"""What ``dtype="auto"`` runs in: resolved once, in the engine process, before any rank is
built, so every rank (worker processes, Ray actors, other nodes) is handed the concrete name.

- an explicit dtype is kept as given;
- ``TANDEM_AUTO_DTYPE=<name>`` in the environment resolves ``auto`` to that name without a
  probe (the test suite sets ``float32``);
- on a device other than the CPU, ``auto`` is ``bfloat16`` (as vLLM's ``auto`` casts a float32
  checkpoint to the device's half type);
- on the CPU a short probe times the engine's matmul (`tandem.layers.gemm.linear`: oneDNN in
  float32 where it won its own probe) at this rank's largest weight
  matrix (clipped to `MAX_DIM`) for a decode batch of `DECODE_ROWS` rows, in float32 and in
  bfloat16, best of `SAMPLES`, on the thread count each rank runs with, and picks bfloat16
  when its GFLOP/s are at least `MARGIN` times float32's. A small screening matmul goes
  first: where bfloat16 is emulated (no bfloat16 units: up to ~200x slower) the probe
  stops there rather than time the model-sized matmul.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from tandem.config import EngineConfig
from tandem.dtypes import DTYPES
from tandem.layers.gemm import linear
from tandem.models.loader import ModelSpec
from tandem.parallel import TPGroup

AUTO_ENV = "TANDEM_AUTO_DTYPE"
DECODE_ROWS = 64  # the probe's batch: a decode step's rows
MAX_DIM = 2048  # wider weights are probed at this width: the dtypes' ratio is what decides
SCREEN_SHAPE = (DECODE_ROWS, 128, 128)
SCREEN_FLOOR = 0.5  # bfloat16 under this share of float32's rate at the screen: emulated, stop
MARGIN = 1.25  # bfloat16 is chosen only when clearly faster than float32
SAMPLES = 5  # best of this many samples (fewer where TIMING_BUDGET_S runs out)
TIMING_BUDGET_S = 0.05  # per dtype and shape: no sample starts after this (a busy machine)
SAMPLE_FLOPS = 1e7  # a sample repeats the call up to about this much work (timer resolution)

Shape = tuple[int, int, int]  # (rows, in features, out features)
Timer = Callable[[torch.dtype, Shape], float]  # best seconds per call
Source = Literal["configured", "environment", "device", "probe"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype an engine runs in, and why."""

    dtype: str  # a name in `tandem.dtypes.DTYPES`
    source: Source
    reason: str
    float32_gflops: float | None = None  # measured by the probe (at `shape`)
    bfloat16_gflops: float | None = None
    shape: Shape | None = None


@torch.inference_mode()
def time_linear(dtype: torch.dtype, shape: Shape) -> float:
    """Best seconds per call of the engine's own matmul (`tandem.layers.gemm.linear`, as the
    engine runs it: no autograd) of ``shape`` in ``dtype`` over up to `SAMPLES` samples
    (after one warm-up call)."""
    rows, k, n = shape
    x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
    linear(x, w)
    calls = max(1, round(SAMPLE_FLOPS / _flops(shape)))
    best = math.inf
    deadline = time.perf_counter() + TIMING_BUDGET_S
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(calls):
            linear(x, w)
        best = min(best, (time.perf_counter() - start) / calls)
        if time.perf_counter() > deadline:
            break
    return best


def probe(shape: Shape, threads: int, timer: Timer = time_linear) -> DtypeChoice:
    """bfloat16 or float32 for matmuls of ``shape`` on ``threads`` threads (see the module)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        f32, bf16 = _rates(SCREEN_SHAPE, timer)
        if bf16 < SCREEN_FLOOR * f32:
            return _choice(f32, bf16, SCREEN_SHAPE, threads, "bfloat16 looks emulated: ")
        return _choice(*_rates(shape, timer), shape, threads)
    finally:
        torch.set_num_threads(previous)


def _rates(shape: Shape, timer: Timer) -> tuple[float, float]:
    return (_flops(shape) / timer(torch.float32, shape) / 1e9,
            _flops(shape) / timer(torch.bfloat16, shape) / 1e9)  # fmt: skip


def _choice(f32: float, bf16: float, shape: Shape, threads: int, why: str = "") -> DtypeChoice:
    dtype = "bfloat16" if bf16 >= MARGIN * f32 else "float32"
    rows, k, n = shape
    on = "1 thread" if threads == 1 else f"{threads} threads"
    reason = (f"{why}bfloat16 matmuls at {bf16 / f32:.2f}x float32's ({bf16:.1f} vs "
              f"{f32:.1f} GFLOP/s, {rows}x{k} by {k}x{n}, {on}; bfloat16 needs "
              f"{MARGIN}x)")  # fmt: skip
    return DtypeChoice(dtype, "probe", reason, f32, bf16, shape)


def _flops(shape: Shape) -> int:
    return 2 * math.prod(shape)


def probe_shape(spec: ModelSpec, tp: int) -> Shape:
    """A decode batch through tensor-parallel rank 0's largest weight matrix (clipped)."""
    with torch.device("meta"):
        model = spec.cls(spec.config, TPGroup(0, tp))
    out, inp = max((p.shape for p in model.parameters() if p.dim() == 2), key=math.prod)
    return DECODE_ROWS, min(inp, MAX_DIM), min(out, MAX_DIM)


def rank_threads(world_size: int, nnodes: int) -> int:
    """The threads each rank computes with: the engine's own with one rank in process, else
    the host's cores shared among its ranks (as `tandem.engine.worker` sets them)."""
    if world_size == 1:
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // (world_size // nnodes))


def resolve_dtype(config: EngineConfig, spec: ModelSpec) -> DtypeChoice:
    """The concrete dtype ``config`` runs ``spec`` in, and why (logged)."""
    choice = _resolve(config, spec)
    log.info("dtype %s (%s): %s", choice.dtype, choice.source, choice.reason)
    return choice


def _resolve(config: EngineConfig, spec: ModelSpec) -> DtypeChoice:
    if config.dtype != "auto":
        return DtypeChoice(config.dtype, "configured", f"dtype={config.dtype!r} was given")
    pinned = os.environ.get(AUTO_ENV)
    if pinned is not None:
        if pinned not in DTYPES:
            raise ValueError(f"{AUTO_ENV}={pinned!r}: must be one of {sorted(DTYPES)}")
        return DtypeChoice(pinned, "environment", f"{AUTO_ENV}={pinned} (no probe)")
    if config.torch_device.type != "cpu":
        device = config.torch_device.type
        return DtypeChoice("bfloat16", "device", f"auto on {device}: bfloat16 (as vLLM's auto "
                           "for a float32 checkpoint)")  # fmt: skip
    parallel = config.parallel
    return probe(
        probe_shape(spec, parallel.tensor_parallel_size),
        rank_threads(parallel.world_size, parallel.nnodes),
    )
