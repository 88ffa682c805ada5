"""`tandem bench generate`: generation throughput, tandem vs. transformers, one process.

Every side runs the same random-init Llama (float32, CPU, the same torch threads) with EOS
ignored (tandem ``ignore_eos=True``; transformers ``eos_token_id=None``, -1 in its continuous
batching), so each request yields exactly its requested tokens: every run checks each request's
count and raises on a mismatch. Throughput = useful tokens (requested output tokens, the same on
every side) / wall seconds, prefill included. Prompts are random ids (fixed seeds) without EOS.
Each side gets an untimed warm-up per scenario, then 3 timed runs, the sides alternating; the
best counts. Run r of every side gets the same prompts, fresh ids of the workload's lengths, so
no run reuses a prefix cached by the warm-up or an earlier run. ``--quick``: see SETUPS.

Scenarios (full sizes):

- ``batch1``: one 64-token prompt, 64 new tokens, greedy.
- ``mixed``: 64 requests, prompts of 8..256 tokens, outputs of 16..128, greedy; tandem gets them
  all in one ``LLM.generate`` call.
- ``grpo``: an RL rollout: 12 prompts of 64..192 tokens, each sampled n=8 times at temperature 1
  (top-p 1, no top-k), 64 new tokens each: ``LLM.generate(prompts, SamplingParams(n=8,
  temperature=1.0, max_tokens=64, ignore_eos=True, seed=0))``, on an engine with
  ``enable_prefix_caching=True`` (``tandem``) and on one with it off
  (``tandem_no_prefix_caching``); ``ratios.prefix_sharing`` = the first / the second.

Baselines (`tandem.bench.generate_peers`):

- ``transformers`` (batch1, mixed): plain ``model.generate``. For mixed, tuned: requests sorted
  by (output, prompt) length and cut into left-padded batches, each decoding to its longest
  output; after the warm-up each batch size of 8/16/32/64 runs the workload once and the
  fastest serves the timed runs (``transformers_batch_size``, ``transformers_batch_seconds``).
- ``transformers_cb`` (mixed, grpo): transformers' continuous batching, on its own instance of
  the model loaded with ``attn_implementation="sdpa"`` (transformers 5 deprecates the
  ``"paged|sdpa"`` spelling and maps it to this). grpo submits
  ``GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
  num_return_sequences=8, max_new_tokens=64, eos_token_id=-1)``: the n samples are forks of
  each prompt's request after its prefill. mixed submits one ``add_request(ids,
  max_new_tokens=k, eos_token_id=-1)`` per request (``generate_batch`` takes one length for
  all). Both go to one manager (``init_continuous_batching`` + ``start``), started and warmed
  (untimed) before each of its timed runs and stopped after: left idle, its loop keeps torch's
  OpenMP threads spinning, which slowed the other sides by ~30%.
  ``transformers_cb_generate_batch_seconds`` is one plain ``model.generate_batch`` call on the
  grpo workload, which also builds, starts and stops a manager. Tuned via
  ``ContinuousBatchingConfig``: ``page_size`` 32, ``num_blocks`` holding every sequence at once
  (no offloading), ``max_batch_tokens`` 2048 (tandem's default tokens per step), and
  ``max_requests_per_batch`` the fastest of 16/32/64 (capped at the sequence count), each tried
  once on the workload after a warm-up (``transformers_cb_config``,
  ``transformers_cb_requests_per_batch_seconds``). On CPU it attends with ``sdpa`` over the
  whole step under a block-diagonal mask (no flash kernel, no decode fast path, no CUDA
  graphs), so a step's attention grows with the square of its sequences.

- ``batching``: the mixed requests on tandem's engine (``--tp``/``--pp`` ranks) with a batch
  capacity of 16 sequences, once with continuous (iteration-level) batching and once with
  static batches, run as a static system would: length-sorted batches of 16 that run until all
  their requests finish before the next is admitted, split over the steps in flight so
  pipeline stages overlap (the request-level baseline Energon-AI compared against).
  Throughput, mean and p99 request latency (all requests arrive at once) for each.

``grpo.tandem_engine`` and ``batching.<mode>.engine`` report what tandem's engine did over the
timed runs: prefix-cache hit rate (admitted prompt tokens served from shared or cached blocks),
prefill and decode tokens per step, preemptions.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem import LLM
from tandem.bench.generate_peers import ContinuousBatching, Request, StaticBatches, load
from tandem.bench.generate_tandem import (
    BATCH_CAPACITY,
    GRPO_SEED,
    batching,
    engine_figures,
    sample,
    tandem,
)
from tandem.models.tiny import make_tiny_model

FULL_MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1280,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
QUICK_MODEL: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 320,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class Setup:
    model_dir: str
    overrides: dict[str, Any]
    vocab: int
    batch1: tuple[int, int]  # prompt, new tokens
    mixed: tuple[int, int, int, int, int]  # requests, min/max prompt, min/max output
    grpo: tuple[int, int, int, int, int]  # prompts, samples each, min/max prompt, new tokens


SETUPS: dict[bool, Setup] = {
    False: Setup(".tandem/bench-llama-30m", FULL_MODEL, 8192, (64, 64), (64, 8, 256, 16, 128),
                 (12, 8, 64, 192, 64)),
    True: Setup(".tandem/bench-llama-quick", QUICK_MODEL, 1024, (16, 16), (24, 8, 64, 4, 32),
                (4, 4, 16, 48, 16)),
}  # fmt: skip
WARMUP_REQUESTS = 16
REPEATS = 3


def run(quick: bool = False, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """Build (or reuse) the model, time every scenario on every side, return the figures."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise RuntimeError(
            "tandem bench generate compares against transformers, which is not installed; "
            "install the bench extra: pip install -e '.[bench]'"
        ) from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    setup = SETUPS[quick]
    path = Path(setup.model_dir)
    if not (path / "config.json").is_file():
        make_tiny_model(path, "llama", seed=0, vocab_size=setup.vocab, overrides=setup.overrides)
    config, eos_ids = read_bench_model(path)
    vocab = config["vocab_size"]
    rng = random.Random(0)
    batch1, mixed = greedy_workloads(rng, vocab, eos_ids, setup.batch1, setup.mixed)
    n_prompts, n, g_lo, g_hi, new = setup.grpo
    grpo = [  # (prompt, useful tokens: n samples of `new`)
        (_prompt(rng, rng.randint(g_lo, g_hi), vocab, eos_ids), n * new) for _ in range(n_prompts)
    ]
    runs = fresh_runs(rng, vocab, eos_ids, batch1=batch1, mixed=mixed, grpo=grpo)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    kv_tokens = max(  # every sequence resident, unshared: no preemption
        sum(len(p) + k + 16 for p, k in mixed), n * sum(len(p) + new + 16 for p, _ in grpo)
    )
    engine_options = dict(
        dtype="float32", kv_cache_memory=kv_per_token * kv_tokens,
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
    )  # fmt: skip
    hf = load(path)
    static = StaticBatches(hf, pad=min(eos_ids))
    hf_cb = load(path, "sdpa")  # its own instance: the manager switches and caches on the model
    result: dict[str, Any] = {
        "benchmark": "generate",
        "model": {
            "params": sum(p.numel() for p in hf.parameters()),
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "heads": config["num_attention_heads"],
            "kv_heads": config["num_key_value_heads"],
            "vocab": vocab,
            "dtype": "float32",
        },
        "threads": torch.get_num_threads(),
        "quick": quick,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
    }
    with LLM(str(path), enable_prefix_caching=True, **engine_options) as llm:
        tandem(llm, batch1)  # warm-ups
        static(batch1)
        sides = {"tandem": lambda reqs: tandem(llm, reqs), "transformers": static}
        result["batch1"] = _time_sides(_entry(batch1), sides, runs["batch1"])

        warm = [(p, min(k, 8)) for p, k in mixed[:WARMUP_REQUESTS]]
        tandem(llm, warm)  # warm-ups
        static(warm, WARMUP_REQUESTS)
        entry = _entry(mixed)
        entry["transformers_batch_seconds"] = _keyed(static.tune(mixed))
        entry["transformers_batch_size"] = static.batch_size
        with ContinuousBatching(hf_cb, [(len(p), k) for p, k in mixed]) as cb:
            tried = cb.tune(lambda: cb.greedy(warm), lambda: cb.greedy(runs["mixed"][0]))
            entry["transformers_cb_requests_per_batch_seconds"] = _keyed(tried)
            entry["transformers_cb_config"] = cb.describe()
            sides = {
                "tandem": lambda reqs: tandem(llm, reqs),
                "transformers": static,
                "transformers_cb": cb.greedy,
            }
            started = {"transformers_cb": lambda: cb.running(lambda: cb.greedy(warm))}
            result["mixed"] = _time_sides(entry, sides, runs["mixed"], started)

        prompts = [[p for p, _ in reqs] for reqs in runs["grpo"]]
        warm = [p for p, _ in grpo[:2]]
        seqs = [(len(p), new) for p, _ in grpo for _ in range(n)]
        with (
            LLM(str(path), enable_prefix_caching=False, **engine_options) as llm_np,
            ContinuousBatching(hf_cb, seqs, n) as cb,
        ):
            sample(llm, warm, n, 8)  # warm-ups
            sample(llm_np, warm, n, 8)
            entry = _entry(grpo)
            entry.update(samples_per_prompt=n, new_tokens=new, seed=GRPO_SEED)
            tried = cb.tune(lambda: cb.sample(warm, 8), lambda: cb.sample(prompts[0], new))
            entry["transformers_cb_requests_per_batch_seconds"] = _keyed(tried)
            entry["transformers_cb_config"] = cb.describe()
            sides = {
                "tandem": lambda ps: sample(llm, ps, n, new),
                "tandem_no_prefix_caching": lambda ps: sample(llm_np, ps, n, new),
                "transformers_cb": lambda ps: cb.sample(ps, new),
            }
            before = llm.engine.stats(), llm_np.engine.stats()
            started = {"transformers_cb": lambda: cb.running(lambda: cb.sample(warm, 8))}
            result["grpo"] = _time_sides(entry, sides, prompts, started)
            entry["tandem_engine"] = engine_figures(before[0], llm.engine.stats())
            entry["tandem_no_prefix_caching_engine"] = engine_figures(
                before[1], llm_np.engine.stats()
            )
            start = time.perf_counter()  # one plain generate_batch call, for the record
            cb.generate_batch([p for p, _ in grpo], new)
            entry["transformers_cb_generate_batch_seconds"] = round(time.perf_counter() - start, 4)
    result["ratios"] = {
        "batch1_vs_transformers": _ratio(result["batch1"], "tandem", "transformers"),
        "mixed_vs_transformers": _ratio(result["mixed"], "tandem", "transformers"),
        "mixed_vs_transformers_cb": _ratio(result["mixed"], "tandem", "transformers_cb"),
        "grpo_vs_transformers_cb": _ratio(result["grpo"], "tandem", "transformers_cb"),
        "prefix_sharing": _ratio(result["grpo"], "tandem", "tandem_no_prefix_caching"),
    }
    result["batching"] = batching(path, engine_options, mixed[:BATCH_CAPACITY], runs["mixed"])
    result["ratios"]["continuous_vs_static"] = round(
        result["batching"]["continuous"]["tokens_per_s"]
        / result["batching"]["static"]["tokens_per_s"],
        3,
    )
    return result


def read_bench_model(path: Path) -> tuple[dict[str, Any], set[int]]:
    """A bench model directory's config.json and its EOS ids."""
    config = json.loads((path / "config.json").read_text())
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    return config, {eos} if isinstance(eos, int) else set(eos)


def greedy_workloads(
    rng: random.Random, vocab: int, eos_ids: set[int], batch1: tuple[int, int],
    mixed: tuple[int, int, int, int, int],
) -> tuple[list[Request], list[Request]]:  # fmt: skip
    """``batch1`` (prompt, new tokens) as one request; ``mixed`` (requests, prompt lengths
    lo..hi, outputs lo..hi) as that many random ones."""
    one = [(_prompt(rng, batch1[0], vocab, eos_ids), batch1[1])]
    n_req, p_lo, p_hi, o_lo, o_hi = mixed
    many = [
        (_prompt(rng, rng.randint(p_lo, p_hi), vocab, eos_ids), rng.randint(o_lo, o_hi))
        for _ in range(n_req)
    ]
    return one, many


def fresh_runs(
    rng: random.Random, vocab: int, eos_ids: set[int], **workloads: list[Request]
) -> dict[str, list[list[Request]]]:
    """Timed run r of every side gets runs[name][r]: the workload's lengths with fresh prompt
    ids, so no run reuses a prefix cached by the warm-up (the originals) or an earlier run."""
    return {
        name: [[(_prompt(rng, len(p), vocab, eos_ids), k) for p, k in reqs] for _ in range(REPEATS)]
        for name, reqs in workloads.items()
    }


def _entry(reqs: list[Request]) -> dict[str, Any]:
    return {
        "tokens": sum(k for _, k in reqs),
        "requests": len(reqs),
        "prompt_tokens": sum(len(p) for p, _ in reqs),
    }


def _time_sides(
    entry: dict[str, Any],
    sides: dict[str, Callable[[list[Request]], int]],
    runs: list[Any],
    started: dict[str, Callable[[], AbstractContextManager]] | None = None,
) -> dict[str, Any]:
    """Best of REPEATS per side (after the caller's warm-up), the sides alternating so that a
    noisy moment hits all alike; run r of each side gets ``runs[r]``, inside ``started[side]()``
    when given (set up and torn down untimed). Each side checks its requests' token counts;
    their sum is checked against the entry's here."""
    started = started or {}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for reqs in runs:
        for side, fn in sides.items():
            with started.get(side, nullcontext)():
                start = time.perf_counter()
                produced = fn(reqs)
                times[side].append(time.perf_counter() - start)
            if produced != entry["tokens"]:
                raise RuntimeError(f"{side} produced {produced} tokens, expected {entry['tokens']}")
            entry[f"{side}_tokens_counted"] = produced
    for side, seconds in times.items():
        entry[f"{side}_seconds"] = round(min(seconds), 4)
        entry[f"{side}_tokens_per_s"] = round(entry["tokens"] / min(seconds), 2)
    entry["timing"] = f"best of {len(runs)} runs per side, each on fresh prompts"
    return entry


def _keyed(seconds: dict[int, float]) -> dict[str, float]:
    return {str(size): s for size, s in seconds.items()}


def _ratio(entry: dict[str, Any], side: str, baseline: str) -> float:
    return round(entry[f"{side}_tokens_per_s"] / entry[f"{baseline}_tokens_per_s"], 3)


def _prompt(rng: random.Random, length: int, vocab: int, eos_ids: set[int]) -> list[int]:
    allowed = [t for t in range(vocab) if t not in eos_ids]
    return [rng.choice(allowed) for _ in range(length)]
