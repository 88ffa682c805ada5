"""What a delta push encodes (`delta.c`): the elements that differ between two flat arrays
(a trainer's new box and its shadow, as integers of the engine dtype's width: int32 indices,
ascending), and, for a float32 box into a bfloat16 engine, all of it in one pass (rounded as
torch rounds, compared, written into the shadow, changed ones marked and gathered). numpy
serves where the kernels do not build, or with ``TANDEM_DELTA=torch``."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from tandem.kernels.build import Library

SOURCE = Path(__file__).with_name("delta.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_BY_WIDTH = {1: "changed8", 2: "changed16", 4: "changed32"}


def _declare(dll: ctypes.CDLL) -> None:
    for name in _BY_WIDTH.values():
        fn = getattr(dll, name)
        fn.restype = _I64
        fn.argtypes = [_P, _P, _I64, _P, _I64]
    dll.encode_f32_bf16.restype = _I64
    dll.encode_f32_bf16.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64]
    dll.apply16.restype = _I64
    dll.apply16.argtypes = [_P, _I64, _P, _P, _P, _I64, _P]


_library = Library(SOURCE, _declare, "TANDEM_DELTA", "delta kernels", instead="numpy")
available = _library.available


def changed(a: np.ndarray, b: np.ndarray, count: int) -> np.ndarray:
    """The indices where ``a`` and ``b`` (contiguous, one shape, 1-, 2- or 4-byte integers)
    differ, known to number ``count``."""
    if a.shape != b.shape or a.dtype != b.dtype or a.itemsize not in _BY_WIDTH:
        raise ValueError(f"cannot compare {a.dtype}{a.shape} with {b.dtype}{b.shape}")
    if not available():
        return np.flatnonzero(np.not_equal(a, b)).astype(np.int32)
    out = np.empty(count, dtype=np.int32)
    fn = getattr(_library.dll, _BY_WIDTH[a.itemsize])
    got = fn(a.ctypes.data, b.ctypes.data, a.size, out.ctypes.data, count)
    if got != count:
        raise RuntimeError(f"{got} elements differ, {count} counted")
    return out


def encode_f32_bf16(
    src: np.ndarray,
    shadow: np.ndarray,
    bitmap: np.ndarray,
    vals: np.ndarray,
    idx: np.ndarray,
    base: int = 0,
) -> int:
    """Round ``src`` (float32: 1-D contiguous, or 2-D with contiguous rows: a column slice of
    a larger array) to bfloat16 as torch does, against ``shadow`` (uint16, one per element, in
    C order), writing each value into it: the number changed, their bits set in ``bitmap``
    (zeroed, ceil(n / 8) bytes), their values in ``vals`` (room for n), their flat indices plus
    ``base`` (where ``src`` starts in its box) in ``idx`` (as many as it has room for). Only
    where `available`."""
    rows, cols = (1, src.size) if src.ndim == 1 else src.shape
    n = rows * cols
    if src.ndim not in (1, 2) or src.dtype != np.float32 or src.strides[-1] != 4:
        raise ValueError(f"cannot encode a {src.dtype}{src.shape} of strides {src.strides}")
    if shadow.size != n or vals.size < n or bitmap.size * 8 < n:
        raise ValueError(f"buffers too small for {n} elements")
    stride = cols if src.ndim == 1 else src.strides[0] // 4
    dll = _library.dll
    return dll.encode_f32_bf16(
        src.ctypes.data,
        rows,
        cols,
        stride,
        shadow.ctypes.data,
        bitmap.ctypes.data,
        vals.ctypes.data,
        idx.ctypes.data,
        idx.size,
        base,
    )


def apply16(
    live: np.ndarray,
    bitmap: np.ndarray | None,
    idx: np.ndarray | None,
    vals: np.ndarray,
    old: np.ndarray,
) -> None:
    """Write ``vals`` into ``live`` (uint16, contiguous) at the set bits of ``bitmap`` or at
    ``idx``, in order, the values there before into ``old``; ValueError if the payload marks
    an element past the box or another number than ``vals`` holds. Only where
    `available`."""
    k = vals.size
    if old.size < k:
        raise ValueError(f"room for {old.size} old values, {k} to write")
    if bitmap is not None and bitmap.size * 8 < live.size:
        raise ValueError(f"a bitmap of {bitmap.size} bytes for {live.size} elements")
    got = _library.dll.apply16(
        live.ctypes.data,
        live.size,
        None if bitmap is None else bitmap.ctypes.data,
        None if idx is None else idx.ctypes.data,
        vals.ctypes.data,
        k,
        old.ctypes.data,
    )
    if got != k:
        raise ValueError(f"the payload does not mark {k} elements of {live.size}")
