"""Group-relative advantages and the clipped importance-weighted policy-gradient loss."""

from __future__ import annotations

import torch


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-style clipped surrogate, token level.

    ``logp``: the trainer's log-probs of the sampled tokens [B, T] (with grad);
    ``behaviour_logp``: the engine's, recorded when sampling (the behaviour policy, possibly
    some versions old); ``advantages`` [B]; ``mask`` [B, T] marks real completion tokens. The
    importance ratio exp(logp - behaviour_logp) corrects for the version gap; clipping bounds
    how far one stale sample can push. Loss = -mean over tokens of min(r*A, clip(r)*A).
    """
    ratio = torch.exp(logp - behaviour_logp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    tokens = mask.sum().clamp(min=1)
    loss = -(surrogate * mask).sum() / tokens
    with torch.no_grad():
        clipped = (((ratio - 1).abs() > clip) & mask.bool()).sum() / tokens
        stats = {"ratio_max": float((ratio * mask).max()), "clip_fraction": float(clipped)}
    return loss, stats
