"""A few decode rows times a weight, by tandem's own C kernel (`gemv.c`), float32 or bfloat16.

At one to a few rows a matmul is a pass over the weight, and a decode step's weights come from
memory, not cache: the step costs the weights' bytes over the memory bandwidth plus a fixed
cost per call. The kernel reads the live weight once, in its canonical layout, with no packed
copy. `tandem.layers.gemm` times it against oneDNN and MKL over a working set past the
last-level cache and sends it the row counts where it wins (docs/benchmarks.md, "A GEMV kernel
for small decode batches").

Compiled at first use (`tandem.kernels.build`). No compiler, a failed build or
``TANDEM_GEMV=torch`` leaves the libraries serving every row count (the reason logged once).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.kernels.build import Library

SOURCE = Path(__file__).with_name("gemv.c")
MAX_ROWS = 4  # rows a call may take: past this oneDNN won (8 rows: 7.7 vs 9.1 ms a model step)
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _declare(dll: ctypes.CDLL) -> None:
    for suffix in SUFFIX.values():
        fn = getattr(dll, f"gemv_{suffix}")
        fn.restype = None
        fn.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, ctypes.c_int]


_library = Library(SOURCE, _declare, "TANDEM_GEMV", "GEMV kernel")
available = _library.available


def entry(dtype: torch.dtype) -> int:
    """The kernel's address for ``dtype``, for C code that calls it
    (`tandem.kernels.decode_stack`)."""
    return ctypes.cast(getattr(_library.dll, f"gemv_{SUFFIX[dtype]}"), ctypes.c_void_p).value


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` can run on the kernel: float32 or bfloat16 on the CPU outside
    autograd, at most `MAX_ROWS` rows of unit stride, a contiguous weight of x's dtype."""
    return (
        x.dtype in SUFFIX
        and weight.dtype == x.dtype
        and x.device.type == "cpu"
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
        and available()
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [..., in] (see `fits`), weight [out, in], bias [out]."""
    rows = x.reshape(-1, x.shape[-1])
    out_features, in_features = weight.shape
    if rows.shape[1] != in_features:
        raise ValueError(f"x has {rows.shape[1]} features, the weight takes {in_features}")
    if rows.shape[0] > MAX_ROWS:
        raise ValueError(f"the GEMV kernel takes at most {MAX_ROWS} rows, got {rows.shape[0]}")
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    getattr(_library.dll, f"gemv_{SUFFIX[x.dtype]}")(
        rows.data_ptr(),
        rows.stride(0),
        rows.shape[0],
        weight.data_ptr(),
        in_features,
        out_features,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out_features,
        torch.get_num_threads(),
    )
    return y
