"""LoRA on the parallel linear layers: adapter slots, and rows of one batch each applying the
adapter of their own slot (base-model rows none).

An engine made with ``enable_lora`` gives every LoRA-capable layer (q/k/v, o, gate/up, down of
a Llama-style decoder; `lora_sites`) a `LoRAStack`: ``max_loras`` slots, slot ``s`` holding
``lora_a.s`` [n * R, in] and ``lora_b.s`` [out, n * R], where n is the number of sections the
layer fuses (3 for qkv, 2 for gate_up, else 1) and R is ``max_lora_rank``. Section i uses A's
rows and B's columns ``i*R .. i*R + r`` (an adapter of rank r <= R; the rest stays zero), so B
is block-diagonal and one pair of matmuls serves a fused layer:
``y[rows of s] += scale_s * (x[rows] A_s^T) B_s^T``.

Tensor parallel: a column-parallel layer (qkv, gate_up) holds A whole and the rows of B that
its output shard has; a row-parallel one (o, down) holds the columns of A of its input shard
and B whole, and its partial sums join the layer's own all-reduce ((sum_r x_r A_r^T) B^T is
the whole x A^T B^T). Where each canonical tensor lands is a `Piece` like any weight's, made
per slot and adapter rank (`slot_pieces`), so pushes plan, move and verify adapters as they do
weights. The stacks' parameters hold no piece of their own: a base-model push or load never
touches them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from tandem.layers.placement import Piece
from tandem.lora.config import LORA_MODULES


@dataclass(frozen=True, slots=True)
class LoraSection:
    """One fused section of a layer on one rank: canonical module ``module`` (full output
    ``out_full``), of whose output rows this rank holds ``start .. start + size`` at local
    row ``at``."""

    module: str
    out_full: int
    start: int
    size: int
    at: int


@dataclass(frozen=True, slots=True)
class LoraSite:
    """A LoRA-capable layer of one rank, as plain data (it travels in the rank's layout).
    ``key``: the stack's dotted name (slot s's tensors are ``{key}.lora_a.{s}`` and
    ``{key}.lora_b.{s}``); ``row``: row-parallel (input columns ``in_start .. + in_local``
    of ``in_full``), else column-parallel (the input whole)."""

    key: str
    row: bool
    in_full: int
    in_start: int
    in_local: int
    sections: tuple[LoraSection, ...]


SlotTensor = tuple[str, tuple[int, ...], list[Piece]]  # (local key, local shape, pieces)


def slot_pieces(
    site: LoraSite, slot: int, rank: int, max_rank: int, targets: tuple[str, ...]
) -> list[SlotTensor]:
    """(local key, local shape, pieces) of slot ``slot`` of ``site`` for an adapter of rank
    ``rank`` adapting ``targets``: where its canonical A [rank, in] and B [out, rank] land."""
    n = len(site.sections)
    a_pieces, b_pieces = [], []
    for i, sec in enumerate(site.sections):
        if sec.module.rsplit(".", 1)[-1] not in targets:
            continue
        a_name, b_name = f"{sec.module}.lora_A.weight", f"{sec.module}.lora_B.weight"
        in_box = (site.in_start, site.in_start + site.in_local)
        col = i * max_rank  # section i's rows of A, columns of B
        out_box = (sec.start, sec.start + sec.size)
        a_pieces.append(Piece(a_name, (rank, site.in_full), ((0, rank), in_box), (col, 0)))
        b_pieces.append(Piece(b_name, (sec.out_full, rank), (out_box, (0, rank)), (sec.at, col)))
    out_local = sum(sec.size for sec in site.sections)
    return [
        (f"{site.key}.lora_a.{slot}", (n * max_rank, site.in_local), a_pieces),
        (f"{site.key}.lora_b.{slot}", (out_local, n * max_rank), b_pieces),
    ]


class LoRARows:
    """Which rows of the step being run use which slot, shared by every stack of a rank (the
    runner sets it each step), and each slot's scale (set when an adapter lands in it).

    ``kept``: the rows the model's last layer keeps past attention (`AttentionMetadata.keep`),
    where the step trims; its output projection and MLP see only those."""

    def __init__(self, slots: int):
        self.scales = [0.0] * slots
        self._rows = 0
        self._groups: list = []
        self._kept_rows = -1
        self._kept_groups: list = []

    def set(self, slots_of_rows: list[int], kept: list[int] | None = None,
            device: torch.device | str = "cpu") -> None:  # fmt: skip
        """``slots_of_rows``: each row's slot, -1 for the base model."""
        self._rows = len(slots_of_rows)
        self._groups = self._grouped(slots_of_rows, device)
        self._kept_rows = -1 if kept is None else len(kept)
        self._kept_groups = [] if kept is None else self._grouped(
            [slots_of_rows[r] for r in kept], device)  # fmt: skip

    def clear(self) -> None:
        self._rows, self._groups, self._kept_rows, self._kept_groups = 0, [], -1, []

    def groups(self, rows: int) -> list[tuple[int, torch.Tensor | None, float]]:
        """(slot, its rows or None for all, scale) for an input of ``rows`` rows."""
        if not self._groups:
            return []
        if rows == self._rows:
            return self._groups
        if rows == self._kept_rows:
            return self._kept_groups
        raise RuntimeError(f"LoRA rows were set for {self._rows} rows (kept {self._kept_rows}), "
                           f"a layer got {rows}")  # fmt: skip

    def _grouped(self, slots: list[int], device) -> list:
        used = sorted({s for s in slots if s >= 0})
        if len(used) == 1 and all(s == used[0] for s in slots):
            return [(used[0], None, self.scales[used[0]])]
        out = []
        for s in used:
            idx = torch.tensor([i for i, x in enumerate(slots) if x == s], device=device)
            out.append((s, idx, self.scales[s]))
        return out


class LoRAStack(nn.Module):
    """One layer's adapter slots (see the module docstring); called with the layer's input
    and output, adds each row's adapter delta to the output."""

    def __init__(self, site: LoraSite, slots: int, max_rank: int, rows: LoRARows,
                 dtype: torch.dtype, device: torch.device):  # fmt: skip
        super().__init__()
        self.site, self.rows = site, rows
        n = len(site.sections)
        out_local = sum(sec.size for sec in site.sections)
        self.lora_a = nn.ParameterList([_zeros((n * max_rank, site.in_local), dtype, device)
                                        for _ in range(slots)])  # fmt: skip
        self.lora_b = nn.ParameterList([_zeros((out_local, n * max_rank), dtype, device)
                                        for _ in range(slots)])  # fmt: skip

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for slot, idx, scale in self.rows.groups(x.shape[0]):
            a, b = self.lora_a[slot], self.lora_b[slot]
            if idx is None:
                y.add_((x @ a.t()) @ b.t(), alpha=scale)
            else:
                y.index_add_(0, idx, (x.index_select(0, idx) @ a.t()) @ b.t(), alpha=scale)
        return y

    def clear_slot(self, slot: int) -> None:
        with torch.no_grad():
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()


def _zeros(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
    param.pieces = []  # placed per slot and adapter (`slot_pieces`), never by the loader
    return param


def lora_site(name: str, layer: nn.Module) -> LoraSite | None:
    """The site of linear layer ``name`` (a dotted module name), or None where LoRA does not
    apply (another kind of layer, a module LoRA does not target, GPT-2's transposed Conv1D)."""
    if not isinstance(layer, LinearBase) or not isinstance(
        layer, ColumnParallelLinear | QKVParallelLinear | RowParallelLinear
    ):
        return None
    pieces = layer.weight.pieces
    modules = [p.name.removesuffix(".weight") for p in pieces]
    if any(p.transposed for p in pieces) or any(
        m.rsplit(".", 1)[-1] not in LORA_MODULES for m in modules
    ):
        return None
    if isinstance(layer, RowParallelLinear):
        (piece,) = pieces
        (out0, out1), (in0, in1) = piece.box
        section = LoraSection(modules[0], piece.full_shape[0], out0, out1 - out0, 0)
        return LoraSite(f"{name}.lora", True, piece.full_shape[1], in0, in1 - in0, (section,))
    sections = tuple(
        LoraSection(m, p.full_shape[0], p.box[0][0], p.box[0][1] - p.box[0][0], p.offset[0])
        for m, p in zip(modules, pieces, strict=True)
    )
    in_full = pieces[0].full_shape[1]
    return LoraSite(f"{name}.lora", False, in_full, 0, in_full, sections)


def attach_lora(model: nn.Module, slots: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> tuple[LoRARows, list[LoraSite]]:  # fmt: skip
    """Give every LoRA-capable layer of ``model`` a `LoRAStack` (its ``lora`` submodule);
    the rows they share and their sites."""
    rows = LoRARows(slots)
    sites = []
    for name, layer in list(model.named_modules()):
        site = lora_site(name, layer)
        if site is not None:
            layer.lora = LoRAStack(site, slots, max_rank, rows, dtype, device)
            sites.append(site)
    return rows, sites


def prepare_slot(model: nn.Module, slot: int, scale: float) -> None:
    """Zero slot ``slot`` of every stack (an adapter of another rank or other targets may have
    used it) and set its scale: an adapter's tensors are written next."""
    rows = None
    for module in model.modules():
        if isinstance(module, LoRAStack):
            module.clear_slot(slot)
            rows = module.rows
    if rows is not None:
        rows.scales[slot] = scale
