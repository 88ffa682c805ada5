"""How `tandem bench generate` times its sides: best of the runs per side, the sides
alternating run by run, every run's token count checked."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from tandem.bench.generate_peers import Request


@dataclass(frozen=True)
class SelfTimed:
    """What a side in another process returns: the tokens produced, the seconds it timed
    itself there (its own cost), and the round trip from here (with the transfer)."""

    tokens: int
    seconds: float
    round_trip_seconds: float


Side = Callable[[Any], int | SelfTimed]


def scenario_entry(reqs: list[Request]) -> dict[str, Any]:
    return {
        "tokens": sum(k for _, k in reqs),
        "requests": len(reqs),
        "prompt_tokens": sum(len(p) for p, _ in reqs),
    }


def time_sides(
    entry: dict[str, Any],
    sides: dict[str, Side],
    runs: list[Any],
    started: dict[str, Callable[[], AbstractContextManager]] | None = None,
) -> dict[str, Any]:
    """Best of the runs per side (after the caller's warm-up), the sides alternating so that a
    noisy moment hits all alike; run r of each side gets ``runs[r]``, inside ``started[side]()``
    when given (set up and torn down untimed). Each side checks its requests' token counts;
    their sum is checked against the entry's here. A side returning `SelfTimed` is timed by
    its own figure, its round trip going to ``<side>_round_trip_seconds``."""
    started = started or {}
    times: dict[str, list[float]] = {side: [] for side in sides}
    round_trips: dict[str, list[float]] = {}
    for reqs in runs:
        for side, fn in sides.items():
            with started.get(side, nullcontext)():
                start = time.perf_counter()
                produced = fn(reqs)
                seconds = time.perf_counter() - start
            if isinstance(produced, SelfTimed):
                round_trips.setdefault(side, []).append(produced.round_trip_seconds)
                produced, seconds = produced.tokens, produced.seconds
            times[side].append(seconds)
            if produced != entry["tokens"]:
                raise RuntimeError(f"{side} produced {produced} tokens, expected {entry['tokens']}")
            entry[f"{side}_tokens_counted"] = produced
    for side, seconds in times.items():
        entry[f"{side}_seconds"] = round(min(seconds), 4)
        entry[f"{side}_tokens_per_s"] = round(entry["tokens"] / min(seconds), 2)
    for side, seconds in round_trips.items():
        entry[f"{side}_round_trip_seconds"] = round(min(seconds), 4)
    entry["timing"] = f"best of {len(runs)} runs per side, each on fresh prompts"
    return entry


def keyed(seconds: dict[int, float]) -> dict[str, float]:
    return {str(size): s for size, s in seconds.items()}


def ratio(entry: dict[str, Any], side: str, baseline: str) -> float:
    return round(entry[f"{side}_tokens_per_s"] / entry[f"{baseline}_tokens_per_s"], 3)
