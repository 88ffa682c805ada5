"""The scenarios of `tandem bench generate` that pit tandem against vLLM alone, in one dtype:
the bfloat16 ones (where the CPU has native bf16) and those of the second model shape.

batch1, mixed and grpo again, on tandem's engine built with that ``dtype`` and on vLLM started
with it (no transformers side), timed as in the first shape's float32 runs: an untimed warm-up
per scenario, then the sides alternating over the same fresh-prompt runs, best of them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch

from tandem import LLM
from tandem.bench.compute import ModelShape, compute_figures
from tandem.bench.generate_peers import Request
from tandem.bench.generate_tandem import sample, tandem
from tandem.bench.generate_timing import Side, scenario_entry, time_sides
from tandem.bench.generate_vllm import VllmPeer
from tandem.bench.generate_workloads import Workloads, read_bench_model

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16_missing() -> str | None:
    """Why bf16 is skipped on this CPU, or None when /proc/cpuinfo lists a native bf16 flag."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "no /proc/cpuinfo to read the CPU's bf16 flags from"
    if flags.isdisjoint(BF16_FLAGS):
        return f"no {'/'.join(BF16_FLAGS)} on this CPU"
    return None


def vllm_scenarios(
    path: Path,
    engine_options: dict[str, Any],
    dtype: str,
    peer: Callable[[], AbstractContextManager[VllmPeer | None]],
    workloads: Workloads,
    runs: dict[str, list[list[Request]]],
    warm_requests: int,
) -> dict[str, Any]:
    """Every scenario on tandem in ``dtype`` and, when ``peer()`` gives one, vLLM in it."""
    out: dict[str, Any] = {}
    w, n, new = workloads, workloads.n, workloads.new
    shape = ModelShape.from_config(read_bench_model(path)[0])
    options = {**engine_options, "dtype": dtype}
    with ExitStack() as stack:
        llm = stack.enter_context(LLM(str(path), enable_prefix_caching=True, **options))
        # before vLLM starts, whose start-up would disturb the matmul kernel probes of the
        # engine's first calls (a prompt batch, two rows, one: `gemm_choice`)
        tandem(llm, [*w.batch1, (w.mixed[0][0], 8)])
        vllm = stack.enter_context(peer())

        def timed(name: str, sides: dict[str, Side], runs: list[Any]) -> dict[str, Any]:
            e = time_sides(scenario_entry(getattr(w, name)), sides, runs)
            seconds = {side: e[f"{side}_seconds"] for side in sides}
            e["compute"] = compute_figures(
                shape, w.sequences(name), w.rows(name), getattr(torch, dtype), seconds
            )
            return e

        greedy: dict[str, Side] = {"tandem": lambda reqs: tandem(llm, reqs)}
        samples: dict[str, Side] = {"tandem": lambda ps: sample(llm, ps, n, new)}
        if vllm is not None:
            out["vllm"] = vllm.describe()
            greedy["vllm"] = vllm.greedy
            samples["vllm"] = lambda ps: vllm.sample(ps, n, new)
        for side in greedy.values():  # warm-ups
            side(w.batch1)
        out["batch1"] = timed("batch1", greedy, runs["batch1"])
        warm = [(p, min(k, 8)) for p, k in w.mixed[:warm_requests]]
        for side in greedy.values():
            side(warm)
        out["mixed"] = timed("mixed", greedy, runs["mixed"])
        warm_prompts = [p for p, _ in w.grpo[:2]]
        sample(llm, warm_prompts, n, 8)
        if vllm is not None:
            vllm.sample(warm_prompts, n, 8)
        out["grpo"] = timed("grpo", samples, [[p for p, _ in reqs] for reqs in runs["grpo"]])
    return out
