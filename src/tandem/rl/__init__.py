"""The RL loop behind `tandem demo`: engine rollouts -> rewards -> FSDP2 policy update -> push."""
