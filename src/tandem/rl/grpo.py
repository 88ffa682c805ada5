"""Group-relative advantages, the clipped importance-weighted policy-gradient loss, and the
correction of the engine/trainer log-prob mismatch (truncated or masked importance sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CORRECTIONS = ("none", "tis", "mis")


def group_advantages(rewards: list[float], group_size: int) -> list[float]:
    """GRPO: each sample's reward minus its group's mean, over the group's std (+1e-4)."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, unbiased=False) + 1e-4)
    return adv.flatten().tolist()


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-style clipped surrogate, token level.

    ``logp``: the trainer's log-probs of the sampled tokens [B, T] (with grad);
    ``behaviour_logp``: the old policy's (without a correction: the engine's, recorded when
    sampling, possibly some versions old); ``advantages`` [B]; ``mask`` [B, T] marks the
    completion tokens that count. The importance ratio exp(logp - behaviour_logp) corrects for
    the version gap; clipping bounds how far one stale sample can push. ``is_weight`` [B, T]
    (no grad), when given, multiplies each token's surrogate (`Correction.weight`).
    Loss = -mean over tokens of w * min(r*A, clip(r)*A).
    """
    ratio = torch.exp(logp - behaviour_logp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    if is_weight is not None:
        surrogate = surrogate * is_weight
    tokens = mask.sum().clamp(min=1)
    loss = -(surrogate * mask).sum() / tokens
    with torch.no_grad():
        clipped = (((ratio - 1).abs() > clip) & mask.bool()).sum() / tokens
        stats = {"ratio_max": float((ratio * mask).max()), "clip_fraction": float(clipped)}
    return loss, stats


@dataclass
class Correction:
    """What a mismatch correction does to one batch's tokens.

    ``old_logp``: the PPO ratio's old policy; ``weight``: the importance weight per token
    (None: no weight); ``mask``: the tokens the loss counts (MIS drops some);
    ``ratio``: exp(logp_trainer - logp_engine) per token; ``over_cap``: the tokens whose
    ratio exceeds the cap (truncated by TIS, masked by MIS, left alone without a correction).
    """

    old_logp: torch.Tensor
    weight: torch.Tensor | None
    mask: torch.Tensor
    ratio: torch.Tensor
    over_cap: torch.Tensor


def correct_mismatch(
    logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, correction: str, cap: float
) -> Correction:
    """The old policy and importance weights for a batch sampled by the engine.

    ``logp``: the trainer's log-probs of the sampled tokens under its current weights;
    ``engine_logp``: the engine's, recorded when it sampled them.

    - ``"none"``: the PPO ratio's old policy is the engine (exp(logp - logp_engine)), as the
      demo has always done; no weight. A float32 engine serves the trainer's weights
      bit-for-bit, so this is on-policy PPO; a lower-precision engine's drift enters the ratio
      untruncated.
    - ``"tis"`` (truncated IS, Yao et al. 2025): the old policy is the trainer's own detached
      log-probs (the *proximal* policy), so the PPO ratio is exactly 1 at the step's single
      update, and each token is weighted by min(exp(logp_old - logp_engine), cap).
    - ``"mis"`` (masked IS, verl's ``rollout_is`` mask mode): the same old policy and weight
      exp(logp_old - logp_engine), but a token whose weight exceeds the cap is dropped from
      the loss (and its token count) instead of truncated.

    The proximal policy is the trainer's *current* weights in both modes. Synchronous, these are
    the weights that produced the sample (the engine served them, in its own dtype), so the
    weight corrects exactly the precision mismatch. Async, the sampling version may be older
    and the trainer no longer holds it; the engine's recorded log-probs stay the behaviour
    policy and the current weights the proximal one (decoupled PPO, Hilton et al. 2021), so
    one capped weight corrects staleness and precision together.
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"is_correction must be one of {CORRECTIONS}, got {correction!r}")
    old = logp.detach()
    ratio = torch.exp(old - engine_logp) * mask
    over_cap = (ratio > cap) & mask.bool()
    if correction == "none":
        return Correction(engine_logp, None, mask, ratio, over_cap)
    if correction == "tis":
        return Correction(old, ratio.clamp(max=cap), mask, ratio, over_cap)
    return Correction(old, ratio * ~over_cap, mask * ~over_cap, ratio, over_cap)
