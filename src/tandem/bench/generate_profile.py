"""`tandem bench generate --profile`: where tandem's engine spends its time, per step, on the
generate bench's model and on its second shape with real sizes (`SMOL_SETUPS`: a Llama of 30
layers of hidden 576, 9 heads over 3 kv heads of size 64, intermediate 1536 and a tied
49,152-token vocabulary, random weights from `tandem make-tiny-model`'s builder), for the
mixed and grpo workloads of the generate bench, in float32 and, where the CPU has native bf16,
bfloat16.

Each (shape, dtype, workload): one engine (one process: the model runs in this one; prefix
caching on, as in the generate bench), an untimed warm-up, one timed run, then one run under
cProfile, each on fresh prompt ids of the workload's lengths. The profiled run's time is split
by the functions that do the work (tottime, or cumtime where a call does only that): the
body's matmuls (oneDNN's packed linear and tandem's GEMV kernel, the LM head taken out), the
LM head (``compute_logits``: its matmul over the sampled rows), decode and prefill attention
(tandem's paged kernels), pointwise kernels (norms, rotary, SiLU, scatter), sampling, the rest
of the model runner's step (Python per layer and per step: building inputs, module calls), and
what runs outside the model runner (scheduling, outputs). ``profile_overhead``: the profiled
run's wall over the timed one. Figures per step (the engine's step count) and as fractions.
"""

from __future__ import annotations

import cProfile
import pstats
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.bench.generate import SETUPS, SMOL_SETUPS, Inputs, Setup
from tandem.bench.generate_bf16 import native_bf16_missing
from tandem.bench.generate_tandem import sample, tandem


def shapes(quick: bool) -> dict[str, Setup]:
    """The generate bench's two shapes: its model's setup and the second shape's."""
    return {"bench": SETUPS[quick], "smol": SMOL_SETUPS[quick]}


# category -> (how: "tt" own time or "ct" with callees, a pattern over "file:function")
PARTS = {
    "matmul": ("tt", r"(mkldnn\._linear_pointwise>|_C\._nn\.linear>|kernels/gemv\.py:gemv)$"),
    "lm_head": ("ct", r"models/\w+\.py:compute_logits$"),
    "decode_attention": ("tt", r"kernels/paged\.py:paged_decode$"),
    "prefill_attention": ("tt", r"kernels/paged_prefill\.py:paged_prefill$"),
    "pointwise": ("tt", r"kernels/pointwise\.py:(?!greedy).*$"),
    "sampling": ("ct", r"(layers/sampler\.py:__call__|kernels/pointwise\.py:greedy)$"),
}
STEP = r"engine/model_runner\.py:execute$"


def split(stats: pstats.Stats, wall: float, steps: int) -> dict[str, Any]:
    """The profiled run's seconds by `PARTS`: ms per step and fractions of the wall time."""

    def total(how: str, pattern: str) -> float:
        found = re.compile(pattern)
        return sum(
            (tt if how == "tt" else ct)
            for (file, _, name), (_, _, tt, ct, _) in stats.stats.items()
            if found.search(f"{file}:{name}")
        )

    seconds = {part: total(how, pattern) for part, (how, pattern) in PARTS.items()}
    seconds["matmul"] -= seconds["lm_head"]  # the LM head's matmul counted once, as its own
    step = total("ct", STEP)
    seconds["rest_of_step"] = step - sum(seconds.values())
    seconds["outside_step"] = wall - step
    return {
        "ms_per_step": {k: round(1000 * v / steps, 3) for k, v in seconds.items()},
        "fraction": {k: round(v / wall, 3) for k, v in seconds.items()},
    }


def one(path: Path, dtype: str, work: Callable[[Any, list], int], runs: list[list]) -> dict:
    """``work(llm, requests)`` (the generate bench's own call for the workload: it returns
    the tokens, checked per request) on ``runs``: the warm-up's, the timed run's and the
    profiled run's requests (the same lengths, fresh prompt ids each: no run reuses a prefix
    another cached)."""
    from tandem import LLM

    warm, timed_run, profiled_run = runs
    with LLM(str(path), dtype=dtype) as llm:  # prefix caching on, as the generate bench's
        work(llm, warm)
        t0 = time.perf_counter()
        work(llm, timed_run)
        timed = time.perf_counter() - t0
        before = llm.engine.stats().steps
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        tokens = work(llm, profiled_run)
        profile.disable()
        wall = time.perf_counter() - t0
        steps = llm.engine.stats().steps - before
    return {
        "seconds": round(timed, 3),
        "tokens": tokens,
        "steps": steps,
        "profile_overhead": round(wall / timed, 3),
        **split(pstats.Stats(profile), wall, steps),
    }


def run(quick: bool = False) -> dict[str, Any]:
    dtypes = ["float32"] + ([] if native_bf16_missing() else ["bfloat16"])
    result: dict[str, Any] = {
        "benchmark": "generate-profile",
        "quick": quick,
        "dtypes": dtypes,
        "bfloat16": native_bf16_missing() or "native",
        "shapes": {},
    }
    for name, setup in shapes(quick).items():
        inputs = Inputs.of(setup, tp=1, pp=1)  # the generate bench's workloads and runs
        w, config = inputs.workloads, inputs.config
        work = {
            "mixed": (tandem, [w.mixed, *inputs.runs["mixed"][:2]]),
            "grpo": (
                lambda llm, reqs, w=w: sample(llm, [p for p, _ in reqs], w.n, w.new),
                [w.grpo, *inputs.runs["grpo"][:2]],
            ),
        }
        entry: dict[str, Any] = {
            "layers": config["num_hidden_layers"],
            "hidden": config["hidden_size"],
            "vocab": config["vocab_size"],
            "tied": config.get("tie_word_embeddings", False),
        }
        for dtype in dtypes:
            for workload, (call, runs) in work.items():
                entry[f"{workload}_{dtype}"] = one(inputs.path, dtype, call, runs)
        result["shapes"][name] = entry
    result["ratios"] = {
        f"{name}_{key}_matmul_fraction": figures["fraction"]["matmul"]
        for name, entry in result["shapes"].items()
        for key, figures in entry.items()
        if isinstance(figures, dict)
    }
    return result


def summary(result: dict[str, Any]) -> str:
    lines = []
    for name, entry in result["shapes"].items():
        for key, figures in entry.items():
            if isinstance(figures, dict):
                parts = ", ".join(f"{k} {v:.0%}" for k, v in figures["fraction"].items())
                head = f"{name} {key}: {figures['seconds']} s, {figures['steps']} steps"
                lines.append(f"{head}; {parts}")
    return "\n".join(lines)
