"""Layouts of DTensor parameters (FSDP2, DTensor tensor parallel, both on a 2-D mesh).

A DTensor names its canonical tensor by its parameter name and its box by its placements:
``Shard(d)`` splits dim ``d`` like ``torch.chunk`` (chunks of ``ceil(n / mesh size)``, the last
ones shorter or empty), applied in mesh-dim order, each to what the earlier ones left;
``Replicate()`` keeps the dim whole. FSDP2 over a tensor-parallel mesh marks its mesh dim
``_StridedShard``: that split applies after the later mesh dims sharding the same dim.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.exchange.adapters.hf import dtype_name, named_tensors
from tandem.exchange.layout import LayoutMismatch, RankLayout
from tandem.layers.placement import Piece, whole

if TYPE_CHECKING:
    from torch.distributed.tensor import placement_types

Box = tuple[tuple[int, int], ...]
DTENSOR_MODULE = "torch.distributed.tensor"


def _dtensor_class() -> type | None:
    """DTensor, if any tensor can be one: its module is imported (by FSDP2 or whoever made
    one) before any DTensor exists. Importing it here would cost every engine worker (which
    never holds one) half a second at start."""
    module = sys.modules.get(DTENSOR_MODULE)
    return None if module is None else module.DTensor


def _strided_shard_class() -> type | None:
    from torch.distributed.tensor import placement_types  # imported already: placements exist

    return getattr(placement_types, "_StridedShard", None)


def dtensor_layout(
    module_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    rank: int,
    coordinate: Sequence[int] | None = None,
) -> RankLayout:
    """This rank's boxes. ``coordinate`` (its place in the mesh) defaults to the mesh's own
    ``get_coordinate()``; non-DTensor tensors are whole pieces. Keys are the tensors' names."""
    tensors = named_tensors(module_or_state_dict)
    layout = RankLayout(rank, dtype=dtype_name(tensors))
    problems = []
    dtensor = _dtensor_class()
    for name, tensor in tensors:
        if dtensor is None or not isinstance(tensor, dtensor):
            layout.add(name, tuple(tensor.shape), [whole(name, tuple(tensor.shape))])
            continue
        full_shape = tuple(tensor.shape)
        mesh = tensor.device_mesh
        coord = coordinate if coordinate is not None else mesh.get_coordinate()
        if coord is None:
            problems.append(f"{name}: rank {rank} is not in its device mesh")
            continue
        try:
            box = shard_box(full_shape, tensor.placements, tuple(mesh.shape), coord)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        local_shape = tuple(tensor.to_local().shape)
        box_shape = tuple(stop - start for start, stop in box)
        if local_shape != box_shape:
            problems.append(
                f"{name}: local tensor {local_shape} is not its shard {box} ({box_shape})"
            )
            continue
        empty = any(stop == start for start, stop in box)
        piece = Piece(name, full_shape, box, (0,) * len(full_shape))
        layout.add(name, local_shape, [] if empty else [piece])
    if problems:
        raise LayoutMismatch(problems)
    return layout


def shard_box(
    full_shape: Sequence[int],
    placements: Sequence[placement_types.Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> Box:
    """The canonical box the mesh point ``coordinate`` holds; pure, needs no process group."""
    if not len(placements) == len(mesh_shape) == len(coordinate):
        raise ValueError(
            f"{len(placements)} placements, mesh of shape {tuple(mesh_shape)}, "
            f"coordinate {tuple(coordinate)}: lengths differ"
        )
    box = [(0, n) for n in full_shape]
    for mesh_dim in _split_order(placements, mesh_shape):
        dim = placements[mesh_dim].dim % len(full_shape)
        lo, hi = box[dim]
        size = hi - lo
        chunk = -(-size // mesh_shape[mesh_dim])
        index = coordinate[mesh_dim]
        box[dim] = (lo + min(index * chunk, size), lo + min((index + 1) * chunk, size))
    return tuple(box)


def _split_order(placements: Sequence, mesh_shape: Sequence[int]) -> list[int]:
    """Mesh dims that shard, in the order their splits apply: plain shards left to right,
    then strided ones right to left (each after the later mesh dims it waits for)."""
    plain, strided = [], []
    strided_shard = _strided_shard_class()
    for mesh_dim, p in enumerate(placements):
        if strided_shard is not None and isinstance(p, strided_shard):
            later = 1
            for m in range(mesh_dim + 1, len(placements)):
                q = placements[m]
                if (q.is_shard() or isinstance(q, strided_shard)) and q.dim == p.dim:
                    later *= mesh_shape[m]
            if p.split_factor != later:
                raise ValueError(
                    f"{p!r} on mesh dim {mesh_dim}: split factor is not the product ({later}) "
                    f"of the later mesh dims sharding dim {p.dim}"
                )
            strided.append(mesh_dim)
        elif p.is_shard():
            plain.append(mesh_dim)
        elif p.is_partial():
            raise ValueError(f"placement {p!r} on mesh dim {mesh_dim}: partial sums hold no box")
        elif not p.is_replicate():
            raise ValueError(f"placement {p!r} on mesh dim {mesh_dim} is not supported")
    return plain + strided[::-1]
