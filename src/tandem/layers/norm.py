"""Normalisation layers, replicated on every rank, matching Hugging Face numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import pointwise
from tandem.layers.placement import set_pieces, whole


class RMSNorm(nn.Module):
    """HF ``LlamaRMSNorm``: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, name: str):
        super().__init__()
        self.eps = eps
        self.weight = set_pieces(
            nn.Parameter(torch.ones(dim), requires_grad=False), [whole(name, (dim,))]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if pointwise.serves(x) and self.weight.dtype == dtype:  # one pass (tandem.kernels)
            return pointwise.rms_norm(x, self.weight, self.eps)
        if dtype == torch.float32:  # the fused kernel gives the same values in float32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``h = residual + x`` and this norm of it: (h, norm(h)). One
        pass on the pointwise kernels where they serve (a decode step's add was a dispatch
        and a pass of its own)."""
        if (
            x.dim() == 2
            and pointwise.serves(x)
            and pointwise.serves(residual)
            and residual.dtype == self.weight.dtype == x.dtype
        ):
            return pointwise.add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return h, self(h)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, name: str):
        super().__init__()
        self.eps = eps
        self.weight = set_pieces(
            nn.Parameter(torch.ones(dim), requires_grad=False), [whole(f"{name}.weight", (dim,))]
        )
        self.bias = set_pieces(
            nn.Parameter(torch.zeros(dim), requires_grad=False), [whole(f"{name}.bias", (dim,))]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
