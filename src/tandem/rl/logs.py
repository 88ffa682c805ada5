"""What the RL demo records per warm-up step (`WarmupLog`) and per RL step (`StepLog`): the
rows of ``demo.json``'s ``warmup`` and ``steps``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepLog:
    step: int
    version: int  # the engine's weight version after this step's push
    reward_mean: float
    reward_min: float
    reward_max: float
    samples: int
    dropped: int
    rollout_tokens: int
    rollout_seconds: float
    rollout_tokens_per_s: float
    train_seconds: float
    sync_ms: float
    loss: float
    grad_norm: float
    logprob_mismatch: float | None  # max |trainer - engine| over samples of the current version
    logprob_gap_mean: float | None  # their mean over those samples' tokens
    is_weight_mean: float  # mean per-token weight the loss applied (no correction: the raw ratio)
    is_capped_fraction: float  # tokens over the cap: truncated (tis), masked (mis), kept (none)
    clip_fraction: float  # tokens whose PPO ratio is outside 1 +- 0.2 (tis/mis: ratio 1, none)
    staleness_mean: float
    staleness_max: int
    sample_versions: list[list[int]] = field(default_factory=list)  # per group
    eval_reward: float | None = None  # held-out greedy accuracy, at eval points
    sync_bytes: int = 0  # what the step's push moved (a delta push: its changed elements)


@dataclass
class WarmupLog:
    step: int
    loss: float
    train_seconds: float
    sync_ms: float  # the push after the last warm-up step (0 before it)
