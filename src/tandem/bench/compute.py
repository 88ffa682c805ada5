"""How close a side of `tandem bench generate` comes to the machine's matmul peak.

``model_flops`` counts the useful FLOPs of a workload, approximately: 2 FLOPs per weight of
every projection (q, k, v, o, gate, up, down) per forwarded token, where the forwarded tokens
are each prompt once (its n samples share it) plus every generated token but the last (whose
successor is never asked for); the LM head (2 * hidden * vocab) once per generated token (the
first from the prompt's last position), as engines compute logits only there; and attention, 2
* 2 * heads * head_dim FLOPs (QK^T and PV) per layer for every key a forwarded token attends to
(causal: position i sees i + 1 keys). Norms, rotary, activations and the sampler are left out.

``matmul_peak`` is the machine's measured ceiling for the model at one batch's row count: each
of the model's projection shapes (rows x in by in x out) timed in the run's dtype and torch
threads on every kernel that can run it here (``F.linear``; oneDNN on a packed weight where
it runs the dtype; tandem's GEMV kernel at up to `gemv.MAX_ROWS` rows), the fastest one's
best of REPEATS, weighted by how often a forward runs each shape: the GFLOP/s a perfect engine
would reach spending all its time in these GEMMs. The weight is timed from cache, where a
decode step's come from memory; prefill runs at more rows. So a fraction of peak can pass 1
where the prompts' rows dominate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import ceil
from typing import Any

import torch
import torch.nn.functional as F

from tandem.kernels import gemv
from tandem.layers import gemm_choice

REPEATS = 5
MIN_TIMED_SECONDS = 0.01  # calls per timed repeat: enough to last this long

Sequences = list[tuple[int, int, int]]  # (prompt tokens, new tokens per sample, samples)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Llama-style config.json."""
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
        )

    def projections(self) -> dict[str, tuple[int, int, int]]:
        """name -> (in features, out features, times one forward token runs it)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q": (self.hidden, q, self.layers),
            "kv": (self.hidden, kv, 2 * self.layers),
            "o": (q, self.hidden, self.layers),
            "gate_up": (self.hidden, self.intermediate, 2 * self.layers),
            "down": (self.intermediate, self.hidden, self.layers),
            "lm_head": (self.hidden, self.vocab, 1),
        }


def model_flops(shape: ModelShape, seqs: Sequences) -> int:
    """Useful FLOPs of generating ``seqs`` (see the module docstring)."""
    body = 2 * sum(
        i * o * n for name, (i, o, n) in shape.projections().items() if name != "lm_head"
    )
    head = 2 * shape.hidden * shape.vocab
    attention = 4 * shape.layers * shape.heads * shape.head_dim
    total = 0
    for prompt, new, samples in seqs:
        decoded = samples * (new - 1)
        keys = prompt * (prompt + 1) // 2 + samples * ((new - 1) * prompt + (new - 1) * new // 2)
        total += body * (prompt + decoded) + head * samples * new + attention * keys
    return total


def matmul_peak(shape: ModelShape, rows: int, dtype: torch.dtype) -> dict[str, Any]:
    """The measured GFLOP/s of the model's projections at ``rows`` tokens (module docstring)."""
    gflops, flops, seconds = {}, 0.0, 0.0
    with torch.inference_mode():
        for name, (n_in, n_out, count) in shape.projections().items():
            x = torch.randn(rows, n_in, dtype=dtype)
            w = torch.randn(n_out, n_in, dtype=dtype)
            best = min(_best_seconds(fn, x, w) for fn in _kernels(x, w))
            gflops[name] = _figure(2 * rows * n_in * n_out / best / 1e9)
            flops += 2 * rows * n_in * n_out * count
            seconds += best * count
    return {
        "peak_gflops": _figure(flops / seconds / 1e9),
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "shapes_gflops": gflops,
    }


def _kernels(x: torch.Tensor, w: torch.Tensor) -> list:
    """Every way this machine can compute ``x @ w.T`` (`matmul_peak`)."""
    found = [F.linear]
    if gemm_choice.onednn_serves(w.dtype):
        packed = gemm_choice.pack(w)
        found.append(lambda x, _w: gemm_choice.onednn(x, packed, None))
    if gemv.fits(x, w):
        found.append(lambda x, w: gemv.gemv(x, w, None))
    return found


def compute_figures(
    shape: ModelShape, seqs: Sequences, rows: int, dtype: torch.dtype, seconds: dict[str, float]
) -> dict[str, Any]:
    """An entry's ``compute``: the peak at ``rows``, the workload's useful FLOPs, and each
    side's fraction of that peak given its seconds."""
    peak = matmul_peak(shape, rows, dtype)
    flops = model_flops(shape, seqs)
    out: dict[str, Any] = {**peak, "model_flops": flops}
    for side, s in seconds.items():
        out[f"{side}_fraction_of_peak"] = _figure(flops / s / (peak["peak_gflops"] * 1e9))
    return out


def _figure(x: float) -> float:
    return float(f"{x:.4g}")


def _best_seconds(fn, *args: torch.Tensor) -> float:
    fn(*args)  # warm-up
    start = time.perf_counter()
    fn(*args)
    reps = max(1, ceil(MIN_TIMED_SECONDS / max(time.perf_counter() - start, 1e-9)))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / reps)
    return best
