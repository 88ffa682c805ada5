"""CRC32 of a box's bytes: what a sender and a receiver compare to verify a push.

The value is zlib's CRC32 of the box's elements in C order, in the engine's dtype. It is
computed with ISA-L (``isal``: carry-less-multiply folding, several GB/s per core; zlib 1.2's
table-driven CRC32 is about 4x slower), so verification is cheap enough to leave on. CPU boxes
whose rows are contiguous go through `tandem.kernels.copy` (a page per call; a checked copy
takes each 2 KiB piece's CRC32 as it reads it, then copies it from cache: one pass over
memory).
Other boxes are checksummed in bounded row chunks copied to a scratch buffer, never as a
box-sized copy.
"""

from __future__ import annotations

import torch
from isal.isal_zlib import crc32 as _crc32

from tandem.kernels import copy as kernels

CHUNK_BYTES = 2 << 20  # a scratch chunk that stays in cache between its copy and its CRC


def crc32(data, value: int = 0) -> int:
    """CRC32 of a contiguous uint8 CPU tensor's (or a buffer's) bytes, continuing ``value``."""
    if isinstance(data, torch.Tensor):
        data = data.numpy().data if data.numel() else b""
    return _crc32(data, value)


def tensor_crc32(t: torch.Tensor, value: int = 0) -> int:
    """CRC32 of ``t``'s elements in C order (any strides, on any device), continuing ``value``."""
    if t.numel() == 0:
        return value
    if kernels.served(t):
        return kernels.crc(t, value)
    if t.is_contiguous():
        flat = t.reshape(-1).view(torch.uint8)
        if t.device.type == "cpu":
            return crc32(flat, value)
        for start in range(0, flat.numel(), CHUNK_BYTES):  # device memory: copied chunk by chunk
            value = crc32(flat[start : start + CHUNK_BYTES].cpu(), value)
        return value
    if t.dim() > 2:
        for sub in t:
            value = tensor_crc32(sub, value)
        return value
    rows = t if t.dim() == 2 else t.unsqueeze(0)
    step = max(1, CHUNK_BYTES // (rows.shape[1] * t.element_size()))
    scratch = torch.empty(min(step, rows.shape[0]) * rows.shape[1], dtype=t.dtype)
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step]
        out = scratch[: part.numel()].view(part.shape)
        out.copy_(part)
        value = crc32(out.view(-1).view(torch.uint8), value)
    return value


def source_crc32(src: torch.Tensor, dtype: torch.dtype, value: int = 0) -> int:
    """CRC32 of ``src``'s elements in C order as they must land: converted to ``dtype`` (in
    bounded row chunks through a scratch buffer when it differs; no copy when it does not).
    This is what a sender computes from the bytes it reads, independently of any writer."""
    if src.dtype == dtype or src.numel() == 0:
        return tensor_crc32(src, value)
    rows = src.view(1) if src.dim() == 0 else src
    step = max(1, CHUNK_BYTES // max(1, rows[0].numel() * dtype.itemsize))
    scratch = torch.empty(
        min(step, rows.shape[0]) * rows[0].numel(), dtype=dtype, device=src.device
    )
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step]
        out = scratch[: part.numel()].view(part.shape)
        out.copy_(part)
        value = tensor_crc32(out, value)
    return value


def checked_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    verify: bool,
    stream: bool | None = None,
    value: int = 0,
) -> int | None:
    """``dst.copy_(src)`` (same shape; converts dtype), and, with ``verify``, the CRC32 of
    ``src`` as it must land (`source_crc32` in ``dst``'s dtype, continuing ``value``). Rows
    are checksummed and copied chunk by chunk, each chunk just before its copy, so the source
    is read from memory once; the checksum never looks at ``dst``: the receiver's check of
    what landed there is what catches a wrong copy. ``stream`` (where `tandem.kernels.copy`
    serves): store past the cache, or (False) through it, for bytes read next; default by
    size."""
    if src.dtype == dst.dtype and src.shape == dst.shape and kernels.served(src, dst):
        if verify:
            return kernels.crc_copy(src, dst, value, stream=stream)
        return kernels.copy(src, dst, stream=stream)
    if not verify:
        dst.copy_(src)
        return None
    if src.numel() == 0:
        return value
    if src.dim() == 0:
        src, dst = src.view(1), dst.view(1)
    rows = max(1, CHUNK_BYTES // max(1, src[0].numel() * dst.element_size()))
    for start in range(0, src.shape[0], rows):
        part = src[start : start + rows]
        value = source_crc32(part, dst.dtype, value)
        dst[start : start + rows].copy_(part)
    return value
