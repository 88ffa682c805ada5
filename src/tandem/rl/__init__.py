"""The RL loop behind `tandem demo`: engine rollouts -> rewards -> FSDP2 policy update -> push;
and `replay_routing`, for a trainer recomputing an MoE policy's log-probs with the engine's
experts."""

from tandem.rl.replay import replay_routing

__all__ = ["replay_routing"]
