"""The gated MLP's activation, ``silu(gate) * up``, from the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels import pointwise


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, 2n] = [gate | up], as [T, n]: one pass where
    tandem's kernel serves (float32 on CPU), else torch's ops."""
    if gate_up.dim() == 2 and pointwise.serves(gate_up):
        return pointwise.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
