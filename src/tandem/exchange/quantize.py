"""Pushes from a float trainer into a block-FP8 engine: the trainer quantizes, so the wire
carries one byte per weight plus one float32 scale per 128 x 128 block.

A block's scale is its amax over the whole canonical block / 448, and a trainer rank may hold
only part of a block (an FSDP shard boundary inside it, a Megatron TP split): so the senders
agree on the scales first (`agree_scales`: each rank takes the amax of the blocks its boxes
touch, one MAX all-reduce over the trainer's process group combines them, a few bytes per
16,384 weights), then every rank quantizes exactly the boxes the plan gives it
(`quantized_items`) with the reference quantizer's rule, and the engine's weights after the
push equal quantizing the trainer's whole weights at once. Planning stays blind to blocks:
boxes keep the trainer's and engine's layouts (the alternative, boxes cut on block
boundaries, would send a block split across trainer ranks through one of them).

The engine plans the scales like any tensor (`scale_sources`): every sender rank holding part
of an FP8 weight is declared to hold its whole scale grid (after the all-reduce they all
do), under a key of its own; the planner picks one sender per box as it does for replicated
tensors. A sender that already holds e4m3 values and scales (a peer engine) sends them as
they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.exchange.items import SendItem
from tandem.exchange.layout import RankLayout
from tandem.layers.fp8 import FP8, block_amax, block_scales, grid_shape, quantize_box, scale_name
from tandem.layers.placement import LocalRegion, whole

FP8_NAME = "float8_e4m3fn"


@dataclass(frozen=True, slots=True)
class Quantized:
    """A canonical weight the senders quantize: its full shape and the engine's block."""

    name: str
    shape: tuple[int, int]
    block: tuple[int, int]

    @property
    def scale_key(self) -> str:
        """The local key the senders hold its agreed scales under."""
        return "fp8-scales:" + scale_name(self.name)


def scale_sources(senders: list[RankLayout], receivers: list[RankLayout]):
    """(the sender layouts, each rank holding part of a block-FP8 weight whose scales no
    sender has now declaring its whole scale grid; the weights the senders quantize)."""
    blocks: dict[str, tuple[int, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for lay in receivers:
        blocks.update(lay.fp8_blocks)
        shapes.update(lay.canonical_shapes())
    held = {r.piece.name for lay in senders for r in lay.regions}
    quantized = [
        Quantized(n, tuple(shapes[n]), tuple(blocks[n]))
        for n in sorted(blocks)
        if n in held and scale_name(n) not in held
    ]
    if not quantized:
        return senders, []
    out = []
    for lay in senders:
        names = {r.piece.name for r in lay.regions}
        mine = [q for q in quantized if q.name in names]
        if mine:
            lay = dataclasses.replace(
                lay,
                regions=list(lay.regions),
                local_shapes=dict(lay.local_shapes),
                dtypes=dict(lay.dtypes),
            )
            for q in mine:
                grid = grid_shape(q.shape, q.block)
                lay.add(q.scale_key, grid, [whole(scale_name(q.name), grid)])
                lay.dtypes[q.scale_key] = "float32"
        out.append(lay)
    return out, quantized


def agree_scales(
    quantized: list[Quantized], layout: RankLayout, tensors: dict, world_size: int
) -> dict[str, torch.Tensor]:
    """Each quantized weight's scale grid (by `Quantized.scale_key`), from the amax of every
    block over the whole canonical tensor: this rank's boxes, combined with the other trainer
    ranks' by a MAX all-reduce over the default process group (every rank calls this, with
    the same ``quantized``)."""
    regions: dict[str, list] = {}
    for r in layout.regions:
        regions.setdefault(r.piece.name, []).append(r)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    grids = []
    with torch.no_grad():
        for q in quantized:
            grid = grid_shape(q.shape, q.block)
            amax = torch.zeros(grid, dtype=torch.float32, device=device)
            for r in regions.get(q.name, ()):
                box = r.piece.region().view(tensors[r.key])
                origin = tuple(start for start, _ in r.piece.box)
                amax = torch.maximum(amax, block_amax(box, origin, q.block, grid))
            grids.append(amax)
        flat = torch.cat([g.flatten() for g in grids]) if grids else torch.zeros(0)
        if world_size > 1 and quantized:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "a push into a block-FP8 engine from several trainer ranks agrees on the "
                    "block scales over torch.distributed: initialise the default process group"
                )
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    out, at = {}, 0
    for q, g in zip(quantized, grids, strict=True):
        out[q.scale_key] = block_scales(flat[at : at + g.numel()].view(g.shape))
        at += g.numel()
    return out


def quantized_items(
    items: list[SendItem],
    quantized: list[Quantized],
    tensors: dict,
    scales: dict[str, torch.Tensor],
):
    """(the items as the transport carries them, the tensors it reads them from): each float
    box bound for a block-FP8 weight becomes its e4m3 values (made here, once, from the box
    and the agreed scales of the blocks it lies in), read whole from a tensor of its own."""
    by_name = {q.name: q for q in quantized}
    tensors = {**tensors, **scales}
    out = []
    with torch.no_grad():
        for i, item in enumerate(items):
            source = tensors[item.key]
            if item.dtype != FP8_NAME or source.dtype == FP8:
                out.append(item)
                continue
            q = by_name.get(item.name)
            if q is None:
                raise ValueError(f"{item.name}: a float box for a block-FP8 weight without scales")
            values = quantize_box(item.src.view(source), item.origin, q.block, tensors[q.scale_key])
            key = f"fp8-values:{i}"
            tensors[key] = values
            whole_box = LocalRegion(tuple((0, n) for n in values.shape))
            out.append(dataclasses.replace(item, key=key, src=whole_box))
    return out, tensors
