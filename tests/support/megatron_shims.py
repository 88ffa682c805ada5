"""Test-side shims that let megatron-core 0.16 build and run a GPTModel on CPU with gloo.

Never in product code: megatron-core assumes CUDA in three places our tests hit.
1. ``torch.cuda.current_device()`` (parallel_state and the initialisers ask for it): the CPU.
2. The CUDA RNG tracker's ``fork()`` (tensor-parallel init and dropout regions): a no-op
   context (there is no CUDA RNG state to fork; our dropouts are 0).
3. Attention needs an explicit mask on CPU (no fused kernels): `causal_mask` builds the
   boolean causal mask (True = masked) callers pass to the model.
"""

from __future__ import annotations

import contextlib

import torch


def install() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()


def causal_mask(length: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), 1)
