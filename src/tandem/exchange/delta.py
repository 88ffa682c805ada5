"""Delta pushes: only the elements whose engine-dtype value changed since the version the engine
holds, per box, in the smallest of three encodings, verified against the whole result.

In RL most weights do not move from one step to the next once cast to the engine's dtype (a
bfloat16 weight changes only when its float32 master crosses a rounding step). A trainer rank
keeps what it last pushed (`Shadow`: each box of its plan in the engine dtype, as many bytes as
a dense push of that rank sends) and, against it, encodes each box of the next push
(`encode_box`) as

- ``dense``: every value;
- ``bitmap``: one bit per element (set: changed), then the changed values;
- ``indices``: the changed elements' flat indices (int32), then their values;

whichever is smallest. Every part starts on an 8-byte boundary, so a payload views as its
dtypes wherever a transport lands it. The payload is plain bytes to the transports; the engine
rank applies it (`apply_box`) to its live box and checks the box's CRC32 as it then stands
against the trainer's CRC32 of its whole new box: a lost part, a wrong base or a stale shadow
cannot pass. A sparse box is applied with an undo (the old values of the changed elements), so
a rejected delta leaves the old weights serving.

A delta needs the engine to hold exactly what the shadow holds: each push has an id
(`PushHello.push_id`), the engine remembers the id of the push its weights came from
(`WeightTarget.weight_base`; anything else that touches them forgets it), and a trainer whose
shadow's id is not that gets a dense push, decided before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.dtypes import DTYPES
from tandem.exchange.checksum import tensor_crc32
from tandem.exchange.items import DeltaBox, SendItem

DELTA_MODES = (True, False, "auto")
ALIGN = 8  # every part of a payload starts here (views as int32, bf16, fp32 anywhere)
# "auto" pushes a delta only when its payload is at most this fraction of the dense push:
# below it the bytes saved outweigh encoding and applying
AUTO_MAX_FRACTION = 0.5
PAYLOAD_KEY = "\0delta"  # the tensor a delta push's items read (no model tensor has this name)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def sizes(numel: int, changed: int, itemsize: int) -> dict[str, int]:
    """The payload's bytes in each encoding for a box of ``numel`` elements."""
    values = _aligned(changed * itemsize)
    sizes = {
        "dense": _aligned(numel * itemsize),
        "bitmap": _aligned(-(-numel // 8)) + values,
        "indices": _aligned(changed * 4) + values,
    }
    # never empty (a box with nothing changed is still checked whole): transports move bytes
    return {encoding: max(n, ALIGN) for encoding, n in sizes.items()}


def _bits() -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8)


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bits, little-endian within each byte."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    pad = (-mask.numel()) % 8
    rows = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    return (rows << _bits().to(mask.device)).sum(1, dtype=torch.uint8)


def _unpack(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """`_pack`'s inverse: the flat indices of the set bits among the first ``numel``."""
    if bits.device.type == "cpu":
        mask = np.unpackbits(bits.numpy(), count=numel, bitorder="little")
        return torch.from_numpy(np.flatnonzero(mask))
    mask = ((bits.unsqueeze(1) >> _bits().to(bits.device)) & 1).view(-1)[:numel]
    return mask.nonzero().squeeze(1)


@dataclass(slots=True)
class Encoded:
    """One box encoded: its payload (uint8), how it applies, and what the shadow takes once
    the push committed (``indices`` and ``values`` of the changed elements; a dense box:
    ``values`` is the whole box)."""

    payload: torch.Tensor
    box: DeltaBox
    indices: torch.Tensor | None
    values: torch.Tensor


def encode_box(src: torch.Tensor, shadow: torch.Tensor, verify: bool) -> Encoded:
    """``src`` (the trainer's box, any dtype and strides) against ``shadow`` (what it last
    pushed: contiguous, in the engine dtype), encoded the smallest way. Elements compare by
    their bits in the engine dtype (a NaN equal to itself, -0.0 unlike 0.0)."""
    dtype = shadow.dtype
    new = src.to(dtype).contiguous().view(-1)  # a copy if it converts or gathers
    old = shadow.view(-1)
    crc = tensor_crc32(new) if verify else None
    as_int = _INT[dtype.itemsize]
    changed_at = torch.ne(new.view(as_int), old.view(as_int))
    indices = changed_at.nonzero().squeeze(1)
    k, n, itemsize = indices.numel(), new.numel(), dtype.itemsize
    size = sizes(n, k, itemsize)
    encoding = min(("indices", "bitmap", "dense"), key=lambda e: size[e])
    payload = torch.zeros(size[encoding], dtype=torch.uint8, device=new.device)
    if encoding == "dense":
        payload[: n * itemsize].copy_(new.view(torch.uint8))
        return Encoded(payload, DeltaBox("dense", k, size["dense"], crc), None, new)
    values = new[indices]
    if encoding == "bitmap":
        bits = _pack(changed_at)
        payload[: bits.numel()].copy_(bits)
        at = _aligned(bits.numel())
    else:
        payload[: k * 4].view(torch.int32).copy_(indices)
        at = _aligned(k * 4)
    payload[at : at + k * itemsize].view(dtype).copy_(values)
    return Encoded(payload, DeltaBox(encoding, k, size[encoding], crc), indices, values)


def decode(payload: torch.Tensor, box: DeltaBox, numel: int, dtype: torch.dtype):
    """(flat indices or None for a dense box, values) of a payload."""
    itemsize = dtype.itemsize
    if box.encoding == "dense":
        return None, payload[: numel * itemsize].view(dtype)
    if box.encoding == "bitmap":
        at = _aligned(-(-numel // 8))
        indices = _unpack(payload[: -(-numel // 8)], numel)
    else:
        at = _aligned(box.changed * 4)
        indices = payload[: box.changed * 4].view(torch.int32).long()
    if indices.numel() != box.changed:
        raise ValueError(f"{indices.numel()} elements marked changed, {box.changed} announced")
    return indices, payload[at : at + box.changed * itemsize].view(dtype)


class FlatView:
    """Read and write elements of a box by flat index (C order), contiguous or strided."""

    def __init__(self, box: torch.Tensor):
        self.box = box
        self.flat = box.view(-1) if box.is_contiguous() else None

    def get(self, indices: torch.Tensor) -> torch.Tensor:
        if self.flat is not None:
            return self.flat[indices]
        return self.box[torch.unravel_index(indices, self.box.shape)]

    def put(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        if self.flat is not None:
            self.flat[indices] = values
        else:
            self.box.index_put_(torch.unravel_index(indices, self.box.shape), values)


def apply_box(live: torch.Tensor, payload: torch.Tensor, box: DeltaBox):
    """Write a sparse payload's changed elements into ``live`` (a box of a live parameter):
    the undo (indices, old values) that puts them back. A dense payload is not applied here
    (`dense_values`: it is committed like a staged box)."""
    indices, values = decode(payload, box, live.numel(), live.dtype)
    view = FlatView(live)
    if indices is not None and indices.numel() and int(indices.max()) >= live.numel():
        raise ValueError(f"an index past the box's {live.numel()} elements")
    old = view.get(indices)
    view.put(indices, values.to(live.device))
    return indices, old


def undo_box(live: torch.Tensor, undo: tuple[torch.Tensor, torch.Tensor]) -> None:
    indices, old = undo
    FlatView(live).put(indices, old)


def dense_values(payload: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A dense payload's values in the box's shape."""
    return payload[: live.numel() * live.element_size()].view(live.dtype).view(live.shape)


class Shadow:
    """What one trainer rank last pushed, for the next push's delta: each box of its plan in
    the engine dtype (``items``: the plan it is laid out by; ``base``: the id of the push that
    put it into the engine). Costs as much memory as a dense push of this rank sends."""

    def __init__(self):
        self.items: list[SendItem] | None = None
        self.base: str | None = None
        self.boxes: list[torch.Tensor] = []
        self._pending: list[Encoded] | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.boxes)

    def why_not(self, items: list[SendItem]) -> str | None:
        """Why this push cannot be encoded against the shadow (or None)."""
        if self.items is None:
            return "no push committed yet"
        if self.items != items:
            return "the plan changed since the shadow's push"
        return None

    def encode(self, items: list[SendItem], tensors: dict, verify: bool) -> list[Encoded]:
        """Every item against its shadow box, kept pending until `committed`."""
        out = []
        with torch.no_grad():
            for item, shadow in zip(items, self.boxes, strict=True):
                out.append(encode_box(item.src.view(tensors[item.key]), shadow, verify))
        return out

    def pending(self, encoded: list[Encoded] | None) -> None:
        """What the push under way sends as a delta (None: it goes dense)."""
        self._pending = encoded

    def committed(self, push_id: str, delta: bool, items: list[SendItem], tensors: dict) -> None:
        """The push ``push_id`` landed: the shadow becomes what it sent (a delta's changed
        elements written in; after a dense push, every box read from ``tensors`` again)."""
        pending, self._pending = self._pending, None
        with torch.no_grad():
            if delta:
                if pending is None:
                    raise RuntimeError("a delta landed that this rank did not encode")
                for shadow, enc in zip(self.boxes, pending, strict=True):
                    flat = shadow.view(-1)
                    if enc.indices is None:
                        flat.copy_(enc.values)
                    else:
                        flat[enc.indices] = enc.values
            else:
                self.boxes = []
                for item in items:
                    src = item.src.view(tensors[item.key])
                    box = torch.empty(src.shape, dtype=DTYPES[item.dtype], device=src.device)
                    self.boxes.append(box.copy_(src))
                self.items = list(items)
        self.base = push_id

    def failed(self) -> None:
        """The push failed: the next goes dense (and reads the shadow afresh), whatever the
        failure was (a rejected delta may mean the shadow itself is wrong)."""
        self._pending = None
        self.base = None
