"""Process-group handles the parallel layers use; size 1 means no communication at all."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} outside [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """The degrees of parallelism and the rank layout: rank = pp_rank * tp + tp_rank, so a
    tensor-parallel group is consecutive ranks (on one node when tp divides the node's ranks)."""

    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, tp_rank) of a global rank."""
        return divmod(rank, self.tp)

    def rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def tp_ranks(self, pp_rank: int) -> list[int]:
        return [self.rank(pp_rank, t) for t in range(self.tp)]
