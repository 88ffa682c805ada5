"""Paged KV cache: fixed-size blocks, a block table per sequence, a byte budget."""

from __future__ import annotations

from collections import deque

import torch

from tandem.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns which cache blocks are free; pairs every check with its action."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("kv_cache_memory leaves room for no KV block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _missing(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` tokens in total."""
        return self._missing(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        missing = self._missing(seq, num_tokens)
        assert missing <= len(self._free), "grow() without can_grow()"
        seq.block_table.extend(self._free.popleft() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        assert len(self._free) <= self.num_blocks, "a block was freed twice"
        seq.block_table = []
        seq.num_cached_tokens = 0


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def budget_bytes(kv_cache_memory: int | float, device: torch.device) -> int:
    """An absolute byte count, or a fraction of the device's currently free memory."""
    if isinstance(kv_cache_memory, int):
        return kv_cache_memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * kv_cache_memory)
