"""bfloat16 prefill attention read in place from the paged KV cache, by tandem's own C kernel.

The torch path (`tandem.layers.attention`) runs each prompt chunk through its own
``scaled_dot_product_attention`` call (a prompt with a cached prefix gathers its context first).
In bfloat16 on CPU that flash kernel reached ~110-150 GFLOP/s while the AMX matmuls around it ran
at 1.9 TFLOP/s: attention was a third of a bf16 prefill (docs/benchmarks.md). vLLM's CPU build
has AMX prefill kernels; so does this one (`paged_prefill.c`: every prompt chunk of the step in
one call per layer, causal, keys and values read from the paged cache, AMX tile products,
float32 softmax).

It serves bfloat16 with head sizes 64 and 128 where the CPU has AMX-BF16 (and Linux grants the
process its tile state); elsewhere (and with ``TANDEM_ATTENTION=torch``) torch's attention
does, as before.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.build import Library

SOURCE = Path(__file__).with_name("paged_prefill.c")
HEAD_DIMS = (64, 128)  # paged_prefill.c


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


def _declare(dll: ctypes.CDLL) -> None:
    fn = dll.paged_prefill
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    dll.paged_prefill_serves.restype = ctypes.c_int
    if not dll.paged_prefill_serves():
        raise RuntimeError("no AMX-BF16 on this CPU (or Linux refused the process AMX state)")


_library = Library(SOURCE, _declare, "TANDEM_ATTENTION", "paged prefill kernel")
available = _library.available


def supports(
    dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether causal prefill attention of this shape runs on the kernel here."""
    fits = heads % kv_heads == 0 and head_dim in HEAD_DIMS
    return device.type == "cpu" and dtype == torch.bfloat16 and fits and available()


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
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16
    rc = _library.dll.paged_prefill(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        batch.starts.data_ptr(), batch.counts.data_ptr(), batch.lens.data_ptr(),
        batch.tables.data_ptr(), len(batch.starts), batch.tables.shape[1], batch.block_size,
        heads, kv_heads, dim, scale, torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise RuntimeError(
            f"paged prefill kernel refused {heads} heads over {kv_heads} kv heads of size {dim}"
        )
