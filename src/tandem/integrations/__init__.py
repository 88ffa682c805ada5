"""Adapters that let RL frameworks drive tandem (`trl`: TRL's GRPOTrainer)."""
