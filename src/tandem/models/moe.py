"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral (Llama-style attention, sparse MLPs).

Checkpoints hold per-expert tensors (``mlp.experts.{e}.gate_proj.weight`` for Qwen3-MoE,
``block_sparse_moe.experts.{e}.w1.weight`` for Mixtral); those are the canonical names the
experts' parameters declare (`tandem.layers.moe`).
"""

from __future__ import annotations

from pydantic import model_validator
from torch import nn

from tandem.layers.moe import ExpertNames, SparseMoE
from tandem.models.llama import LlamaConfig, LlamaMLP, MistralForCausalLM, Qwen3ForCausalLM
from tandem.models.registry import register_model
from tandem.parallel import TPGroup


class Qwen3MoeConfig(LlamaConfig):
    spellings = {"num_local_experts": "num_experts"}  # transformers 5.x writes num_local_experts

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []

    @model_validator(mode="after")
    def _sparse_layers(self):
        if self.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers names layers the model lacks: {bad}")
        return self

    def is_sparse(self, layer: int) -> bool:
        """Transformers' rule: experts unless listed dense, on every ``decoder_sparse_step``."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


class MixtralConfig(LlamaConfig):
    spellings = {"num_experts": "num_local_experts"}

    num_local_experts: int
    num_experts_per_tok: int


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_class = Qwen3MoeConfig

    def make_mlp(self, cfg: Qwen3MoeConfig, layer: int, tp: TPGroup) -> nn.Module:
        prefix = f"model.layers.{layer}.mlp"
        if not cfg.is_sparse(layer):
            return LlamaMLP(cfg, prefix, tp)
        names = ExpertNames(
            f"{prefix}.experts.{{e}}.gate_proj.weight",
            f"{prefix}.experts.{{e}}.up_proj.weight",
            f"{prefix}.experts.{{e}}.down_proj.weight",
        )
        return SparseMoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            f"{prefix}.gate.weight",
            names,
            layer,
            tp,
        )

    @staticmethod
    def moe_layers(cfg: Qwen3MoeConfig) -> list[int]:
        """Decoder layers with experts (the others are dense)."""
        return [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)]


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(MistralForCausalLM):
    config_class = MixtralConfig

    def make_mlp(self, cfg: MixtralConfig, layer: int, tp: TPGroup) -> nn.Module:
        prefix = f"model.layers.{layer}.block_sparse_moe"
        names = ExpertNames(
            f"{prefix}.experts.{{e}}.w1.weight",
            f"{prefix}.experts.{{e}}.w3.weight",
            f"{prefix}.experts.{{e}}.w2.weight",
        )
        return SparseMoE(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            True,
            f"{prefix}.gate.weight",
            names,
            layer,
            tp,
        )

    @staticmethod
    def moe_layers(cfg: MixtralConfig) -> list[int]:
        return list(range(cfg.num_hidden_layers))
