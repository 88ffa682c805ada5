"""Grouped expert tensors of a transformers (v5) MoE model as per-expert canonical boxes.

transformers keeps a MoE layer's experts in two 3-D parameters, ``mlp.experts.gate_up_proj``
[E, 2I, H] (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` [E, H, I];
checkpoints (and the engine) name each expert's tensors on their own. Each grouped tensor is
described as a 2-D view [E * rows, cols] whose pieces are whole boxes of the per-expert
canonical tensors (FSDP2's shards of it hold a range of experts: the same rule on its box).
Which canonical names apply is declared per ``model_type`` below, never guessed from names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.exchange.layout import LayoutMismatch, RankLayout
from tandem.layers.placement import Piece


@dataclass(frozen=True, slots=True)
class ExpertNaming:
    """Checkpoint names of a family's MoE block: ``{layer}.{block}.experts.{e}.{gate}.weight``
    (likewise ``up``, ``down``) and ``{layer}.{block}.gate.weight`` for the router."""

    block: str
    gate: str
    up: str
    down: str


HF_EXPERT_NAMING = {
    "qwen3_moe": ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ExpertNaming("block_sparse_moe", "w1", "w3", "w2"),
}
_GATE_UP, _DOWN, _ROUTER = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj", ".mlp.gate.weight"


def regroup_hf_experts(
    layout: RankLayout, tensors: dict[str, torch.Tensor], model_type: str | None
) -> tuple[RankLayout, dict[str, torch.Tensor]]:
    """``layout`` (whose pieces name transformers' in-memory tensors) with grouped expert
    tensors turned into per-expert pieces over 2-D views, and routers renamed as checkpoints
    name them. Models of other types come back unchanged."""
    naming = HF_EXPERT_NAMING.get(model_type or "")
    if naming is None:
        return layout, tensors
    out = RankLayout(layout.rank, dtype=layout.dtype, arena=layout.arena)
    tensors = dict(tensors)
    problems = []
    by_key: dict[str, list[Piece]] = {}
    for region in layout.regions:
        by_key.setdefault(region.key, []).append(region.piece)
    for key, shape in layout.local_shapes.items():
        pieces = by_key.get(key, [])
        kind = _kind(key)
        if kind is None:
            out.add(key, shape, pieces)
            continue
        prefix = key[: -len({"gate_up": _GATE_UP, "down": _DOWN, "router": _ROUTER}[kind])]
        if kind == "router":
            name = f"{prefix}.{naming.block}.gate.weight"
            out.add(key, shape, [_renamed(p, name) for p in pieces])
            continue
        if len(shape) != 3 or len(pieces) > 1:
            problems.append(f"{key}: expected one 3-D grouped expert tensor, got {shape}")
            continue
        tensors[key] = tensors[key].reshape(shape[0] * shape[1], shape[2])
        out.add(
            key,
            (shape[0] * shape[1], shape[2]),
            _expert_pieces(pieces[0], prefix, naming, kind) if pieces else [],
        )
    if problems:
        raise LayoutMismatch(problems)
    return out, tensors


def _kind(key: str) -> str | None:
    for kind, suffix in (("gate_up", _GATE_UP), ("down", _DOWN), ("router", _ROUTER)):
        if key.endswith(suffix):
            return kind
    return None


def _renamed(piece: Piece, name: str) -> Piece:
    return Piece(name, piece.full_shape, piece.box, piece.offset, piece.transposed)


def _expert_pieces(piece: Piece, prefix: str, naming: ExpertNaming, kind: str) -> list[Piece]:
    """Per-expert pieces of the grouped box ``piece`` (local dims: experts x rows x cols,
    viewed as (experts * rows) x cols)."""
    (e0, e1), (r0, r1), (c0, c1) = piece.box
    _, full_rows, full_cols = piece.full_shape
    rows = r1 - r0
    expert = f"{prefix}.{naming.block}.experts"
    out = []
    for j, e in enumerate(range(e0, e1)):
        if kind == "down":
            parts = [(f"{expert}.{e}.{naming.down}.weight", 0, full_rows)]
        else:  # gate rows [0, I), then up rows [I, 2I)
            inter = full_rows // 2
            parts = [
                (f"{expert}.{e}.{naming.gate}.weight", 0, inter),
                (f"{expert}.{e}.{naming.up}.weight", inter, full_rows),
            ]
        for name, lo, hi in parts:
            a, b = max(lo, r0), min(hi, r1)
            if a >= b:
                continue
            box = ((a - lo, b - lo), (c0, c1))
            out.append(Piece(name, (hi - lo, full_cols), box, (j * rows + a - r0, 0)))
    return out
