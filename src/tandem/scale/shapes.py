"""Model shapes the sync planner takes: a Hugging Face ``config.json`` directory, or a built-in
config of a published model's size in an architecture tandem's engine runs.

A shape is the engine's own model class over that config, built on the meta device: its
parameters' placement pieces are the engine's real layout, with no storage behind them.
"""

from __future__ import annotations

from pathlib import Path

import torch

import tandem.models  # noqa: F401  (registers the architectures)
from tandem.models.loader import ModelSpec, read_model_spec
from tandem.models.registry import model_class
from tandem.parallel import TPGroup

# Published sizes in architectures the engine runs. Kimi-K2 uses multi-head latent attention,
# which tandem's engine does not: its stand-in keeps K2's sizes (61 layers, the first dense,
# 384 experts of 2048, 8 active, hidden 7168, vocabulary 163840) with grouped-query attention,
# 1.026e12 parameters (K2: 1.04e12).
BUILTIN: dict[str, dict] = {
    "llama-70b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
    ),
    "qwen3-235b-a22b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1536, norm_topk_prob=True, max_position_embeddings=40960,
    ),
    "kimi-k2": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=163840, hidden_size=7168,
        intermediate_size=18432, num_hidden_layers=61, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, num_experts=384, num_experts_per_tok=8,
        moe_intermediate_size=2048, mlp_only_layers=[0], norm_topk_prob=True,
        max_position_embeddings=131072,
    ),
}  # fmt: skip


def model_spec(model: str) -> ModelSpec:
    """A built-in name or a directory holding ``config.json`` (weights are never read)."""
    raw = BUILTIN.get(model)
    if raw is None:
        if not Path(model).is_dir():
            raise ValueError(
                f"model: {model!r} is neither a built-in shape {sorted(BUILTIN)} nor a directory"
            )
        return read_model_spec(model)
    cls = model_class(raw["architectures"][0])
    return ModelSpec(Path(f"<{model}>"), raw["architectures"][0], cls, cls.config_class(**raw), ())


def meta_model(spec: ModelSpec, tp_rank: int = 0, tp_size: int = 1):
    """The engine's model for one tensor-parallel rank, on the meta device."""
    with torch.device("meta"):
        return spec.cls(spec.config, TPGroup(tp_rank, tp_size))
