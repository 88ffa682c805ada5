"""`tandem bench generate`: greedy generation throughput, tandem vs. transformers.

Both sides load the same random-init Llama (float32, CPU, same torch thread count) and decode
greedily with EOS ignored, so every request yields exactly its requested number of tokens.
Throughput is useful tokens (the sum of requested output lengths, identical on both sides)
divided by wall-clock seconds, prefill included. Two scenarios:

- ``batch1``: one 64-token prompt, 64 new tokens.
- ``mixed``: 64 requests, prompt lengths uniform in 8..256, output lengths uniform in 16..128.
  tandem gets them all in one ``LLM.generate`` call (continuous batching); transformers runs
  them in arrival order in left-padded batches of 16, each with ``max_new_tokens`` set to the
  largest request in its batch.

Each side gets one untimed warm-up per scenario, then each scenario is timed 3 times per side,
the sides alternating, and the best run counts. Prompts are random token ids (fixed seeds) that
never contain the EOS id. ``--quick`` shrinks the model and the workload to seconds.

- ``batching``: the same mixed requests on tandem's engine (``--tp``/``--pp`` ranks) with a
  batch capacity of 16 sequences, once with continuous (iteration-level) batching and once with
  static FIFO batches (a batch runs until all its requests finish, then the next is admitted:
  the request-level baseline Energon-AI compared against). Throughput, mean and p99 request
  latency (all requests arrive at once) for each.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
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
# quick -> (model dir, overrides, vocab, batch1 (prompt, new),
#           mixed (requests, min prompt, max prompt, min output, max output))
SETUPS: dict[bool, tuple[str, dict[str, Any], int, tuple[int, int], tuple[int, ...]]] = {
    False: (".tandem/bench-llama-30m", FULL_MODEL, 8192, (64, 64), (64, 8, 256, 16, 128)),
    True: (".tandem/bench-llama-quick", QUICK_MODEL, 1024, (16, 16), (24, 8, 64, 4, 32)),
}
HF_BATCH = 16
BATCH_CAPACITY = 16  # sequences per step in the continuous-vs-static comparison
REPEATS = 3

Request = tuple[list[int], int]  # prompt ids, requested output tokens


def run(quick: bool = False, tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """Build (or reuse) the model, time every scenario on every side, return the figures."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise RuntimeError(
            "tandem bench generate compares against transformers, which is not installed; "
            "install the test extra: pip install -e '.[test]'"
        ) from None
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model_dir, overrides, vocab, (b1_prompt, b1_new), mixed_shape = SETUPS[quick]
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        make_tiny_model(path, "llama", seed=0, vocab_size=vocab, overrides=overrides)
    config = json.loads((path / "config.json").read_text())
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    eos_ids = {eos} if isinstance(eos, int) else set(eos)
    vocab = config["vocab_size"]
    rng = random.Random(0)
    batch1 = [(_prompt(rng, b1_prompt, vocab, eos_ids), b1_new)]
    n_req, p_lo, p_hi, o_lo, o_hi = mixed_shape
    mixed = [
        (_prompt(rng, rng.randint(p_lo, p_hi), vocab, eos_ids), rng.randint(o_lo, o_hi))
        for _ in range(n_req)
    ]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    kv_tokens = sum(len(p) + n + 16 for p, n in mixed)  # every request resident: no preemption
    engine_options = dict(
        dtype="float32", kv_cache_memory=kv_per_token * kv_tokens,
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
    )  # fmt: skip
    llm = LLM(str(path), **engine_options)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore EOS, as tandem's ignore_eos does
    pad = min(eos_ids)
    sides = {"tandem": lambda reqs: _tandem(llm, reqs), "transformers": lambda r: _hf(hf, r, pad)}
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
    scenarios = {
        "batch1": (batch1, batch1),
        "mixed": (mixed, [(p, min(n, 8)) for p, n in mixed[:HF_BATCH]]),
    }
    for name, (reqs, warmup) in scenarios.items():
        entry: dict[str, Any] = {"tokens": sum(n for _, n in reqs), "requests": len(reqs)}
        entry["prompt_tokens"] = sum(len(p) for p, _ in reqs)
        for fn in sides.values():
            fn(warmup)
        times: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(REPEATS):  # sides alternate, so a noisy moment hits both alike
            for side, fn in sides.items():
                seconds, produced = _timed(fn, reqs)
                times[side].append(seconds)
                entry[f"{side}_tokens_counted"] = produced
        for side, seconds in times.items():
            entry[f"{side}_seconds"] = round(min(seconds), 4)
            entry[f"{side}_tokens_per_s"] = round(entry["tokens"] / min(seconds), 2)
        entry["timing"] = f"best of {REPEATS} runs per side"
        result[name] = entry
    result["mixed"]["transformers_batch_size"] = HF_BATCH
    result["ratios"] = {
        f"{name}_vs_transformers": round(
            result[name]["tandem_tokens_per_s"] / result[name]["transformers_tokens_per_s"], 3
        )
        for name in scenarios
    }
    llm.shutdown()
    result["batching"] = _batching(path, engine_options, mixed)
    result["ratios"]["continuous_vs_static"] = round(
        result["batching"]["continuous"]["tokens_per_s"]
        / result["batching"]["static"]["tokens_per_s"],
        3,
    )
    return result


def _batching(path: Path, options: dict[str, Any], reqs: list[Request]) -> dict[str, Any]:
    """Continuous vs static batches on the same engine and capacity (best of REPEATS each)."""
    out: dict[str, Any] = {"batch_capacity": BATCH_CAPACITY, "requests": len(reqs)}
    for mode in ("continuous", "static"):
        with LLM(str(path), max_num_seqs=BATCH_CAPACITY, batching=mode, **options) as llm:
            _tandem(llm, [(p, min(n, 4)) for p, n in reqs[:BATCH_CAPACITY]])  # warm-up
            best = None
            for _ in range(REPEATS):
                start = time.perf_counter()
                outs = _generate(llm, reqs)
                seconds = time.perf_counter() - start
                if best is None or seconds < best[0]:
                    best = (seconds, outs)
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
        }
    out["timing"] = f"best of {REPEATS} runs per mode"
    return out


def _prompt(rng: random.Random, length: int, vocab: int, eos_ids: set[int]) -> list[int]:
    allowed = [t for t in range(vocab) if t not in eos_ids]
    return [rng.choice(allowed) for _ in range(length)]


def _timed(fn: Callable[[list[Request]], int], reqs: list[Request]) -> tuple[float, int]:
    """Wall seconds of one run, and the useful tokens it produced (checked)."""
    start = time.perf_counter()
    produced = fn(reqs)
    seconds = time.perf_counter() - start
    expected = sum(n for _, n in reqs)
    if produced != expected:
        raise RuntimeError(f"generated {produced} useful tokens, expected {expected}")
    return seconds, produced


def _generate(llm: LLM, reqs: list[Request]):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    return llm.generate([p for p, _ in reqs], params)


def _tandem(llm: LLM, reqs: list[Request]) -> int:
    """All requests in one call; returns the tokens produced (checked per request)."""
    outs = _generate(llm, reqs)
    counts = [len(o.outputs[0].token_ids) for o in outs]
    if counts != [n for _, n in reqs]:
        raise RuntimeError(f"tandem produced {counts} tokens, asked {[n for _, n in reqs]}")
    return sum(counts)


@torch.inference_mode()
def _hf(model: Any, reqs: list[Request], pad: int) -> int:
    """Left-padded batches of HF_BATCH in arrival order; returns the useful tokens produced."""
    useful = 0
    for i in range(0, len(reqs), HF_BATCH):
        chunk = reqs[i : i + HF_BATCH]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (p, _) in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(n for _, n in chunk)
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
            eos_token_id=None, pad_token_id=pad,
        )  # fmt: skip
        if out.shape[1] != width + new:  # EOS must not stop a batch early
            raise RuntimeError(f"transformers generated {out.shape[1] - width}, asked {new}")
        useful += sum(min(n, out.shape[1] - width) for _, n in chunk)  # the rest is waste
    return useful
