"""A decoder layer's row-wise ops (RMSNorm, with the residual add before it or alone, the MLP's
silu-and-multiply, rotary embedding) in one pass each, float32 and bfloat16, by tandem's own C
kernels (`pointwise.c`).

torch runs each as several ops; at a decode step's sizes their dispatches and allocations cost
more than the arithmetic, and at a prefill's its silu and mul of a strided gate/up ran 9x the
kernel (docs/benchmarks.md, "Packed weights and pointwise kernels"). vLLM's CPU build fuses
the same three (its ``rms_norm``, ``silu_and_mul`` and ``rotary_embedding`` ops). Compiled at
first use (`tandem.kernels.build`); no compiler, a failed build, or
``TANDEM_POINTWISE=torch`` leaves torch's ops serving (the reason logged once). Only float32
and bfloat16 CPU tensors outside autograd take the kernels (`serves`); the layers check that
and call torch otherwise (training keeps torch's own ops). bfloat16 rounds each step where
torch's bfloat16 ops round (the kernel source says where), so it gives torch's values.

The sampler's picks over float32 logits also run here: greedy (argmax and its log-softmax) and
sampled (inverting each row's CDF at one uniform, temperature applied), two passes a row and
no [rows, vocab] output, where torch ran five or more ops over the whole logits (36.9 ms
against 1.6 ms for 96 rows of a 49,152-token vocabulary on 2 cores).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.kernels.build import Library

SOURCE = Path(__file__).with_name("pointwise.c")
MAX_HEAD_DIM = 1024  # pointwise.c
SAMPLE_BLOCK = 256  # pointwise.c: exponentials summed per block of this many

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _declare(dll: ctypes.CDLL) -> None:
    for suffix in SUFFIX.values():
        rms_norm, add_rms_norm, silu_mul, rotary = (
            getattr(dll, f"{op}_{suffix}")
            for op in ("rms_norm", "add_rms_norm", "silu_mul", "rotary")
        )
        rms_norm.restype = None
        rms_norm.argtypes = [_P, _I64, _P, _P, _I64, _I64, _F, _INT]
        add_rms_norm.restype = None
        add_rms_norm.argtypes = [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _F, _INT]
        silu_mul.restype = None
        silu_mul.argtypes = [_P, _I64, _P, _I64, _I64, _INT]
        rotary.restype = _INT
        rotary.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _I64, _INT]

    dll.greedy_f32.restype = None
    dll.greedy_f32.argtypes = [_P, _I64, _I64, _I64, _P, _P, _INT]
    dll.sample_f32.restype = None
    dll.sample_f32.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _INT]
    dll.scatter_rows.restype = _INT
    dll.scatter_rows.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _INT]


_library = Library(SOURCE, _declare, "TANDEM_POINTWISE", "pointwise kernels")
available = _library.available


def _fn(op: str, dtype: torch.dtype):
    return getattr(_library.dll, f"{op}_{SUFFIX[dtype]}")


def entry(op: str, dtype: torch.dtype | None) -> int:
    """The address of kernel ``op`` for ``dtype`` (None: an op of any dtype, as
    ``scatter_rows``), for C code that calls it (`tandem.kernels.decode_stack`)."""
    fn = getattr(_library.dll, op) if dtype is None else _fn(op, dtype)
    return ctypes.cast(fn, ctypes.c_void_p).value


def serves(x: torch.Tensor) -> bool:
    """Whether ``x`` (rows in its last dim, contiguous) takes the kernels here."""
    return (
        x.dtype in SUFFIX
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and not torch.is_grad_enabled()
        and available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` of x [..., D] (rows may be strided)."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim) if x.dim() != 2 else x
    out = torch.empty(x.shape, dtype=x.dtype)
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    weight = weight.contiguous()
    _fn("rms_norm", x.dtype)(
        rows.data_ptr(),
        rows.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        dim,
        eps,
        torch.get_num_threads(),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` and `rms_norm` of h, in one pass, for x and residual [T, D] (rows
    may be strided): returns (h, normed h)."""
    rows, dim = x.shape
    assert residual.shape == x.shape and residual.stride(-1) == 1, (residual.shape, x.shape)
    assert weight.dtype == x.dtype == residual.dtype, (weight.dtype, x.dtype, residual.dtype)
    h, out = torch.empty(rows, dim, dtype=x.dtype), torch.empty(rows, dim, dtype=x.dtype)
    weight = weight.contiguous()
    _fn("add_rms_norm", x.dtype)(
        x.data_ptr(),
        x.stride(0),
        residual.data_ptr(),
        residual.stride(0),
        weight.data_ptr(),
        h.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        eps,
        torch.get_num_threads(),
    )
    return h, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of gate_up [T, 2n] ([gate | up]) as [T, n]."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    _fn("silu_mul", gate_up.dtype)(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, n, torch.get_num_threads()
    )
    return out


def _table_ready(table: torch.Tensor, x: torch.Tensor) -> bool:
    """A rotary table the kernel reads as it is: x's dtype, contiguous, one row per token."""
    return table.dtype == x.dtype and table.is_contiguous() and table.numel() == len(x) * x.shape[2]


def rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place by the tables [T, 1, D] (`tandem.layers.rotary`)."""
    tokens, heads, dim = x.shape
    if not _table_ready(cos, x) or not _table_ready(signed_sin, x):  # else read as [T, D]
        cos = cos.reshape(tokens, dim).to(x.dtype).contiguous()
        signed_sin = signed_sin.reshape(tokens, dim).to(x.dtype).contiguous()
    rc = _fn("rotary", x.dtype)(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        cos.data_ptr(),
        signed_sin.data_ptr(),
        tokens,
        heads,
        dim,
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"rotary kernel takes an even head size up to {MAX_HEAD_DIM}, got {dim}")
    return x


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Whether each x[i] is one contiguous run (x itself may have any row stride)."""
    return x[0].is_contiguous() if len(x) else True


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)`` for a contiguous ``dst`` whose rows ``src`` matches
    (src's rows may be strided); torch's own op where the kernel does not serve. ``index``
    holds distinct rows of dst (a step writes each cache slot once)."""
    serves = (
        available()
        and dst.device.type == src.device.type == index.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.is_contiguous()
        and src.shape[1:] == dst.shape[1:]
        and index.dtype == torch.int64
        and index.is_contiguous()
        and len(index) == len(src)
        and _rows_contiguous(src)
        and not (torch.is_grad_enabled() and (dst.requires_grad or src.requires_grad))
    )
    if not serves:
        dst.index_copy_(0, index, src)
        return
    row_bytes = src[0].numel() * src.element_size() if len(src) else 0
    rc = _library.dll.scatter_rows(
        src.data_ptr(),
        src.stride(0) * src.element_size(),
        index.data_ptr(),
        dst.data_ptr(),
        dst.stride(0) * dst.element_size(),
        len(dst),
        len(src),
        row_bytes,
        torch.get_num_threads(),
    )
    if rc:
        raise IndexError(f"a row index is outside the {len(dst)} rows written into")


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (the first maximum) and its log-softmax value, for float32 logits
    [B, V] (see `serves`): (tokens int64 [B], logprobs float32 [B])."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and vocab > 0, (logits.dtype, vocab)
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    _library.dll.greedy_f32(
        logits.data_ptr(),
        logits.stride(0),
        rows,
        vocab,
        tokens.data_ptr(),
        logprobs.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens, logprobs


def sample(
    logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor, processed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of float32 logits [B, V] (see `serves`) from softmax(row /
    temperature), the first whose cumulative mass exceeds ``uniform`` [B] (in [0, 1)) times
    the row's total; greedy (`greedy`'s pick) where the temperature is 0. Its log-prob under
    the sampled distribution where ``processed`` [B] (bool), else its log_softmax value:
    (tokens int64 [B], logprobs float32 [B])."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and vocab > 0, (logits.dtype, vocab)
    assert len(temperatures) == len(uniform) == len(processed) == rows
    temps = temperatures.to(torch.float32).contiguous()
    draws = uniform.to(torch.float32).contiguous()
    flags = processed.to(torch.uint8).contiguous()
    threads = torch.get_num_threads()
    blocks = -(-vocab // SAMPLE_BLOCK)  # each thread's row: its exponentials, their block sums
    scratch = torch.empty(threads, vocab + blocks, dtype=torch.float32)
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    _library.dll.sample_f32(
        logits.data_ptr(),
        logits.stride(0),
        rows,
        vocab,
        temps.data_ptr(),
        draws.data_ptr(),
        flags.data_ptr(),
        tokens.data_ptr(),
        logprobs.data_ptr(),
        scratch.data_ptr(),
        threads,
    )
    return tokens, logprobs
