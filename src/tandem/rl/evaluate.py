"""The demo's checks of learning and of agreement, run at eval points.

- **Held-out accuracy**: the engine answers every held-out problem greedily; the mean task
  reward (per-digit accuracy) and the exact-match rate are recorded.
- **Whole-distribution agreement**: a few held-out problems with their right answers appended
  are scored by the engine (``prompt_logprobs`` over the whole vocabulary) and by the trainers
  (their own forward, FSDP2 shards gathered); at every answer position the KL divergence
  KL(engine || trainer) of the two next-token distributions and the largest |log-prob gap| over
  the vocabulary are reported. Unlike the sampled-token check, this covers the tokens the
  policy does *not* pick.
- **Weights moved**: the largest change of the engine's probe log-probs since the previous
  eval point (0 would mean the pushes changed nothing the engine serves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem import LLM, SamplingParams
from tandem.rl.task import Problem, ReverseTask
from tandem.rl.trainers import TrainerGroup


@dataclass
class EvalPoint:
    phase: str  # "init" (before the warm-up), "start" (after it, before RL), "rl"
    step: int  # RL steps done
    version: int  # the engine's weight version
    reward: float  # greedy mean reward on the held-out problems
    exact: float  # greedy exact-match rate on them
    kl_max: float  # max over probe positions of KL(engine || trainer)
    kl_mean: float
    logprob_gap_max: float  # max |engine - trainer| log-prob over every token at those positions
    probe_change: float | None  # max |engine log-prob change| since the previous eval point


def next_token_kl(p_logprobs: list[float], q_logprobs: list[float]) -> float:
    """KL(p || q) of two full next-token distributions given as log-probs."""
    if len(p_logprobs) != len(q_logprobs):
        raise ValueError(f"vocabulary sizes differ: {len(p_logprobs)} != {len(q_logprobs)}")
    return sum(math.exp(a) * (a - b) for a, b in zip(p_logprobs, q_logprobs, strict=True))


def _max_gap(rows: list[list[float]], others: list[list[float]]) -> float:
    """The largest |difference| between two equally shaped sets of log-prob rows."""
    return max(
        abs(a - b)
        for row, other in zip(rows, others, strict=True)
        for a, b in zip(row, other, strict=True)
    )


class Evaluator:
    def __init__(self, llm: LLM, trainers: TrainerGroup, task: ReverseTask, probes: int = 4):
        self.llm, self.trainers, self.task = llm, trainers, task
        self.problems = task.held_out()
        self.params = SamplingParams(temperature=0.0, max_tokens=task.digits + 1)
        eos = llm.engine.spec.eos_token_ids[0]
        self._probe = [self._probe_sequence(p, llm.tokenizer, eos) for p in self.problems[:probes]]
        self._previous: list[list[float]] | None = None

    @staticmethod
    def _probe_sequence(problem: Problem, tok, eos: int) -> tuple[list[int], list[int]]:
        prompt = tok.encode(problem.prompt)
        seq = prompt + tok.encode(problem.answer) + [eos]
        return seq, list(range(len(prompt) - 1, len(seq) - 1))  # the positions that predict

    def accuracy(self) -> tuple[float, float]:
        outs = self.llm.generate([p.prompt for p in self.problems], self.params)
        texts = [o.outputs[0].text for o in outs]
        pairs = list(zip(self.problems, texts, strict=True))
        reward = sum(self.task.reward(p, t) for p, t in pairs) / len(pairs)
        exact = sum(self.task.exact(p, t) for p, t in pairs) / len(pairs)
        return reward, exact

    def engine_rows(self) -> list[list[float]]:
        """The engine's full next-token log-probs at the probe positions."""
        vocab = self.llm.engine.spec.vocab_size
        seqs = [seq for seq, _ in self._probe]
        outs = self.llm.generate(seqs, SamplingParams(max_tokens=0, prompt_logprobs=vocab))
        rows = []
        for (_, positions), out in zip(self._probe, outs, strict=True):
            for t in positions:  # prompt_top_logprobs[t + 1] is the distribution of token t + 1
                top = out.prompt_top_logprobs[t + 1]
                rows.append([top[v] for v in range(vocab)])
        return rows

    def run(self, phase: str, step: int) -> EvalPoint:
        reward, exact = self.accuracy()
        engine = self.engine_rows()
        trainer = self.trainers.score(-1, [s for s, _ in self._probe], [p for _, p in self._probe])
        kls = [next_token_kl(e, t) for e, t in zip(engine, trainer, strict=True)]
        gap = _max_gap(engine, trainer)
        change = None if self._previous is None else _max_gap(engine, self._previous)
        self._previous = engine
        return EvalPoint(
            phase,
            step,
            self.llm.weight_version,
            round(reward, 4),
            round(exact, 4),
            max(kls),
            sum(kls) / len(kls),
            gap,
            change,
        )
