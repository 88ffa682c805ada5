"""bfloat16 prefill attention read in place from the paged KV cache, by tandem's own C kernel.

The torch path (`tandem.layers.attention`) runs each prompt chunk through its own
``scaled_dot_product_attention`` call (a prompt with a cached prefix gathers its context first).
In bfloat16 on CPU that flash kernel reached ~110-150 GFLOP/s while the AMX matmuls around it ran
at 1.9 TFLOP/s: attention was a third of a bf16 prefill (docs/benchmarks.md). vLLM's CPU build
has AMX prefill kernels; so does this one (`paged_prefill.c`: every prompt chunk of the step in
one call per layer, causal, keys and values read from the paged cache, AMX tile products,
float32 softmax).

It serves bfloat16 with head sizes 64 and 128 where the CPU has AMX-BF16 (and Linux grants the
process its tile state). Everywhere else, float32 and bfloat16 with head sizes 64 and 128 run
the vector kernel (`paged_prefill_vec.c`: the same arguments; scores of a few query tokens
against their keys in a float32 buffer, broadcast-FMA micro-kernels, AVX2 or AVX-512): on the
short prompts of RL rollouts torch's flash attention ran at 24-34 GFLOP/s on an AVX-512 EPYC
(docs/benchmarks.md, "A GEMV kernel for small decode batches"). With ``TANDEM_ATTENTION=torch``
(or no compiler) torch's attention serves, as before.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.build import Library

SOURCE = Path(__file__).with_name("paged_prefill.c")
VECTOR_SOURCE = Path(__file__).with_name("paged_prefill_vec.c")
HEAD_DIMS = (64, 128)  # paged_prefill.c and paged_prefill_vec.c
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # paged_prefill_vec.c


@dataclass(frozen=True, slots=True)
class PagedPrefill:
    """Every prompt chunk of one step, for `paged_prefill` (built once, used by each layer)."""

    starts: torch.Tensor  # [S] int32: each chunk's first row in the flat batch
    counts: torch.Tensor  # [S] int32: its query tokens
    lens: torch.Tensor  # [S] int32: its context length (cached prefix + the chunk)
    tables: torch.Tensor  # [S, max_blocks] int32: block tables, zero-padded
    block_size: int

    @classmethod
    def of(cls, chunks: list[tuple[int, int, int, list[int]]], block_size: int) -> PagedPrefill:
        """From each chunk's (first flat row, query tokens, context length, block table)."""
        width = max(-(-n // block_size) for _, _, n, _ in chunks)
        return cls(
            torch.tensor([row for row, _, _, _ in chunks], dtype=torch.int32),
            torch.tensor([count for _, count, _, _ in chunks], dtype=torch.int32),
            torch.tensor([n for _, _, n, _ in chunks], dtype=torch.int32),
            torch.tensor(
                [t[:width] + [0] * (width - len(t[:width])) for _, _, _, t in chunks],
                dtype=torch.int32,
            ),
            block_size,
        )


_ARGS = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]


def _declare(dll: ctypes.CDLL) -> None:
    fn = dll.paged_prefill
    fn.restype = ctypes.c_int
    fn.argtypes = _ARGS
    dll.paged_prefill_serves.restype = ctypes.c_int
    if not dll.paged_prefill_serves():
        raise RuntimeError("no AMX-BF16 on this CPU (or Linux refused the process AMX state)")


def _declare_vector(dll: ctypes.CDLL) -> None:
    for suffix in SUFFIX.values():
        fn = getattr(dll, f"paged_prefill_vec_{suffix}")
        fn.restype = ctypes.c_int
        fn.argtypes = _ARGS


_amx = Library(
    SOURCE,
    _declare,
    "TANDEM_ATTENTION",
    "AMX paged prefill kernel",
    "the vector kernel (or torch)",
    needs="amx_bf16",
)
_vector = Library(VECTOR_SOURCE, _declare_vector, "TANDEM_ATTENTION", "paged prefill kernel")


def _kernel(dtype: torch.dtype):
    """The C function serving ``dtype`` here (AMX for bf16 where granted), or None."""
    if dtype == torch.bfloat16 and _amx.available():
        return _amx.dll.paged_prefill
    if dtype in SUFFIX and _vector.available():
        return getattr(_vector.dll, f"paged_prefill_vec_{SUFFIX[dtype]}")
    return None


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a kernel serves ``dtype`` here."""
    return _kernel(dtype) is not None


def supports(
    dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether causal prefill attention of this shape runs on a kernel here."""
    fits = heads % kv_heads == 0 and head_dim in HEAD_DIMS
    return device.type == "cpu" and fits and available(dtype)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedPrefill,
    scale: float,
) -> None:
    """Write causal attention of ``batch``'s chunks of q ([T, H, D]) over their cached
    contexts (k/v_cache [slots, KV, D], the chunks' own keys already written) into the same
    rows of ``out`` ([T, H, D], contiguous)."""
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    q = q.contiguous()
    assert out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype
    fn = _kernel(q.dtype)
    if fn is None:
        raise RuntimeError(f"no paged prefill kernel serves {q.dtype} here")
    rc = fn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        batch.starts.data_ptr(),
        batch.counts.data_ptr(),
        batch.lens.data_ptr(),
        batch.tables.data_ptr(),
        len(batch.starts),
        batch.tables.shape[1],
        batch.block_size,
        heads,
        kv_heads,
        dim,
        scale,
        torch.get_num_threads(),
    )
    if rc == 2:
        raise MemoryError("paged prefill kernel: no memory for its per-thread buffers")
    if rc:
        raise RuntimeError(
            f"paged prefill kernel refused {heads} heads over {kv_heads} kv heads of size {dim}"
        )
