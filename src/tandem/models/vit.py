"""ViT image classifiers (``ViTForImageClassification``): a convolutional patch embedding with
bias, the [CLS] token then learned positions, pre-LayerNorm blocks (eps 1e-12, exact GELU),
a final LayerNorm and a classifier on token 0 (no pooler).

Inputs are images as float tensors [channels, size, size], already normalised like Hugging
Face's ``pixel_values``; each becomes 1 + (size / patch)^2 rows of the flat batch. Heads and
the MLP are split across tensor-parallel ranks; the patch embedding and the classifier are
replicated.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import model_validator
from torch import nn

from tandem.layers.attention import Attention, AttentionMetadata
from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear, Section
from tandem.layers.norm import LayerNorm
from tandem.layers.placement import replicated
from tandem.models.base import TandemModel
from tandem.models.labels import Labels
from tandem.models.registry import register_model
from tandem.models.stages import PipelineLayout
from tandem.parallel import SINGLE, TPGroup

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class ViTConfig(Labels):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    hidden_act: Literal["gelu", "gelu_new"] = "gelu"
    layer_norm_eps: float = 1e-12
    qkv_bias: bool = True

    @model_validator(mode="after")
    def _patches_fit(self):
        if self.image_size % self.patch_size:
            raise ValueError("image_size must be a multiple of patch_size")
        return self

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def rows_per_image(self) -> int:
        return 1 + (self.image_size // self.patch_size) ** 2

    @property
    def vocab_size(self) -> int:  # no tokens: one placeholder id per row
        return 1


class ViTLayer(nn.Module):
    def __init__(self, cfg: ViTConfig, prefix: str, tp: TPGroup):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.head_dim = h // cfg.num_attention_heads
        self.heads = cfg.num_attention_heads // tp.size
        a = f"{prefix}.attention.attention"
        bias = (lambda n: f"{a}.{n}.bias") if cfg.qkv_bias else (lambda n: None)
        self.before = LayerNorm(h, eps, f"{prefix}.layernorm_before")
        self.qkv = ColumnParallelLinear(
            h, [Section(f"{a}.{n}.weight", bias(n), h) for n in ("query", "key", "value")], tp
        )
        self.proj = RowParallelLinear(
            h,
            h,
            f"{prefix}.attention.output.dense.weight",
            f"{prefix}.attention.output.dense.bias",
            tp,
        )
        self.attn = Attention(
            self.heads, self.heads, self.head_dim, self.head_dim**-0.5, causal=False
        )
        self.after = LayerNorm(h, eps, f"{prefix}.layernorm_after")
        self.fc1 = ColumnParallelLinear(
            h,
            [
                Section(
                    f"{prefix}.intermediate.dense.weight",
                    f"{prefix}.intermediate.dense.bias",
                    cfg.intermediate_size,
                )
            ],
            tp,
        )
        self.fc2 = RowParallelLinear(
            cfg.intermediate_size,
            h,
            f"{prefix}.output.dense.weight",
            f"{prefix}.output.dense.bias",
            tp,
        )
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, context: None, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = (
            t.view(-1, self.heads, self.head_dim) for t in self.qkv(self.before(x)).chunk(3, dim=-1)
        )
        h = x + self.proj(self.attn(q, k, v, meta).flatten(1))
        return h + self.fc2(self.act(self.fc1(self.after(h))))


class PatchEmbedding(nn.Module):
    def __init__(self, cfg: ViTConfig, prefix: str):
        super().__init__()
        h, c, p = cfg.hidden_size, cfg.num_channels, cfg.patch_size
        rows = cfg.rows_per_image
        self.patch, self.shape = p, (c, cfg.image_size, cfg.image_size)
        self.weight = replicated((h, c, p, p), f"{prefix}.patch_embeddings.projection.weight")
        self.bias = replicated((h,), f"{prefix}.patch_embeddings.projection.bias")
        self.cls_token = replicated((1, 1, h), f"{prefix}.cls_token")
        self.positions = replicated((1, rows, h), f"{prefix}.position_embeddings")

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C * S * S] (each image flattened) -> [B * rows, H]: each image's [CLS] row then
        its patches."""
        pixels = pixels.view(len(pixels), *self.shape)
        x = F.conv2d(pixels, self.weight, self.bias, stride=self.patch).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.positions
        return x.flatten(0, 1)


@register_model("ViTForImageClassification")
class ViTForImageClassification(TandemModel):
    config_class = ViTConfig
    pipeline = PipelineLayout(
        layers="layers", first=("embeddings",), last=("layernorm", "classifier")
    )
    tasks = frozenset({"embed", "classify"})
    default_pooling = "cls"
    inputs = "pixels"  # LLM.classify takes image tensors, not text

    @staticmethod
    def image_shape(cfg: ViTConfig) -> tuple[int, int, int]:
        return (cfg.num_channels, cfg.image_size, cfg.image_size)

    def __init__(self, cfg: ViTConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.embeddings = PatchEmbedding(cfg, "vit.embeddings")
        self.layers = nn.ModuleList(
            ViTLayer(cfg, f"vit.encoder.layer.{i}", tp) for i in range(cfg.num_hidden_layers)
        )
        self.layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, "vit.layernorm")
        self.classifier = nn.Module()
        self.classifier.weight = replicated((cfg.num_labels, cfg.hidden_size), "classifier.weight")
        self.classifier.bias = replicated((cfg.num_labels,), "classifier.bias")

    def embed(self, input_ids, positions, pixel_values=None) -> torch.Tensor:
        if pixel_values is None:
            raise ValueError("a ViT takes images (pixel values), not token ids")
        return self.embeddings(pixel_values)

    def layer_context(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        return None

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layernorm(hidden)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.linear(pooled, self.classifier.weight, self.classifier.bias)

    @staticmethod
    def max_context_len(cfg: ViTConfig) -> int:
        return cfg.rows_per_image
