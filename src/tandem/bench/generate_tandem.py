"""The tandem sides of `tandem bench generate`: greedy requests, n samples per prompt, and
continuous vs static batching on the same engine. Every call checks each request's token count.
Calls ask for token ids only (``detokenize=False``), as the vLLM side does and as
transformers' ``generate`` returns them: no side makes output text.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tandem import LLM, SamplingParams
from tandem.bench.generate_peers import Request
from tandem.engine.stats import EngineStats

GRPO_SEED = 0
BATCH_CAPACITY = 16  # sequences per step in the continuous-vs-static comparison


def engine_figures(before: EngineStats, after: EngineStats) -> dict[str, Any]:
    """What the engine did over the timed runs: prefix-cache hits, tokens per step by kind."""
    steps = after.steps - before.steps
    queried = after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    prefill = after.prefill_tokens - before.prefill_tokens
    decode = after.decode_tokens - before.decode_tokens
    return {
        "steps": steps,
        "prefix_cache_hit_rate": round(hits / queried, 4) if queried else 0.0,
        "prefill_tokens_per_step": round(prefill / steps, 2) if steps else 0.0,
        "decode_tokens_per_step": round(decode / steps, 2) if steps else 0.0,
        "preemptions": after.num_preemptions - before.num_preemptions,
    }


def batching(
    path: Path, options: dict[str, Any], warm: list[Request], runs: list[list[Request]]
) -> dict[str, Any]:
    """Continuous vs static batches on the same engine and capacity (best of the runs each,
    every run on fresh prompts, so no run is served from an earlier one's cached prefixes)."""
    out: dict[str, Any] = {"batch_capacity": BATCH_CAPACITY, "requests": len(runs[0])}
    for mode in ("continuous", "static"):
        with LLM(str(path), max_num_seqs=BATCH_CAPACITY, batching=mode, **options) as llm:
            tandem(llm, [(p, min(n, 4)) for p, n in warm])  # warm-up
            best = None
            before = llm.engine.stats()
            for reqs in runs:
                start = time.perf_counter()
                outs = _generate(llm, reqs)
                seconds = time.perf_counter() - start
                if best is None or seconds < best[0]:
                    best = (seconds, outs)
            engine = engine_figures(before, llm.engine.stats())
        seconds, outs = best
        latencies = sorted(o.metrics.latency for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[mode] = {
            "seconds": round(seconds, 4),
            "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 2),
            "latency_mean_s": round(sum(latencies) / len(latencies), 4),
            "latency_p99_s": round(
                latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4
            ),
            "engine": engine,
        }
    out["timing"] = f"best of {len(runs)} runs per mode, each on fresh prompts"
    return out


def _generate(llm: LLM, reqs: list[Request]):
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        for _, n in reqs
    ]
    return llm.generate([p for p, _ in reqs], params)


def tandem(llm: LLM, reqs: list[Request]) -> int:
    """All requests in one call; returns the tokens produced (checked per request)."""
    outs = _generate(llm, reqs)
    counts = [len(o.outputs[0].token_ids) for o in outs]
    if counts != [n for _, n in reqs]:
        raise RuntimeError(f"tandem produced {counts} tokens, asked {[n for _, n in reqs]}")
    return sum(counts)


def sample(llm: LLM, prompts: list[list[int]], n: int, new: int) -> int:
    """n samples of ``new`` tokens per prompt in one call; returns the tokens (checked each)."""
    params = SamplingParams(
        n=n,
        temperature=1.0,
        top_p=1.0,
        max_tokens=new,
        ignore_eos=True,
        seed=GRPO_SEED,
        detokenize=False,
    )
    outs = llm.generate(prompts, params)
    counts = [len(c.token_ids) for o in outs for c in o.outputs]
    if counts != [new] * (len(prompts) * n):
        raise RuntimeError(f"tandem produced {counts} tokens, asked {new} for each of {n} samples")
    return sum(counts)
