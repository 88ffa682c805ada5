"""CRC32 of a box's bytes: what a sender and a receiver compare to verify a push.

The value is zlib's CRC32 of the box's elements in C order, in the engine's dtype. It is
computed with ISA-L (``isal``: carry-less-multiply folding, several GB/s per core; zlib 1.2's
table-driven CRC32 is about 4x slower), so verification is cheap enough to leave on. A box
that is not contiguous in memory is checksummed in bounded row chunks copied to a scratch
buffer, never as a box-sized copy.
"""

from __future__ import annotations

import torch
from isal.isal_zlib import crc32 as _crc32

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


def copy_with_crc32(src: torch.Tensor, dst: torch.Tensor, verify: bool) -> int | None:
    """``dst.copy_(src)`` (same shape; converts dtype), and, with ``verify``, the CRC32 of the
    bytes as they landed in ``dst`` (C order): each chunk is checksummed right after it is
    written, from cache, rather than in a second pass over memory (on a device: chunk by
    chunk through host memory, as `tensor_crc32`)."""
    if not verify:
        dst.copy_(src)
        return None
    if src.numel() == 0:
        return 0
    if src.dim() == 0:
        src, dst = src.view(1), dst.view(1)
    rows = max(1, CHUNK_BYTES // max(1, src[0].numel() * dst.element_size()))
    scratch = None
    value = 0
    for start in range(0, src.shape[0], rows):
        part, out = src[start : start + rows], dst[start : start + rows]
        if out.is_contiguous():
            out.copy_(part)
            value = tensor_crc32(out, value)
            continue
        if scratch is None:
            scratch = torch.empty(min(rows, src.shape[0]) * src[0].numel(), dtype=dst.dtype,
                                  device=dst.device)  # fmt: skip
        staged = scratch[: part.numel()].view(part.shape)
        staged.copy_(part)
        value = tensor_crc32(staged, value)
        out.copy_(staged)
    return value
