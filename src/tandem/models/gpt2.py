"""GPT-2: learned positions, LayerNorm, GELU, HF ``Conv1D`` weights stored as [in, out]."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.attention import Attention, AttentionMetadata
from tandem.layers.embedding import ParallelLMHead, PositionEmbedding, VocabParallelEmbedding
from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear, Section
from tandem.layers.norm import LayerNorm
from tandem.models.base import TandemModel
from tandem.models.hf_config import HFConfig
from tandem.models.registry import register_model
from tandem.models.stages import PipelineLayout
from tandem.parallel import SINGLE, TPGroup

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class GPT2Config(HFConfig):
    spellings = {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int = 1024
    n_inner: int | None = None
    activation_function: Literal["gelu_new", "gelu_pytorch_tanh", "gelu", "relu"] = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    scale_attn_weights: Literal[True] = True
    scale_attn_by_inverse_layer_idx: Literal[False] = False
    reorder_and_upcast_attn: Literal[False] = False

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_layers(self) -> int:
        return self.n_layer


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, prefix: str, tp: TPGroup):
        super().__init__()
        h = cfg.n_embd
        self.head_dim = h // cfg.n_head
        self.heads = cfg.n_head // tp.size
        w, b = f"{prefix}.c_attn.weight", f"{prefix}.c_attn.bias"
        self.c_attn = ColumnParallelLinear(
            h, [Section(w, b, h, start=i * h, total=3 * h) for i in range(3)], tp, conv1d=True
        )
        self.c_proj = RowParallelLinear(
            h, h, f"{prefix}.c_proj.weight", f"{prefix}.c_proj.bias", tp, conv1d=True
        )
        self.attn = Attention(self.heads, self.heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x, meta: AttentionMetadata):
        q, k, v = (t.view(-1, self.heads, self.head_dim) for t in self.c_attn(x).chunk(3, dim=-1))
        return self.c_proj(self.attn(q, k, v, meta).flatten(1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config, prefix: str, tp: TPGroup):
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = ColumnParallelLinear(
            cfg.n_embd,
            [Section(f"{prefix}.c_fc.weight", f"{prefix}.c_fc.bias", inner)],
            tp,
            conv1d=True,
        )
        self.c_proj = RowParallelLinear(
            inner, cfg.n_embd, f"{prefix}.c_proj.weight", f"{prefix}.c_proj.bias", tp, conv1d=True
        )
        self.act = _ACTIVATIONS[cfg.activation_function]

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config, prefix: str, tp: TPGroup):
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(cfg.n_embd, eps, f"{prefix}.ln_1")
        self.attn = GPT2Attention(cfg, f"{prefix}.attn", tp)
        self.ln_2 = LayerNorm(cfg.n_embd, eps, f"{prefix}.ln_2")
        self.mlp = GPT2MLP(cfg, f"{prefix}.mlp", tp)

    def forward(self, x, context: None, meta: AttentionMetadata):
        h = meta.kept(x) + self.attn(self.ln_1(x), meta)
        return h + self.mlp(self.ln_2(h))


@register_model("GPT2LMHeadModel")
class GPT2LMHeadModel(TandemModel):
    config_class = GPT2Config
    tasks = frozenset({"generate", "embed"})
    pipeline = PipelineLayout(layers="h", first=("wte", "wpe"), last=("ln_f", "lm_head"))
    keeps_rows = True
    optional_prefix = "transformer."  # original hub checkpoints name tensors without it

    def __init__(self, cfg: GPT2Config, tp: TPGroup = SINGLE):
        super().__init__()
        if cfg.n_head % tp.size:
            raise ValueError(f"n_head ({cfg.n_head}) not divisible by tensor_parallel_size")
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, "transformer.wte.weight", tp)
        self.wpe = PositionEmbedding(cfg.n_positions, cfg.n_embd, "transformer.wpe.weight")
        self.h = nn.ModuleList(GPT2Block(cfg, f"transformer.h.{i}", tp) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, "transformer.ln_f")
        tied = self.wte if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.n_embd, "lm_head.weight", tp, tied_to=tied
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(positions)

    def layer_context(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        return None  # learned positions are added once, in `embed`

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def max_context_len(cfg: GPT2Config) -> int:
        return cfg.n_positions

    @staticmethod
    def unused_checkpoint_tensors(cfg: GPT2Config) -> set[str]:
        """Causal-mask buffers older checkpoints carry, and the tied head."""
        names = {
            f"{prefix}h.{i}.attn.{buf}"
            for prefix in ("transformer.", "")
            for i in range(cfg.n_layer)
            for buf in ("bias", "masked_bias")
        }
        return names | ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
