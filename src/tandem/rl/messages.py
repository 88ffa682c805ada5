"""Typed messages between the demo's controller and its trainer ranks, in the `TRAINERS` codec
(`tandem.wire.Codec`: msgpack, no pickle)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.wire import Codec

TRAINERS = Codec("trainer")


@TRAINERS.register("hello")
@dataclass(slots=True)
class TrainerHello:
    """A trainer rank's first message, after the controller's token."""

    rank: int
    pid: int


@dataclass(slots=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # the engine's raw log-probs when it sampled them
    advantage: float
    fresh: bool  # produced by exactly the trainer's current version: compare log-probs


@TRAINERS.register("batch")
@dataclass(slots=True)
class TrainBatch:
    """One rank's share of a step. ``update=False``: only recompute log-probs (a check)."""

    step: int
    version: int  # pushed after the update
    update: bool
    lr: float  # the controller owns the schedule
    samples: list[Sample]
    is_correction: str = "none"  # "none" | "tis" | "mis" (`tandem.rl.grpo.correct_mismatch`)
    is_cap: float = 2.0


@TRAINERS.register("warmup")
@dataclass(slots=True)
class WarmupBatch:
    """One rank's share of a supervised warm-up step: cross-entropy on each example's target
    tokens given its prompt; ``push`` sends the weights to the engine after the update."""

    step: int
    version: int
    push: bool
    lr: float
    examples: list[list[list[int]]]  # [prompt_ids, target_ids] per example


@TRAINERS.register("score")
@dataclass(slots=True)
class ScoreBatch:
    """Recompute next-token distributions (no update): the trainer's full log-softmax at
    ``positions[i]`` of ``sequences[i]`` (the logits at position t predict token t + 1)."""

    step: int
    sequences: list[list[int]]
    positions: list[list[int]]


@TRAINERS.register("score_report")
@dataclass(slots=True)
class ScoreReport:
    rank: int
    step: int
    logprobs: list[list[float]]  # one vocabulary-sized row per (sequence, position), in order
    error: str | None = None


@TRAINERS.register("report")
@dataclass(slots=True)
class TrainReport:
    rank: int
    step: int
    loss: float
    logprob_mismatch: float | None  # max |trainer - engine| over fresh samples' tokens
    push_seconds: float
    train_seconds: float
    grad_norm: float
    ratio_max: float
    clip_fraction: float
    tokens: int = 0  # completion tokens in the share
    fresh_tokens: int = 0  # those of fresh samples
    logprob_gap_sum: float = 0.0  # sum of |trainer - engine| over fresh samples' tokens
    is_weight_sum: float = 0.0  # sum of the per-token weights the loss applied (see below)
    is_over_cap: int = 0  # tokens whose exp(trainer - engine) exceeds the cap
    error: str | None = None
    push_bytes: int = 0  # what the push after the step moved (all trainer ranks: bytes_moved)


@TRAINERS.register("stop")
@dataclass(slots=True)
class Stop:
    pass
