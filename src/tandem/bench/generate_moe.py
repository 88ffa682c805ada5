"""`tandem bench generate --model-family qwen3_moe`: mixture-of-experts generation throughput,
tandem vs. transformers on the same random-init Qwen3-MoE (float32, CPU, same threads).

Two scenarios, run as in `tandem.bench.generate` (EOS ignored, every request's token count
checked, an untimed warm-up, best of 3 alternating runs on fresh prompts):

- ``batch1``: one prompt, greedy decode.
- ``mixed``: many requests of mixed prompt and output lengths, greedy; tandem gets them in one
  ``LLM.generate`` call (``--tp`` ranks hold whole experts each: expert parallel).

The baseline is transformers' ``model.generate`` on its own MoE implementation, tuned: its
``experts_implementation`` is the fastest of ``eager`` (a loop over the experts hit),
``grouped_mm`` and ``batched_mm`` on a short greedy workload (``transformers_experts_seconds``;
on this CPU ``grouped_mm`` wins), and for ``mixed``, as in the dense bench, requests sorted by
length in left-padded batches of the fastest size of 8/16/32/64.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM
from tandem.bench.generate_peers import StaticBatches, load
from tandem.bench.generate_tandem import tandem
from tandem.bench.generate_timing import keyed, ratio, scenario_entry, time_sides
from tandem.bench.generate_workloads import fresh_runs, greedy_workloads, read_bench_model
from tandem.models.tiny import make_tiny_model

FULL: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1280,
    "moe_intermediate_size": 256,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
}
QUICK: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 320,
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
}
# (model dir, overrides, vocab, batch1 (prompt, new), mixed (requests, prompt lo/hi, out lo/hi))
SETUPS = {
    False: (".tandem/bench-qwen3-moe", FULL, 8192, (64, 64), (48, 8, 192, 16, 96)),
    True: (".tandem/bench-qwen3-moe-quick", QUICK, 1024, (16, 16), (16, 8, 48, 4, 24)),
}
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def run(quick: bool = False, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    model_dir, overrides, vocab_size, batch1_shape, mixed_shape = SETUPS[quick]
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        make_tiny_model(path, "qwen3_moe", seed=0, vocab_size=vocab_size, overrides=overrides)
    config, eos_ids = read_bench_model(path)
    vocab = config["vocab_size"]
    rng = random.Random(0)
    batch1, mixed = greedy_workloads(rng, vocab, eos_ids, batch1_shape, mixed_shape)
    runs = fresh_runs(rng, vocab, eos_ids, batch1=batch1, mixed=mixed)
    warm = [(p, min(k, 8)) for p, k in mixed[:8]]
    hf, experts_seconds = _fastest_experts(path, min(eos_ids), warm)
    static = StaticBatches(hf, pad=min(eos_ids))
    result: dict[str, Any] = {
        "benchmark": "generate",
        "model_family": "qwen3_moe",
        "model": {
            "params": sum(p.numel() for p in hf.parameters()),
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "experts": config["num_experts"],
            "experts_per_token": config["num_experts_per_tok"],
            "expert_intermediate": config["moe_intermediate_size"],
            "vocab": vocab,
            "dtype": "float32",
        },
        "threads": torch.get_num_threads(),
        "quick": quick,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "transformers_experts_implementation": hf.config._experts_implementation,
        "transformers_experts_seconds": experts_seconds,
    }
    options = dict(
        dtype="float32",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_memory=256 << 20,
    )
    with LLM(str(path), **options) as llm:
        tandem(llm, batch1)  # warm-ups
        static(batch1)
        sides = {"tandem": lambda reqs: tandem(llm, reqs), "transformers": static}
        result["batch1"] = time_sides(scenario_entry(batch1), sides, runs["batch1"])
        tandem(llm, warm)
        static(warm, 8)
        mixed_entry = scenario_entry(mixed)
        mixed_entry["transformers_batch_seconds"] = keyed(static.tune(mixed))
        mixed_entry["transformers_batch_size"] = static.batch_size
        result["mixed"] = time_sides(mixed_entry, sides, runs["mixed"])
    result["ratios"] = {
        "moe_batch1_vs_transformers": ratio(result["batch1"], "tandem", "transformers"),
        "moe_mixed_vs_transformers": ratio(result["mixed"], "tandem", "transformers"),
    }
    return result


def _fastest_experts(path: Path, pad: int, reqs: list) -> tuple[Any, dict[str, float]]:
    """transformers' model with the fastest experts implementation on ``reqs`` (each timed
    once after a warm-up), and every implementation's seconds."""
    seconds, models = {}, {}
    for impl in EXPERTS_IMPLEMENTATIONS:
        model = load(path, experts_implementation=impl)
        static = StaticBatches(model, pad=pad)
        static(reqs[:2], 2)  # warm-up
        start = time.perf_counter()
        static(reqs, len(reqs))
        seconds[impl] = round(time.perf_counter() - start, 4)
        models[impl] = model
    return models[min(seconds, key=seconds.get)], seconds
