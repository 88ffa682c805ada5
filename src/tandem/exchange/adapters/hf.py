"""Layouts of plain modules and state dicts whose names already are the canonical (HF) names."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tandem.exchange.layout import RankLayout
from tandem.layers.placement import whole


def module_layout(
    module_or_state_dict: nn.Module | Mapping[str, torch.Tensor], rank: int = 0
) -> RankLayout:
    """Each tensor is one whole piece of the canonical tensor of the same name."""
    tensors = named_tensors(module_or_state_dict)
    layout = RankLayout(rank, dtype=dtype_name(tensors))
    for name, tensor in tensors:
        layout.add(name, tuple(tensor.shape), [whole(name, tuple(tensor.shape))])
    return layout


def named_tensors(
    module_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) once per tensor: a module's parameters (tied ones once), or a state dict's
    entries less those that are the same view of the same storage as an earlier entry."""
    if isinstance(module_or_state_dict, nn.Module):
        return list(module_or_state_dict.named_parameters())
    seen: set[tuple] = set()
    out = []
    for name, tensor in module_or_state_dict.items():
        key = _view_identity(tensor)
        if key not in seen:
            seen.add(key)
            out.append((name, tensor))
    return out


def dtype_name(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """The layout's dtype: that of its first tensor (``float32`` when it has none)."""
    if not tensors:
        return "float32"
    return str(local_tensor(tensors[0][1]).dtype).removeprefix("torch.")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (what this rank holds); any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)  # a DTensor's own shard
    return to_local() if to_local is not None else tensor


def _view_identity(tensor: torch.Tensor) -> tuple:
    t = local_tensor(tensor)
    # the storage object's address: data_ptr() is 0 for every meta or empty tensor
    storage = t.untyped_storage()._cdata
    return (storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
