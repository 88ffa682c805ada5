"""Wall time of each part of a benchmark run (``phase_seconds`` in its JSON)."""

from __future__ import annotations

import time


class Phases:
    """``lap(name)``: the seconds since the previous lap (or since made) go to ``seconds``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._clock = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._clock, 2)
        self._clock = now
