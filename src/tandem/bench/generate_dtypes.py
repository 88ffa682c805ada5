"""`tandem bench generate --engine-dtypes`: one model served by engines of each weight format,
on the workloads of `tandem bench generate` (``batch1``: one greedy request; ``grpo``: prompts
sampled ``n`` times each), to say what block-FP8 costs on CPU.

A block-FP8 engine holds e4m3 values and block scales and multiplies in its compute dtype on
the weight dequantized (`tandem.layers.fp8`). By default the dequantized weight is kept with
the layer's packed copy, remade only after a push (``fp8``, ``fp8_bf16``): a matmul then costs
what the compute dtype's does, and the memory holds the compute-dtype copy beside the FP8
weights. With ``packed_weights=False`` only the FP8 weights stay in memory and every matmul
dequantizes its weight first (``fp8_dequantize_each_call``, against ``float32_unpacked``, the
same engine option on float32 weights). Engines:

- ``float32``; ``bfloat16`` and ``fp8_bf16`` (compute in bfloat16) where the CPU has native
  bf16 (else skipped, said why);
- ``fp8``: ``quantization="fp8"``, compute float32;
- ``float32_unpacked`` / ``fp8_dequantize_each_call``: ``packed_weights=False``.

All engines stay up and take the runs in turn (a noisy moment hits all alike); each side's
best run counts, after an untimed warm-up.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from typing import Any

import torch

from tandem import LLM
from tandem.bench.compute import ModelShape
from tandem.bench.generate import SETUPS, bench_model_dir
from tandem.bench.generate_bf16 import native_bf16_missing
from tandem.bench.generate_tandem import sample, tandem
from tandem.bench.generate_timing import ratio, scenario_entry, time_sides
from tandem.bench.generate_workloads import (
    fresh_runs,
    greedy_workloads,
    grpo_workload,
    read_bench_model,
)

ENGINES: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "fp8": {"dtype": "float32", "quantization": "fp8"},
    "fp8_bf16": {"dtype": "bfloat16", "quantization": "fp8"},
    "float32_unpacked": {"dtype": "float32", "packed_weights": False},
    "fp8_dequantize_each_call": {
        "dtype": "float32",
        "quantization": "fp8",
        "packed_weights": False,
    },
}
NEEDS_BF16 = ("bfloat16", "fp8_bf16")
# ratio name -> (side, baseline)
RATIOS = {
    "fp8_vs_float32": ("fp8", "float32"),
    "fp8_bf16_vs_bfloat16": ("fp8_bf16", "bfloat16"),
    "bfloat16_vs_float32": ("bfloat16", "float32"),
    "fp8_dequantize_each_call_vs_float32_unpacked": (
        "fp8_dequantize_each_call",
        "float32_unpacked",
    ),
}


def run(quick: bool = False) -> dict[str, Any]:
    setup = SETUPS[quick]
    path = bench_model_dir(setup)
    config, eos_ids = read_bench_model(path)
    vocab = config["vocab_size"]
    shape = ModelShape.from_config(config)
    rng = random.Random(0)
    batch1, _ = greedy_workloads(rng, vocab, eos_ids, setup.batch1, setup.mixed)
    _, n, _, _, new = setup.grpo
    grpo = grpo_workload(rng, vocab, eos_ids, setup.grpo)
    runs = fresh_runs(rng, vocab, eos_ids, batch1=batch1, grpo=grpo)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim
    kv_tokens = n * sum(len(p) + new + 16 for p, _ in grpo)
    missing = native_bf16_missing()
    engines = {k: v for k, v in ENGINES.items() if not (missing and k in NEEDS_BF16)}
    result: dict[str, Any] = {
        "benchmark": "generate_engine_dtypes",
        "quick": quick,
        "model": {
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "intermediate": config["intermediate_size"],
            "vocab": vocab,
        },
        "threads": torch.get_num_threads(),
        "engines": engines,
        "bf16": {"skipped": missing} if missing else {},
    }
    with ExitStack() as stack:
        llms = {
            name: stack.enter_context(
                LLM(
                    str(path),
                    enable_prefix_caching=True,
                    kv_cache_memory=kv_per_token * 4 * kv_tokens,
                    **options,
                )
            )
            for name, options in engines.items()
        }
        greedy = {name: (lambda reqs, llm=llm: tandem(llm, reqs)) for name, llm in llms.items()}
        samples = {
            name: (lambda ps, llm=llm: sample(llm, ps, n, new)) for name, llm in llms.items()
        }
        warm = [p for p, _ in grpo[:2]]
        for llm in llms.values():  # warm-ups
            tandem(llm, batch1)
            sample(llm, warm, n, 8)
        result["batch1"] = time_sides(scenario_entry(batch1), greedy, runs["batch1"])
        entry = scenario_entry(grpo)
        entry.update(samples_per_prompt=n, new_tokens=new)
        prompts = [[p for p, _ in reqs] for reqs in runs["grpo"]]
        result["grpo"] = time_sides(entry, samples, prompts)
    result["ratios"] = {
        f"{scenario}_{name}": ratio(result[scenario], side, base)
        for scenario in ("batch1", "grpo")
        for name, (side, base) in RATIOS.items()
        if side in engines and base in engines
    }
    return result


def summary(result: dict[str, Any]) -> str:
    lines = []
    for scenario in ("batch1", "grpo"):
        e = result[scenario]
        figures = ", ".join(f"{name} {e[f'{name}_tokens_per_s']:.0f}" for name in result["engines"])
        lines.append(f"{scenario} tokens/s: {figures}")
    lines += [f"{k}: {v:.3f}x" for k, v in result["ratios"].items()]
    if result["bf16"]:
        lines.append(f"bfloat16 engines skipped: {result['bf16']['skipped']}")
    return "\n".join(lines)
