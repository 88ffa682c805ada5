"""Vocab-parallel token embedding and LM head: vocab rows split across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.gemm import PackedWeight, linear
from tandem.layers.placement import rows, set_pieces, whole
from tandem.parallel import SINGLE, TPGroup


def _vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first row, real rows, padded rows per rank); the last rank's shard may be short."""
    per_rank = -(-vocab_size // tp.size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, name: str, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.real, per_rank = _vocab_range(vocab_size, tp)
        self.weight = nn.Parameter(torch.zeros(per_rank, dim), requires_grad=False)
        pieces = (
            [rows(name, (vocab_size, dim), self.start, self.start + self.real)] if self.real else []
        )
        set_pieces(self.weight, pieces)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(nn.Module):
    """Logits for the full vocabulary (gathered across ranks). ``tied_to`` shares its tensor."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        name: str,
        tp: TPGroup = SINGLE,
        *,
        tied_to: VocabParallelEmbedding | None = None,
        bias_name: str | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        start, real, per_rank = _vocab_range(vocab_size, tp)
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.zeros(per_rank, dim), requires_grad=False)
            set_pieces(
                self.weight, [rows(name, (vocab_size, dim), start, start + real)] if real else []
            )
        self.packed = PackedWeight()
        self.bias = None
        if bias_name is not None:
            self.bias = nn.Parameter(torch.zeros(per_rank), requires_grad=False)
            set_pieces(
                self.bias, [rows(bias_name, (vocab_size,), start, start + real)] if real else []
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, self.bias, self.packed)
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]


class PositionEmbedding(nn.Module):
    """Learned absolute positions (GPT-2), replicated on every rank."""

    def __init__(self, max_positions: int, dim: int, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(max_positions, dim), requires_grad=False)
        set_pieces(self.weight, [whole(name, (max_positions, dim))])

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)
