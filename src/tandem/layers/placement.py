"""Where each local parameter's elements come from: boxes of canonical (Hugging Face) tensors.

Every parameter of a tandem layer carries ``param.pieces``: a list of :class:`Piece`, each saying
"this region of me is that box of canonical tensor X". `Piece.region` is the one place a
canonical box is mapped to a region of a local tensor (`LocalRegion`): the disk loader, the
exchange planner, every transport's writer and every receiver go through it, so placement lives
with the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class LocalRegion:
    """Where a canonical box lies in a local tensor: ``slices`` of it (one ``(start, stop)`` per
    local dimension), holding the box transposed when ``transposed``."""

    slices: tuple[tuple[int, int], ...]
    transposed: bool = False

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The box inside ``tensor``, in the box's own (canonical) orientation: a view, so
        writes land in ``tensor``."""
        view = tensor[tuple(slice(a, b) for a, b in self.slices)]
        return view.t() if self.transposed else view


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of canonical tensor ``name`` that lands at ``offset`` of the local parameter.

    ``box`` holds one ``(start, stop)`` per canonical dimension. With ``transposed`` the box is
    a 2-D slice whose transpose is stored locally (HF GPT-2 ``Conv1D`` keeps weights as [in, out]).
    """

    name: str
    full_shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    offset: tuple[int, ...]
    transposed: bool = False

    @property
    def box_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)

    def box_slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, stop) for start, stop in self.box)

    def region(self, box: Box | None = None) -> LocalRegion:
        """Where canonical ``box`` (inside this piece's box; default: all of it) lies in the
        local tensor."""
        box = self.box if box is None else box
        rel = [b0 - p0 for (b0, _), (p0, _) in zip(box, self.box, strict=True)]
        sizes = [b1 - b0 for b0, b1 in box]
        if self.transposed:  # the local tensor holds the box transposed
            rel, sizes = rel[::-1], sizes[::-1]
        slices = tuple(
            (off + r, off + r + n) for off, r, n in zip(self.offset, rel, sizes, strict=True)
        )
        return LocalRegion(slices, self.transposed)

    def write(self, param: torch.Tensor, box_value: torch.Tensor) -> None:
        """Copy the canonical box ``box_value`` into its place in ``param``."""
        if tuple(box_value.shape) != self.box_shape:
            raise ValueError(
                f"{self.name}: box of shape {tuple(box_value.shape)} given, "
                f"expected {self.box_shape}"
            )
        self.region().view(param).copy_(box_value)


def whole(name: str, shape: tuple[int, ...], *, transposed: bool = False) -> Piece:
    """The entire canonical tensor, stored as is (or transposed)."""
    box = tuple((0, n) for n in shape)
    return Piece(name, tuple(shape), box, (0,) * len(shape), transposed)


def rows(name: str, full_shape: tuple[int, ...], start: int, stop: int, at: int = 0) -> Piece:
    """Canonical rows ``[start, stop)`` (dim 0), stored from local row ``at``."""
    box = ((start, stop),) + tuple((0, n) for n in full_shape[1:])
    return Piece(name, tuple(full_shape), box, (at,) + (0,) * (len(full_shape) - 1))


def cols(name: str, full_shape: tuple[int, int], start: int, stop: int) -> Piece:
    """Canonical columns ``[start, stop)`` of a 2-D tensor."""
    return Piece(name, tuple(full_shape), ((0, full_shape[0]), (start, stop)), (0, 0))


def set_pieces(param: nn.Parameter, pieces: list[Piece]) -> nn.Parameter:
    param.pieces = pieces
    return param


def replicated(shape: tuple[int, ...], name: str) -> nn.Parameter:
    """A parameter every rank holds whole: all of canonical tensor ``name``."""
    return set_pieces(nn.Parameter(torch.empty(shape), requires_grad=False), [whole(name, shape)])


def canonical_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the module's parameters read, with its full shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for param in unique_parameters(module):
        for piece in param.pieces:
            shapes[piece.name] = piece.full_shape
    return shapes


def unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters once each (a tied head shares the embedding's tensor), all with pieces."""
    params = list(module.parameters())
    missing = [n for n, p in module.named_parameters() if not hasattr(p, "pieces")]
    if missing:
        raise TypeError(f"parameters without placement pieces: {missing}")
    return params
