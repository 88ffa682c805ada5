"""Decode attention read in place from the paged KV cache, by tandem's own C kernel.

The torch path (`tandem.layers.attention`) gathers each decode group's cached keys and values
into a padded batch before ``scaled_dot_product_attention``: every step, every layer, every
context is copied once more than it is read, and each group costs a handful of small ops. On
CPU that was as much time as the model's matmuls in the GRPO bench (docs/benchmarks.md).
vLLM's CPU build reads its paged cache in place with its own kernels; so does this one
(`paged_decode.c`: one call per layer for every decode sequence, no gather, no padding,
float32 softmax, OpenMP over (sequence, kv head) on torch's threads; AVX-512 bodies for head
sizes 64 and 128 where the CPU has it, `paged_decode_avx512.h`).

The source ships with the package and is compiled at first use (`tandem.kernels.build`). No
compiler, a failed build, or ``TANDEM_ATTENTION=torch`` leaves the torch path serving; the
reason is logged once.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.build import Library

SOURCE = Path(__file__).with_name("paged_decode.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_GROUP = 64  # query heads per kv head (paged_decode.c)
MAX_HEAD_DIM = 1024  # paged_decode.c


@dataclass(frozen=True, slots=True)
class PagedDecode:
    """Every decode sequence of one step, for `paged_decode` (built once, used by each layer)."""

    rows: torch.Tensor  # [B] int64: each sequence's row in the flat batch
    tables: torch.Tensor  # [B, max_blocks] int32: block tables, zero-padded
    lens: torch.Tensor  # [B] int32: context lengths (the new token included)
    block_size: int

    @classmethod
    def of(cls, decodes: list[tuple[int, int, list[int]]], block_size: int) -> PagedDecode:
        """From each sequence's (flat row, context length, block table), sorted by first block:
        sequences sharing a prompt's blocks run one after another on one thread (read once)."""
        decodes = sorted(decodes, key=lambda d: (d[2][0], d[0]))
        width = max(-(-n // block_size) for _, n, _ in decodes)
        return cls(
            torch.tensor([row for row, _, _ in decodes], dtype=torch.int64),
            torch.tensor(
                [t[:width] + [0] * (width - len(t[:width])) for _, _, t in decodes],
                dtype=torch.int32,
            ),
            torch.tensor([n for _, n, _ in decodes], dtype=torch.int32),
            block_size,
        )


def _declare(dll: ctypes.CDLL) -> None:
    fn = dll.paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = (
        [ctypes.c_void_p, ctypes.c_int64]
        + [ctypes.c_void_p] * 6
        + [ctypes.c_int] * 6
        + [ctypes.c_float]
        + [ctypes.c_int] * 2
    )


_library = Library(SOURCE, _declare, "TANDEM_ATTENTION", "paged decode kernel")
available = _library.available


def entry() -> int:
    """The kernel's address, for C code that calls it (`tandem.kernels.decode_stack`)."""
    return ctypes.cast(_library.dll.paged_decode, ctypes.c_void_p).value


def supports(
    dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int
) -> bool:
    """Whether decode attention of this shape runs on the kernel here."""
    fits = heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
    return device.type == "cpu" and dtype in DTYPES and fits and available()


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedDecode,
    scale: float,
) -> None:
    """Write attention of ``batch``'s rows of q ([T, H, D]; its rows may be strided, as in a
    view of the fused qkv output) over their cached contexts (k/v_cache [slots, KV, D]) into
    the same rows of ``out`` ([T, H, D], contiguous)."""
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if q.stride(2) != 1 or q.stride(1) != dim:  # each token's heads one contiguous run
        q = q.contiguous()
    assert out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype
    rc = _library.dll.paged_decode(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        batch.rows.data_ptr(),
        batch.tables.data_ptr(),
        batch.lens.data_ptr(),
        len(batch.rows),
        batch.tables.shape[1],
        batch.block_size,
        heads,
        kv_heads,
        dim,
        scale,
        DTYPES[q.dtype],
        torch.get_num_threads(),
    )
    if rc:
        raise RuntimeError(
            f"paged decode kernel refused {heads} heads over {kv_heads} kv heads of size {dim}"
        )
