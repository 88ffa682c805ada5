"""`tandem bench encode`: scoring mixed-length inputs with a BERT classifier, tandem's unpadded
batches vs transformers' padded ones (same model, float32, CPU, same torch threads).

Every side classifies the same inputs (random token ids, lengths drawn uniformly from a range,
in arrival order) and its logits are checked against tandem's (max |diff| <= 1e-3), so all do
the same work. Throughput = input tokens / wall seconds; best of 3 alternating runs, each on
fresh ids of the same lengths, after an untimed warm-up.

Sides:

- ``tandem``: ``LLM(task="classify").classify(inputs)``: one flat batch of every token, packed
  without padding up to the engine's token budget (``max_num_batched_tokens``), attention per
  sequence.
- ``transformers``: ``BertForSequenceClassification`` (sdpa attention) on padded batches,
  tuned the way a user would: inputs sorted by length (little padding) and the fastest batch
  size of 8/16/32/64 (``transformers_batch_seconds``).
- ``transformers_arrival``: the same, batches taken in arrival order (how requests come in
  without a sorting queue), at the batch size tuned for it.

``ratios.unpadded_vs_transformers`` compares against the tuned, sorted side (the strongest);
``ratios.unpadded_vs_transformers_arrival`` against arrival-order batches.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM
from tandem.models.tiny import make_tiny_model

FULL: dict[str, Any] = {
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
}
QUICK: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
}
# (model dir, overrides, vocab, inputs, min length, max length)
SETUPS = {
    False: (".tandem/bench-bert", FULL, 8192, 128, 8, 256),
    True: (".tandem/bench-bert-quick", QUICK, 1024, 24, 4, 64),
}
BATCH_SIZES = (8, 16, 32, 64)
REPEATS = 3


class PaddedBatches:
    """transformers on padded batches (attention mask, token types 0), sorted by length or in
    arrival order; returns the logits in input order."""

    def __init__(self, model, pad: int, sort: bool):
        self.model, self.pad, self.sort = model, pad, sort
        self.batch_size = BATCH_SIZES[0]

    @torch.inference_mode()
    def __call__(self, inputs: list[list[int]], batch_size: int | None = None) -> torch.Tensor:
        size = batch_size or self.batch_size
        order = (
            sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
            if self.sort
            else list(range(len(inputs)))
        )
        out = torch.empty(len(inputs), self.model.config.num_labels)
        for b in range(0, len(order), size):
            chunk = order[b : b + size]
            width = max(len(inputs[i]) for i in chunk)
            ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
                mask[row, : len(inputs[i])] = 1
            out[chunk] = self.model(input_ids=ids, attention_mask=mask).logits.float()
        return out

    def tune(self, inputs: list[list[int]]) -> dict[str, float]:
        seconds = {}
        for size in BATCH_SIZES:
            start = time.perf_counter()
            self(inputs, size)
            seconds[str(size)] = round(time.perf_counter() - start, 4)
        self.batch_size = int(min(seconds, key=seconds.get))
        return seconds


def run(quick: bool = False, tp: int = 1) -> dict[str, Any]:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model_dir, overrides, vocab_size, count, lo, hi = SETUPS[quick]
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        make_tiny_model(path, "bert", seed=0, vocab_size=vocab_size, overrides=overrides)
    config = json.loads((path / "config.json").read_text())
    vocab = config["vocab_size"]
    rng = random.Random(0)
    lengths = [rng.randint(lo, hi) for _ in range(count)]

    def fresh() -> list[list[int]]:
        return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]

    warm, runs = fresh(), [fresh() for _ in range(REPEATS)]
    tokens = sum(lengths)
    hf = transformers.BertForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    sides = {
        "transformers": PaddedBatches(hf, 0, sort=True),
        "transformers_arrival": PaddedBatches(hf, 0, sort=False),
    }
    result: dict[str, Any] = {
        "benchmark": "encode",
        "model": {
            "params": sum(p.numel() for p in hf.parameters()),
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "heads": config["num_attention_heads"],
            "vocab": vocab,
            "dtype": "float32",
        },
        "threads": torch.get_num_threads(),
        "quick": quick,
        "tensor_parallel_size": tp,
        "inputs": count,
        "tokens": tokens,
        "length_range": [lo, hi],
    }
    with LLM(str(path), task="classify", tensor_parallel_size=tp, dtype="float32") as llm:
        reference = torch.tensor(llm.classify(warm))  # warm-up
        for name, side in sides.items():
            diff = (side(warm) - reference).abs().max().item()
            if diff > 1e-3:
                raise RuntimeError(f"{name} logits differ from tandem's by {diff}")
            result[f"{name}_batch_seconds"] = side.tune(warm)
            result[f"{name}_batch_size"] = side.batch_size
        times: dict[str, list[float]] = {"tandem": [], **{name: [] for name in sides}}
        for inputs in runs:
            start = time.perf_counter()
            got = torch.tensor(llm.classify(inputs))
            times["tandem"].append(time.perf_counter() - start)
            for name, side in sides.items():
                start = time.perf_counter()
                theirs = side(inputs)
                times[name].append(time.perf_counter() - start)
                diff = (theirs - got).abs().max().item()
                if diff > 1e-3:
                    raise RuntimeError(f"{name} logits differ from tandem's by {diff}")
    result["padded_tokens_sorted"] = _padded(lengths, result["transformers_batch_size"], True)
    result["padded_tokens_arrival"] = _padded(lengths, result["transformers_arrival_batch_size"])
    for name, seconds in times.items():
        result[f"{name}_seconds"] = round(min(seconds), 4)
        result[f"{name}_tokens_per_s"] = round(tokens / min(seconds), 1)
    result["timing"] = f"best of {REPEATS} alternating runs per side, fresh ids each run"
    rate = {name: result[f"{name}_tokens_per_s"] for name in times}
    result["ratios"] = {
        "unpadded_vs_transformers": round(rate["tandem"] / rate["transformers"], 3),
        "unpadded_vs_transformers_arrival": round(rate["tandem"] / rate["transformers_arrival"], 3),
    }
    return result


def _padded(lengths: list[int], size: int, sort: bool = False) -> int:
    """Tokens a padded side computes (its batches' widths x rows)."""
    order = sorted(lengths) if sort else lengths
    return sum(
        max(order[b : b + size]) * len(order[b : b + size]) for b in range(0, len(order), size)
    )
