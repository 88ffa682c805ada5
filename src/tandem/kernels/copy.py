"""A push's copies and CRC32s at memory speed (`copy.c`): a box copied with the CRC32 of each
2 KiB piece taken as it is read (the source read from memory once), copies that store past the
cache, and the CRC32 of a box a page per call.

On the sync bench's host a trainer rank's checked copy of 272 MiB ran at 12-14 GiB/s this way,
against 5 GiB/s for torch's ``copy_`` after ISA-L's CRC32 chunk by chunk, and 7-8 GiB/s for
``copy_`` alone (docs/benchmarks.md, `tandem bench sync`). The CRC32 is ISA-L's
``crc32_gzip_refl`` (zlib's CRC32) from the ``isal`` package, called by the kernel through a
pointer. A box is served where it is a CPU tensor whose rows are contiguous and apart
(`served`); callers fall back to torch and `tandem.exchange.checksum`'s chunked path
otherwise, and everywhere when the kernels do not build, the ``isal`` package exports no
``crc32_gzip_refl``, or ``TANDEM_COPY=torch``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.kernels.build import Library

SOURCE = Path(__file__).with_name("copy.c")
STREAM_BYTES = 1 << 20  # a copy this large stores past the cache (see copy.c)

_P, _I64, _U32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int
_crc_fn: int | None = None  # ISA-L's crc32_gzip_refl


def _declare(dll: ctypes.CDLL) -> None:
    global _crc_fn
    from isal import isal_zlib

    _crc_fn = ctypes.cast(ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl, _P).value
    dll.crc_copy.restype = _U32
    dll.crc_copy.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _P, _U32, _INT]
    dll.copy.restype = None
    dll.copy.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _INT]
    dll.crc.restype = _U32
    dll.crc.argtypes = [_P, _I64, _I64, _I64, _P, _U32]


_library = Library(SOURCE, _declare, "TANDEM_COPY", "copy kernels")
available = _library.available


def _rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(address, bytes between rows, rows, bytes a row) of ``t``'s elements in C order as rows
    of contiguous bytes, or None where they are not (or ``t`` is not on the CPU)."""
    if t.device.type != "cpu":
        return None
    size = t.element_size()
    if t.is_contiguous():
        return t.data_ptr(), 0, 1, t.numel() * size
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]:  # rows apart
        return t.data_ptr(), t.stride(0) * size, t.shape[0], t.shape[1] * size
    return None


def served(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors (each on the CPU, its rows contiguous)."""
    return all(_rows(t) is not None for t in tensors) and available()


def crc_copy(
    src: torch.Tensor, dst: torch.Tensor, value: int = 0, stream: bool | None = None
) -> int:
    """``dst.copy_(src)`` (one shape and dtype, both `served`), returning the CRC32 of ``src``'s
    bytes in C order (continuing ``value``) as they were read: never of ``dst``. ``stream``:
    as for `copy`."""
    s, d = _pair(src, dst)
    if stream is None:
        stream = s[2] * s[3] >= STREAM_BYTES
    return _dll().crc_copy(d[0], d[1], s[0], s[1], s[2], s[3], _crc_fn, value, bool(stream))


def copy(src: torch.Tensor, dst: torch.Tensor, stream: bool | None = None) -> None:
    """``dst.copy_(src)`` (one shape and dtype, both `served`); ``stream``: store past the
    cache (default: for copies of `STREAM_BYTES` or more; pass False for bytes read next)."""
    s, d = _pair(src, dst)
    if stream is None:
        stream = s[2] * s[3] >= STREAM_BYTES
    _dll().copy(d[0], d[1], s[0], s[1], s[2], s[3], bool(stream))


def crc(t: torch.Tensor, value: int = 0) -> int:
    """The CRC32 of ``t``'s bytes in C order (`served`), continuing ``value``."""
    where = _rows(t)
    if where is None:
        raise ValueError(f"the copy kernels take no {t.device.type} tensor of strides {t.stride()}")
    addr, stride, rows, row_bytes = where
    return _dll().crc(addr, stride, rows, row_bytes, _crc_fn, value)


def _dll() -> ctypes.CDLL:
    if not available():
        raise RuntimeError(f"the copy kernels do not serve here: {_library.why_not}")
    return _library.dll


def _pair(src: torch.Tensor, dst: torch.Tensor):
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(
            f"cannot copy {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}"
        )
    s, d = _rows(src), _rows(dst)
    if s is None or d is None:
        raise ValueError("the copy kernels take CPU tensors whose rows are contiguous")
    if s[2] != d[2]:  # one side contiguous, the other rows apart: both as rows
        s = (s[0], s[1] or s[3] // d[2], d[2], d[3]) if s[2] == 1 else s
        d = (d[0], d[1] or d[3] // s[2], s[2], s[3]) if d[2] == 1 else d
    return s, d
