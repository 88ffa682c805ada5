"""The demo's task: reverse a digit string. The reward depends on the prompt.

A prompt shows ``digits`` random digits (``"Q:472\\nA:"``); the right completion is them
reversed (``"274"``), then the end of text. The reward is checked on the decoded completion:
its first line, stripped, is compared with the answer position by position, and the matches are
divided by the longer of the two lengths (so extra characters cost as much as wrong ones; an
empty completion scores 0).

Every digit string of that length is a problem; a fixed, seeded set of them is **held out** and
never trained on (neither in the warm-up nor in RL) — greedy accuracy on it is the demo's eval.
No fixed completion does well: `constant_policy_reward` computes the best mean reward any
single completion gets on a problem set (about 0.1 plus sampling noise for uniform digits).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    digits: str  # what the prompt shows

    @property
    def prompt(self) -> str:
        return f"Q:{self.digits}\nA:"

    @property
    def answer(self) -> str:
        return self.digits[::-1]


def _answer_line(text: str) -> str:
    stripped = text.strip()
    return stripped.split("\n", 1)[0].strip()


class ReverseTask:
    name = "reverse"

    def __init__(self, seed: int = 0, digits: int = 3, held_out: int = 100):
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        space = [f"{i:0{digits}d}" for i in range(10**digits)]
        if not 0 < held_out < len(space):
            raise ValueError(f"held_out must be in [1, {len(space) - 1}], got {held_out}")
        self.seed, self.digits = seed, digits
        held = set(random.Random(f"held-out/{seed}").sample(space, held_out))
        self._held_out = [Problem(s) for s in space if s in held]
        self._train = [Problem(s) for s in space if s not in held]

    def problems(self, step: int, count: int, stream: str = "rl") -> list[Problem]:
        """``count`` training problems for ``step`` of ``stream`` ("rl" or "warmup"): seeded,
        drawn without replacement within a step, never from the held-out set."""
        rng = random.Random(f"{stream}/{self.seed}/{step}")
        return rng.sample(self._train, min(count, len(self._train)))

    def held_out(self) -> list[Problem]:
        return list(self._held_out)

    @staticmethod
    def reward(problem: Problem, text: str) -> float:
        got, want = _answer_line(text), problem.answer
        if not got:
            return 0.0
        return sum(a == b for a, b in zip(got, want, strict=False)) / max(len(got), len(want))

    @staticmethod
    def exact(problem: Problem, text: str) -> bool:
        return _answer_line(text) == problem.answer

    def constant_policy_reward(self, problems: list[Problem]) -> float:
        """The best mean reward one fixed completion gets on ``problems``.

        Every answer has ``digits`` characters, so a completion of that length has the fixed
        denominator ``digits`` and its score is a sum of independent per-position terms:
        the best one takes the most common answer character at each position. A shorter one
        drops positions with the same denominator; a longer one only grows the denominator.
        So that per-position mode string is the optimum (the unit test checks it against every
        string up to one character longer).
        """
        best = "".join(
            Counter(p.answer[i] for p in problems).most_common(1)[0][0] for i in range(self.digits)
        )
        return sum(self.reward(p, best) for p in problems) / len(problems)
