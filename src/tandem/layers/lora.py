"""LoRA on the parallel linear layers: adapter slots, and rows of one batch each applying the
adapter of their own slot (base-model rows none).

An engine made with ``enable_lora`` gives every LoRA-capable layer (q/k/v, o, gate/up, down of
a Llama-style decoder; `lora_site`) a `LoRAStack` of ``max_loras`` slots: slot ``s`` holds A
[n * R, in] and B [out, n * R] (kept transposed), where n is the number of sections the layer
fuses (3 for qkv, 2 for gate_up, else 1) and R is ``max_lora_rank``. Section i uses A's rows
and B's columns ``i*R .. i*R + r`` (an adapter of rank r <= R; the rest stays zero), so B is
block-diagonal and one pair of matmuls serves a fused layer. All slots are stacked in one A and
one B^T, so a batch mixing adapters is one pair of matmuls too: ``y += ((x A_all^T) * M)
B_all`` with M holding each row's scale on its own slot's columns (0 elsewhere, and on
base-model rows); a batch with one adapter runs that slot's rows only.

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
    site: LoraSite, slot: int, rank: int, max_rank: int, targets: tuple[str, ...], slots: int
) -> list[SlotTensor]:
    """(local key, local shape, pieces) of slot ``slot`` (of ``slots``) of ``site`` for an
    adapter of rank ``rank`` adapting ``targets``: where its canonical A [rank, in] and B
    [out, rank] land (B transposed, in ``lora_bt``)."""
    n = len(site.sections)
    width = n * max_rank  # one slot's rows of lora_a and lora_bt
    a_pieces, b_pieces = [], []
    for i, sec in enumerate(site.sections):
        if sec.module.rsplit(".", 1)[-1] not in targets:
            continue
        a_name, b_name = f"{sec.module}.lora_A.weight", f"{sec.module}.lora_B.weight"
        in_box = (site.in_start, site.in_start + site.in_local)
        row = slot * width + i * max_rank  # section i of the slot
        out_box = (sec.start, sec.start + sec.size)
        a_pieces.append(Piece(a_name, (rank, site.in_full), ((0, rank), in_box), (row, 0)))
        b_pieces.append(
            Piece(
                b_name, (sec.out_full, rank), (out_box, (0, rank)), (row, sec.at), transposed=True
            )
        )
    out_local = sum(sec.size for sec in site.sections)
    return [
        (f"{site.key}.lora_a", (slots * width, site.in_local), a_pieces),
        (f"{site.key}.lora_bt", (slots * width, out_local), b_pieces),
    ]


class LoRARows:
    """Which rows of the step being run use which slot, shared by every stack of a rank (the
    runner sets it each step), and each slot's scale (set when an adapter lands in it).

    For a layer whose slots are ``width`` rows of its stacked A it gives a `LoRAPlan`: one
    slot in the step (every adapter row on it): that slot's rows only, with a per-row scale
    where base-model rows share the batch; several: every slot at once under a mask holding
    each row's scale on its own slot's columns (made once per step and width).

    ``kept``: the rows the model's last layer keeps past attention (`AttentionMetadata.keep`),
    where the step trims; its output projection and MLP see only those."""

    def __init__(self, slots: int):
        self.slots = slots
        self.scales = [0.0] * slots
        self.clear()

    def set(
        self,
        slots_of_rows: list[int],
        kept: list[int] | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``slots_of_rows``: each row's slot, -1 for the base model."""
        self._views = {len(slots_of_rows): slots_of_rows}
        if kept is not None:
            self._views[len(kept)] = [slots_of_rows[r] for r in kept]
        self._device, self._dtype = device, dtype
        self._plans = {}

    def clear(self) -> None:
        self._views: dict[int, list[int]] = {}
        self._plans: dict[tuple[int, int], LoRAPlan | None] = {}

    def plan(self, rows: int, width: int) -> LoRAPlan | None:
        """How a layer with ``width``-row slots adds the adapters to an input of ``rows``
        rows (None: no row uses one)."""
        if not self._views:
            return None
        key = (rows, width)
        if key not in self._plans:
            slots = self._views.get(rows)
            if slots is None:
                raise RuntimeError(
                    f"LoRA rows were set for {sorted(self._views)} rows, a layer got {rows}"
                )
            self._plans[key] = self._plan(slots, width)
        return self._plans[key]

    def _plan(self, slots: list[int], width: int) -> LoRAPlan | None:
        used = sorted({s for s in slots if s >= 0})
        if not used:
            return None
        scales = [self.scales[s] if s >= 0 else 0.0 for s in slots]
        if len(used) == 1:
            s = used[0]
            scale = None
            if any(x != s for x in slots):  # base-model rows share the batch: scale 0 there
                scale = torch.tensor(scales, dtype=self._dtype, device=self._device)[:, None]
            return LoRAPlan(s, scale, self.scales[s])
        mask = torch.zeros(len(slots), self.slots, width, dtype=self._dtype, device=self._device)
        rows = [i for i, s in enumerate(slots) if s >= 0]
        index = torch.tensor(rows, device=self._device)
        which = torch.tensor([slots[i] for i in rows], device=self._device)
        value = torch.tensor([scales[i] for i in rows], dtype=self._dtype, device=self._device)
        mask[index, which] = value[:, None]
        return LoRAPlan(-1, mask.view(len(slots), self.slots * width), 1.0)


@dataclass(frozen=True, slots=True)
class LoRAPlan:
    """``slot`` >= 0: only that slot's adapter runs in the step, times ``scale`` (a per-row
    column, zero on base-model rows) or times ``factor`` (every row on it); ``slot`` -1: every
    slot at once, ``scale`` the [rows, slots * width] mask."""

    slot: int
    scale: torch.Tensor | None
    factor: float


class LoRAStack(nn.Module):
    """One layer's adapter slots (see the module docstring); called with the layer's input
    and output, adds each row's adapter delta to the output.

    ``lora_a`` [slots * n * R, in] stacks every slot's A, ``lora_bt`` [slots * n * R, out]
    every slot's B transposed (slot s: rows ``s*n*R .. (s+1)*n*R``), so one slot is a
    contiguous block of rows of each and all slots are one matrix each."""

    def __init__(
        self,
        site: LoraSite,
        slots: int,
        max_rank: int,
        rows: LoRARows,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.site, self.rows = site, rows
        self.width = len(site.sections) * max_rank
        out_local = sum(sec.size for sec in site.sections)
        self.lora_a = _zeros((slots * self.width, site.in_local), dtype, device)
        self.lora_bt = _zeros((slots * self.width, out_local), dtype, device)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        plan = self.rows.plan(x.shape[0], self.width)
        if plan is None:
            return y
        if plan.slot >= 0:  # one adapter: its slot's rows only
            rows = slice(plan.slot * self.width, (plan.slot + 1) * self.width)
            a, bt = self.lora_a[rows], self.lora_bt[rows]
            xa = x @ a.t()
            if plan.scale is not None:
                return y.addmm_(xa.mul_(plan.scale), bt)
            return y.addmm_(xa, bt, alpha=plan.factor)
        # several: every slot, each row's scale on its own slot's columns and 0 elsewhere
        return y.addmm_((x @ self.lora_a.t()).mul_(plan.scale), self.lora_bt)

    def clear_slot(self, slot: int) -> None:
        rows = slice(slot * self.width, (slot + 1) * self.width)
        with torch.no_grad():
            self.lora_a[rows].zero_()
            self.lora_bt[rows].zero_()


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


def attach_lora(
    model: nn.Module, slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[LoRARows, list[LoraSite]]:
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
