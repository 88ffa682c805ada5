"""The demo's verifiable toy task: answer in digits.

Prompts are arithmetic questions (``"Q: 12 + 7 = ?\\nA:"``); the reward is checked on the
generated text alone: the fraction of its non-space characters that are digits (0 for an empty
answer). An untrained model writes mostly letters and punctuation (reward ~0.05 on the tiny
model's 512-token vocabulary), so the signal is dense and a policy gradient moves it within
tens of steps on a CPU.
"""

from __future__ import annotations

import random


class DigitsTask:
    name = "digits"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def prompts(self, step: int, count: int) -> list[str]:
        rng = random.Random(self.seed * 1_000_003 + step)
        return [f"Q: {rng.randint(0, 99)} + {rng.randint(0, 99)} = ?\nA:" for _ in range(count)]

    @staticmethod
    def reward(text: str) -> float:
        chars = [c for c in text if not c.isspace()]
        if not chars:
            return 0.0
        return sum(c.isdigit() for c in chars) / len(chars)
