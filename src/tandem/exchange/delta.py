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

A delta needs the engine to hold exactly what the shadow holds: the exchange server gives each
push an id (`UpdateSpec.push_id`, told the trainers in `PushDone`), the engine remembers the
id of the push its weights came from (`WeightTarget.weight_base`; anything else that touches
them forgets it), and a trainer whose shadow's id is not that gets a dense push, decided
before any byte moves. A fleet takes a delta when every replica holds that id. A target that
keeps no id (vLLM, a LoRA adapter's slot) takes dense pushes only, and its trainers keep no
shadow.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tandem.dtypes import DTYPES
from tandem.exchange.checksum import crc32, tensor_crc32
from tandem.exchange.items import DeltaBox, SendItem
from tandem.kernels.delta import apply16, available, changed, encode_f32_bf16

ALIGN = 8  # every part of a payload starts here (views as int32, bf16, fp32 anywhere)
# "auto" pushes a delta only when its payload is at most this fraction of the dense push:
# below it the bytes saved outweigh encoding and applying
AUTO_MAX_FRACTION = 0.5
# after a push "auto" found not worth a delta, this many go dense without encoding (the last
# reads the shadow afresh) before it tries again
AUTO_RETRY_AFTER = 4
ENCODE_THREADS = max(1, min(4, os.cpu_count() or 1))
# the fused encode's part of a box (elements): its shadow (1 MiB) is still in cache when its
# CRC32 reads it back
FUSED_CHUNK = 1 << 19
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
    """One box encoded: its payload (uint8) and how it applies."""

    payload: torch.Tensor
    box: DeltaBox


def encode_box(src: torch.Tensor, shadow: torch.Tensor, verify: bool) -> Encoded:
    """``src`` (the trainer's box, any dtype and strides) against ``shadow`` (what it last
    pushed: contiguous, in the engine dtype), encoded the smallest way; the shadow then holds
    ``src`` (in the engine dtype). Elements compare by their bits in the engine dtype (a NaN
    equal to itself, -0.0 unlike 0.0)."""
    dtype = shadow.dtype
    if _fused(src, shadow):
        return _encode_fused(src, shadow, verify)
    new = src.to(dtype).contiguous().view(-1)  # a copy if it converts or gathers
    crc = tensor_crc32(new) if verify else None
    as_int = _INT[dtype.itemsize]
    n, itemsize = new.numel(), dtype.itemsize
    if new.device.type == "cpu":  # numpy: one pass each, vectorized (torch's nonzero is not)
        a, b = new.view(as_int).numpy(), shadow.view(-1).view(as_int).numpy()
        mask = np.not_equal(a, b)
        k = int(np.count_nonzero(mask))
    else:
        a, b = new.view(as_int), shadow.view(-1).view(as_int)
        mask = torch.ne(a, b)
        k = int(mask.sum())
    size = sizes(n, k, itemsize)
    encoding = min(("indices", "bitmap", "dense"), key=lambda e: size[e])
    box = DeltaBox(encoding, k, size[encoding], crc)
    if encoding == "dense":
        payload = torch.empty(size["dense"], dtype=torch.uint8, device=new.device)
        payload[n * itemsize :].zero_()
        payload[: n * itemsize].copy_(new.view(torch.uint8))
        shadow.view(-1).copy_(new)
        return Encoded(payload, box)
    payload = torch.zeros(size[encoding], dtype=torch.uint8, device=new.device)
    if new.device.type == "cpu":
        where = changed(a, b, k)  # int32, ascending
        values = torch.from_numpy(np.take(a, where).view(np.uint8))
        if encoding == "bitmap":
            head = torch.from_numpy(np.packbits(mask, bitorder="little"))
        else:
            head = torch.from_numpy(where.view(np.uint8))
        shadow.view(-1).copy_(new)
    else:
        indices = mask.nonzero().squeeze(1)
        head = _pack(mask) if encoding == "bitmap" else indices.to(torch.int32).view(torch.uint8)
        values = a[indices]
        b[indices] = values
        values = values.view(torch.uint8)
    payload[: head.numel()].copy_(head)
    at = _aligned(head.numel())
    payload[at : at + k * itemsize].copy_(values)
    return Encoded(payload, box)


def _fused(src: torch.Tensor, shadow: torch.Tensor) -> bool:
    """Whether the one-pass kernel encodes this box (float32 into bfloat16, on the CPU, in
    rows that are contiguous: a whole tensor, or a tensor-parallel shard's column slice)."""
    return (
        src.dtype == torch.float32
        and shadow.dtype == torch.bfloat16
        and src.device.type == "cpu"
        and (src.is_contiguous() or (src.dim() == 2 and src.stride(1) == 1))
        and available()
    )


def _encode_fused(src: torch.Tensor, shadow: torch.Tensor, verify: bool) -> Encoded:
    """`encode_box` in one pass over the box (`tandem.kernels.delta.encode_f32_bf16`)."""
    n = src.numel()
    flat = shadow.view(-1)
    bits = np.zeros(-(-n // 8), dtype=np.uint8)
    vals = np.empty(n, dtype=np.uint16)
    # indices are the smallest encoding only where 4k < n / 8 + 8: k < n / 32 + 2
    idx = np.empty(n // 32 + 8, dtype=np.int32)
    rows = (src.reshape(-1) if src.is_contiguous() else src).numpy()
    rows = rows.reshape(1, -1) if rows.ndim == 1 else rows
    cols = rows.shape[1]
    b = flat.view(torch.int16).numpy().view(np.uint16)
    unit = 8 // math.gcd(8, cols)  # parts of whole rows, each starting on a bitmap byte
    step = max(unit, FUSED_CHUNK // cols // unit * unit)
    k, crc = 0, 0
    for r in range(0, rows.shape[0], step):  # each part's CRC32 while it is in cache
        start, end = r * cols, min(n, (r + step) * cols)
        part = rows[r : r + step]
        k += encode_f32_bf16(part, b[start:end], bits[start // 8 :], vals[k:], idx[k:], start)
        if verify:
            crc = crc32(b[start:end].view(np.uint8), crc)
    crc = crc if verify else None
    size = sizes(n, k, 2)
    encoding = min(("indices", "bitmap", "dense"), key=lambda e: size[e])
    box = DeltaBox(encoding, k, size[encoding], crc)
    payload = torch.zeros(size[encoding], dtype=torch.uint8)
    if encoding == "dense":
        payload[: 2 * n].copy_(flat.view(torch.uint8))
        return Encoded(payload, box)
    head = bits if encoding == "bitmap" else idx[:k].view(np.uint8)
    payload[: head.size].copy_(torch.from_numpy(head))
    at = _aligned(head.size)
    payload[at : at + 2 * k].copy_(torch.from_numpy(vals[:k].view(np.uint8)))
    return Encoded(payload, box)


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
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError("the payload's indices do not ascend")
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
    the undo that puts them back (`undo_box`). A dense payload is not applied here
    (`dense_values`: it is committed like a staged box)."""
    n = live.numel()
    if live.is_contiguous() and live.element_size() == 2 and live.device.type == "cpu":
        if available():  # one pass over the bitmap (or indices), no index tensors
            flat = live.view(-1).view(torch.int16).numpy().view(np.uint16)
            raw = payload.numpy()
            head = -(-n // 8) if box.encoding == "bitmap" else box.changed * 4
            bits = raw[:head] if box.encoding == "bitmap" else None
            idx = None if bits is not None else raw[:head].view(np.int32)
            at = _aligned(head)
            vals = raw[at : at + 2 * box.changed].view(np.uint16)
            old = np.empty(box.changed, dtype=np.uint16)
            apply16(flat, bits, idx, vals, old)
            return (flat, bits, idx, old)
    as_int = _INT[live.element_size()]  # bits as bits (index_put has no float8 kernels)
    indices, values = decode(payload, box, n, as_int)
    view = FlatView(live.view(as_int))
    if indices is not None and indices.numel() and int(indices.max()) >= n:
        raise ValueError(f"an index past the box's {n} elements")
    old = view.get(indices)
    view.put(indices, values.to(live.device))
    return indices, old


def undo_box(live: torch.Tensor, undo: tuple) -> None:
    """Put back what `apply_box` changed."""
    if len(undo) == 4:  # the kernel's: the old values go where the new ones went
        flat, bits, idx, old = undo
        apply16(flat, bits, idx, old, np.empty_like(old))
        return
    indices, old = undo
    FlatView(live.view(_INT[live.element_size()])).put(indices, old)


def dense_values(payload: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A dense payload's values in the box's shape."""
    return payload[: live.numel() * live.element_size()].view(live.dtype).view(live.shape)


class Shadow:
    """What one trainer rank last pushed, for the next push's delta: each box of its plan in
    the engine dtype (``items``: the plan it is laid out by; ``base``: the id of the push that
    put it into the engine). Costs as much memory as a dense push of this rank sends. Encoding
    a push writes its new values in (`encode_box`), so a push that fails leaves no base: the
    next goes dense and reads the shadow afresh."""

    def __init__(self):
        self.items: list[SendItem] | None = None
        self.base: str | None = None
        self.boxes: list[torch.Tensor] = []
        self._fresh = False  # the boxes hold the push under way (it was encoded)

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
        """Every item against its shadow box, on ``ENCODE_THREADS`` threads (encoding is bound
        by memory, and one core does not draw all of it; the kernels and the CRC32 leave the
        GIL); the boxes then hold this push."""
        self.base, self._fresh = None, True  # until the push commits

        def one(pair) -> Encoded:
            item, shadow = pair
            with torch.no_grad():
                return encode_box(item.src.view(tensors[item.key]), shadow, verify)

        pairs = list(zip(items, self.boxes, strict=True))
        # the largest first, so no thread is left with a large box at the end
        order = sorted(range(len(pairs)), key=lambda i: -self.boxes[i].numel())
        out: list[Encoded | None] = [None] * len(pairs)
        with ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="tandem-delta") as pool:
            for i, encoded in zip(order, pool.map(one, [pairs[i] for i in order]), strict=True):
                out[i] = encoded
        return out

    def committed(self, push_id: str, items: list[SendItem], tensors: dict) -> None:
        """The push ``push_id`` landed: the shadow is what it sent (encoded: already; else
        every box read from ``tensors``, into the boxes it has where the plan is the same)."""
        if not self._fresh:
            reuse = self.boxes if self.items == items else [None] * len(items)
            self.boxes = []
            with torch.no_grad():
                for item, box in zip(items, reuse, strict=True):
                    src = item.src.view(tensors[item.key])
                    if box is None:
                        box = torch.empty(src.shape, dtype=DTYPES[item.dtype], device=src.device)
                    self.boxes.append(box.copy_(src))
            self.items = list(items)
        self.base, self._fresh = push_id, False

    def clear(self) -> None:
        """No shadow: its memory is freed, the next push goes dense."""
        self.items, self.base, self.boxes, self._fresh = None, None, [], False

    def failed(self) -> None:
        """The push failed: the next goes dense (and reads the shadow afresh), whatever the
        failure was (a rejected delta may mean the shadow itself is wrong)."""
        self.base, self._fresh = None, False
