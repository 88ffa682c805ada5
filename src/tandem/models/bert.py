"""BERT encoders: ``BertModel`` (embeddings: the [CLS] token's last hidden state) and
``BertForSequenceClassification`` (``classifier(tanh(pooler(h_cls)))``).

Post-LayerNorm blocks, exact GELU, learned absolute positions from 0 per sequence, token type
embeddings, bidirectional attention over each sequence of the flat batch (no padding).
Attention heads and the MLP are split across tensor-parallel ranks; the pooler and the
classifier (a few rows) are replicated.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.attention import Attention, AttentionMetadata
from tandem.layers.embedding import PositionEmbedding, VocabParallelEmbedding
from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear, Section
from tandem.layers.norm import LayerNorm
from tandem.layers.placement import replicated
from tandem.models.base import TandemModel
from tandem.models.labels import Labels
from tandem.models.registry import register_model
from tandem.models.stages import PipelineLayout
from tandem.parallel import SINGLE, TPGroup

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class BertConfig(Labels):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: Literal["gelu", "gelu_new", "relu"] = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_embedding_type: Literal["absolute"] = "absolute"

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig, prefix: str, tp: TPGroup):
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = h // cfg.num_attention_heads
        self.heads = cfg.num_attention_heads // tp.size
        p = f"{prefix}.self"
        self.qkv = ColumnParallelLinear(
            h,
            [Section(f"{p}.{n}.weight", f"{p}.{n}.bias", h) for n in ("query", "key", "value")],
            tp,
        )
        self.dense = RowParallelLinear(
            h, h, f"{prefix}.output.dense.weight", f"{prefix}.output.dense.bias", tp
        )
        self.norm = LayerNorm(h, cfg.layer_norm_eps, f"{prefix}.output.LayerNorm")
        self.attn = Attention(
            self.heads, self.heads, self.head_dim, self.head_dim**-0.5, causal=False
        )

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = (t.view(-1, self.heads, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        return self.norm(x + self.dense(self.attn(q, k, v, meta).flatten(1)))


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, prefix: str, tp: TPGroup):
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.attention = BertSelfAttention(cfg, f"{prefix}.attention", tp)
        self.intermediate = ColumnParallelLinear(
            h,
            [
                Section(
                    f"{prefix}.intermediate.dense.weight",
                    f"{prefix}.intermediate.dense.bias",
                    inter,
                )
            ],
            tp,
        )
        self.output = RowParallelLinear(
            inter, h, f"{prefix}.output.dense.weight", f"{prefix}.output.dense.bias", tp
        )
        self.norm = LayerNorm(h, cfg.layer_norm_eps, f"{prefix}.output.LayerNorm")
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, context: None, meta: AttentionMetadata) -> torch.Tensor:
        h = self.attention(x, meta)
        return self.norm(h + self.output(self.act(self.intermediate(h))))


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig, prefix: str, tp: TPGroup):
        super().__init__()
        h = cfg.hidden_size
        self.words = VocabParallelEmbedding(
            cfg.vocab_size, h, f"{prefix}.word_embeddings.weight", tp
        )
        self.positions = PositionEmbedding(
            cfg.max_position_embeddings, h, f"{prefix}.position_embeddings.weight"
        )
        types = f"{prefix}.token_type_embeddings.weight"
        self.token_types = replicated((cfg.type_vocab_size, h), types)
        self.norm = LayerNorm(h, cfg.layer_norm_eps, f"{prefix}.LayerNorm")

    def forward(self, ids, positions, token_type_ids=None) -> torch.Tensor:
        types = torch.zeros_like(ids) if token_type_ids is None else token_type_ids
        x = self.words(ids) + self.positions(positions) + F.embedding(types, self.token_types)
        return self.norm(x)


@register_model("BertModel")
class BertModel(TandemModel):
    """Embeddings only: pooling picks a row of the last hidden states ([CLS] by default)."""

    config_class = BertConfig
    pipeline = PipelineLayout(layers="layers", first=("embeddings",), last=())
    optional_prefix = "bert."  # a BertModel checkpoint names tensors without it
    default_pooling = "cls"
    token_types = True  # embed() takes token_type_ids

    def __init__(self, cfg: BertConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg, "bert.embeddings", tp)
        self.layers = nn.ModuleList(
            BertLayer(cfg, f"bert.encoder.layer.{i}", tp) for i in range(cfg.num_hidden_layers)
        )

    def embed(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        return self.embeddings(input_ids, positions, token_type_ids)

    def layer_context(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        return None

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # post-LN: every layer ends normalised

    @staticmethod
    def max_context_len(cfg: BertConfig) -> int:
        return cfg.max_position_embeddings

    @staticmethod
    def unused_checkpoint_tensors(cfg: BertConfig) -> set[str]:
        """Heads a BertModel does not run, and position-id buffers of older checkpoints."""
        return {
            "bert.pooler.dense.weight",
            "bert.pooler.dense.bias",
            "bert.embeddings.position_ids",
            "classifier.weight",
            "classifier.bias",
        }


@register_model("BertForSequenceClassification")
class BertForSequenceClassification(BertModel):
    """``classify``: the classifier's logits over tanh(pooler([CLS] hidden state))."""

    pipeline = PipelineLayout(layers="layers", first=("embeddings",), last=("pooler", "classifier"))
    tasks = frozenset({"embed", "classify"})

    def __init__(self, cfg: BertConfig, tp: TPGroup = SINGLE):
        super().__init__(cfg, tp)
        h = cfg.hidden_size
        self.pooler = nn.Module()
        self.pooler.weight = replicated((h, h), "bert.pooler.dense.weight")
        self.pooler.bias = replicated((h,), "bert.pooler.dense.bias")
        self.classifier = nn.Module()
        self.classifier.weight = replicated((cfg.num_labels, h), "classifier.weight")
        self.classifier.bias = replicated((cfg.num_labels,), "classifier.bias")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(pooled, self.pooler.weight, self.pooler.bias))
        return F.linear(h, self.classifier.weight, self.classifier.bias)

    @staticmethod
    def unused_checkpoint_tensors(cfg: BertConfig) -> set[str]:
        return {"bert.embeddings.position_ids"}
