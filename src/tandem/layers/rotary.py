"""Rotary position embeddings (rotate-half convention, as Hugging Face Llama/Qwen)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from tandem.kernels import pointwise


class RopeParameters(BaseModel):
    """The rope fields of an HF config (``rope_parameters`` in transformers >= 5, else
    ``rope_theta`` + ``rope_scaling``), normalised to one shape."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    SUPPORTED: ClassVar[tuple[str, ...]] = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, rope: RopeParameters) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.rope_theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; computed once per step and shared by all layers."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeParameters):
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("signed_sin", torch.empty(max_positions, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the tables in float32 on the buffers' device (after `to_empty`)."""
        device = self.cos.device
        inv_freq = inverse_frequencies(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        emb = torch.cat((positions[:, None] * inv_freq[None, :],) * 2, dim=-1)
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the first half negated.
        sin = emb.sin()
        self.cos = emb.cos()
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """Tables for the batch's positions, shaped [T, 1, D] to broadcast over heads."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.signed_sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


RopeTables = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """x: [T, heads, D]. Same values as HF's ``x * cos + rotate_half(x) * sin``."""
    cos, signed_sin = tables
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotate_pair_(
    q: torch.Tensor, k: torch.Tensor, tables: RopeTables
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate_` of q [T, H, D] and k [T, KV, D]; in one kernel call where k's heads follow
    q's in the same rows (both views of one fused qkv projection), a step's per-layer calls
    halved."""
    heads, dim = q.shape[1], q.shape[2]
    adjacent = (
        q.shape[0] == k.shape[0]
        and q.stride() == k.stride()
        and q.stride(1) == dim
        and k.data_ptr() == q.data_ptr() + heads * dim * q.element_size()
        and q.dtype == k.dtype
    )
    if adjacent and pointwise.serves(q) and dim <= pointwise.MAX_HEAD_DIM:
        both = q.as_strided((q.shape[0], heads + k.shape[1], dim), q.stride())
        pointwise.rotary_(both, *tables)
        return q, k
    return rotate_(q, tables), rotate_(k, tables)


def rotate_(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """`apply_rotary`, in place where tandem's kernel serves (float32 or bfloat16 on CPU: x is
    overwritten, e.g. the q or k part of a fresh qkv projection); else a new tensor."""
    if pointwise.serves(x) and x.shape[-1] <= pointwise.MAX_HEAD_DIM:
        return pointwise.rotary_(x, *tables)
    return apply_rotary(x, tables)
