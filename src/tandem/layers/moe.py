"""A sparse mixture-of-experts block with expert parallelism over the tensor-parallel group.

Every rank holds the whole router and a contiguous range of whole experts (uneven counts
allowed: the first ``E % T`` ranks hold one more). The block's input is replicated across the
group (attention's output projection all-reduces it), so every rank routes every token the
same way, runs its own experts on the tokens routed to them (one matmul per local expert over
its tokens), and one all-reduce combines the partial outputs: the dispatch needs no all-to-all.
Placement is declared on each expert's parameters, so the loader and the weight exchange read
and write whole experts on the rank that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.layers.activation import silu_and_mul
from tandem.layers.gemm import linear
from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear, Section
from tandem.layers.placement import set_pieces, whole
from tandem.parallel import SINGLE, TPGroup


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """Canonical tensor names of expert ``e`` (``{e}`` in each pattern)."""

    gate: str
    up: str
    down: str

    def of(self, e: int) -> tuple[str, str, str]:
        return self.gate.format(e=e), self.up.format(e=e), self.down.format(e=e)


def expert_range(num_experts: int, rank: int, size: int) -> range:
    """The experts rank ``rank`` of ``size`` holds: contiguous, the first ``E % size`` ranks
    one more."""
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class Expert(nn.Module):
    """One whole expert MLP: down(silu(gate(x)) * up(x)), no bias."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]):
        super().__init__()
        gate, up, down = names
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [Section(gate, None, inter), Section(up, None, inter)], SINGLE
        )
        self.down_proj = RowParallelLinear(inter, hidden, down, None, SINGLE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoE(nn.Module):
    """Top-k routing (float32 softmax over all experts, then top-k, renormalised when
    ``norm_topk_prob``) and the experts this rank holds.

    ``routing`` is set by the model runner to a list when a step must report the experts each
    token was routed to: the block appends ``(layer, top-k ids)`` to it."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        router: str,
        names: ExpertNames,
        layer: int,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}]")
        self.tp = tp
        self.layer = layer
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        set_pieces(self.router, [whole(router, (num_experts, hidden))])
        self.local = expert_range(num_experts, tp.rank, tp.size)
        self.experts = nn.ModuleList(Expert(hidden, inter, names.of(e)) for e in self.local)
        self.routing: list | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), both [tokens, top_k], ids in descending probability."""
        probs = torch.softmax(linear(x, self.router).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.routing is not None:
            self.routing.append((self.layer, ids))
        out = torch.zeros_like(x)
        for e, expert in zip(self.local, self.experts, strict=True):
            token, slot = torch.where(ids == e)
            if token.numel():
                y = expert(x[token]) * weights[token, slot, None]
                out.index_add_(0, token, y)
        return self.tp.all_reduce(out)
