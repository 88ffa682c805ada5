"""The workloads of `tandem bench generate`: random prompt ids (without EOS, fixed seeds) of
each scenario's lengths, and fresh ids of the same lengths for every timed run."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.generate_peers import Request

REPEATS = 3  # timed runs per side; the best counts


def read_bench_model(path: Path) -> tuple[dict[str, Any], set[int]]:
    """A bench model directory's config.json and its EOS ids."""
    config = json.loads((path / "config.json").read_text())
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    return config, {eos} if isinstance(eos, int) else set(eos)


def greedy_workloads(
    rng: random.Random,
    vocab: int,
    eos_ids: set[int],
    batch1: tuple[int, int],
    mixed: tuple[int, int, int, int, int],
) -> tuple[list[Request], list[Request]]:
    """``batch1`` (prompt, new tokens) as one request; ``mixed`` (requests, prompt lengths
    lo..hi, outputs lo..hi) as that many random ones."""
    one = [(prompt_ids(rng, batch1[0], vocab, eos_ids), batch1[1])]
    n_req, p_lo, p_hi, o_lo, o_hi = mixed
    many = [
        (prompt_ids(rng, rng.randint(p_lo, p_hi), vocab, eos_ids), rng.randint(o_lo, o_hi))
        for _ in range(n_req)
    ]
    return one, many


def grpo_workload(
    rng: random.Random, vocab: int, eos_ids: set[int], grpo: tuple[int, int, int, int, int]
) -> list[Request]:
    """``grpo`` (prompts, samples each, min/max prompt, new tokens) as that many random
    prompts, each with its useful tokens: n samples of ``new``."""
    n_prompts, n, lo, hi, new = grpo
    return [
        (prompt_ids(rng, rng.randint(lo, hi), vocab, eos_ids), n * new) for _ in range(n_prompts)
    ]


def fresh_runs(
    rng: random.Random, vocab: int, eos_ids: set[int], **workloads: list[Request]
) -> dict[str, list[list[Request]]]:
    """Timed run r of every side gets runs[name][r]: the workload's lengths with fresh prompt
    ids, so no run reuses a prefix cached by the warm-up (the originals) or an earlier run."""
    return {
        name: [
            [(prompt_ids(rng, len(p), vocab, eos_ids), k) for p, k in reqs] for _ in range(REPEATS)
        ]
        for name, reqs in workloads.items()
    }


def prompt_ids(rng: random.Random, length: int, vocab: int, eos_ids: set[int]) -> list[int]:
    allowed = [t for t in range(vocab) if t not in eos_ids]
    return [rng.choice(allowed) for _ in range(length)]


@dataclass(frozen=True)
class Workloads:
    """The three scenarios' requests: greedy ``batch1`` and ``mixed``, and ``grpo``'s prompts
    (each with its useful tokens: ``n`` samples of ``new``)."""

    batch1: list[Request]
    mixed: list[Request]
    grpo: list[Request]
    n: int
    new: int

    def sequences(self, name: str) -> list[tuple[int, int, int]]:
        """(prompt tokens, new tokens per sample, samples) of each prompt in scenario ``name``."""
        if name == "grpo":
            return [(len(p), self.new, self.n) for p, _ in self.grpo]
        return [(len(p), k, 1) for p, k in getattr(self, name)]

    def rows(self, name: str) -> int:
        """Sequences decoding at once when all of the scenario's are in flight."""
        return sum(samples for _, _, samples in self.sequences(name))
