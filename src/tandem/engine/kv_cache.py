"""Paged KV cache bookkeeping: fixed-size blocks, a block table per sequence, shared blocks.

Blocks are reference counted. Two things share them:

- **Forked samples.** The ``n`` samples of one request share the prompt's blocks (`fork`); the
  last, partly filled block is copied when a sample first writes into it (`grow` returns the
  copies the model ranks must make before the step runs).
- **Prefix caching.** A full block whose keys/values are computed is registered under a digest
  of its tokens and of every token before it: SHA-256 over the previous block's digest and the
  block's token ids, so two different prefixes never share a key in practice (a 64-bit hash
  would let a collision serve another prompt's keys/values silently). A new sequence starts
  from the longest run of cached blocks matching its tokens (`allocate`). Blocks nobody holds
  stay cached until their memory is needed: the free list is in eviction order, least recently
  released first, and a block taken from it loses its digest.

Cached keys/values were computed by some weights: `reset_prefix_cache` (called on every weight
push) forgets every digest and starts a new epoch, and a sequence admitted in an older epoch never
registers blocks, so a cached block never serves tokens under newer weights. A sequence that
runs with a LoRA adapter starts its chain from the adapter version's key (`Sequence.lora_key`):
two adapters, or two versions of one, never share a block.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tandem.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_digest(parent: bytes, tokens) -> bytes:
    """The prefix-cache key of a full block: SHA-256 of its parent's digest (for the first
    block, ``b""`` or its LoRA adapter version's key) and its token ids as little-endian int64."""
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


@dataclass(slots=True)
class _Block:
    ref_count: int = 0
    digest: bytes | None = None  # set while registered in the prefix cache


class _Blocks(dict):
    """Block id -> its `_Block`, made on first use: an engine's cache may hold hundreds of
    thousands of blocks (a small model in a default-sized cache) and a request touches few."""

    def __missing__(self, block_id: int) -> _Block:
        block = self[block_id] = _Block()
        return block


@dataclass(slots=True)
class CacheStats:
    """Prompt tokens asked for at admission, and how many came from shared or cached blocks."""

    queried_tokens: int = 0
    hit_tokens: int = 0


class BlockManager:
    """Owns the KV blocks; pairs every check with its action and asserts reference counts."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("kv_cache_memory leaves room for no KV block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = _Blocks()
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # digest -> block id
        self.epoch = 0  # bumped by reset_prefix_cache
        self.stats = CacheStats()

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    # ----- admission: a sequence without blocks -----
    def can_allocate(self, seq: Sequence) -> bool:
        return self._fits(seq, self._match(seq))

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, starting from its longest cached prefix
        (those tokens count as computed)."""
        assert not seq.block_table, "allocate() on a sequence that holds blocks"
        hits = self._match(seq)
        assert self._fits(seq, hits), "allocate() without can_allocate()"
        for block_id in hits:
            self._take(block_id)
        seq.block_table = hits
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        seq.cache_epoch = self.epoch
        seq.table_changed = True
        self.stats.queried_tokens += len(seq)
        self.stats.hit_tokens += seq.num_cached_tokens
        self._extend(seq, blocks_for(len(seq), self.block_size) - len(hits))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (another sample of the same prompt) shares all of ``parent``'s blocks and
        computed tokens."""
        assert not child.block_table, "fork() into a sequence that holds blocks"
        for block_id in parent.block_table:
            self._blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_cached_tokens = len(child)
        child.num_registered_blocks = parent.num_registered_blocks
        child.cache_epoch = parent.cache_epoch
        child.table_changed = True
        self.stats.queried_tokens += len(child)
        self.stats.hit_tokens += len(child)

    # ----- a running sequence's next tokens -----
    def grow(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Take the blocks ``seq`` lacks to hold all its tokens and write its uncomputed ones; a
        shared block its next tokens write into is copied first. Returns the (source,
        destination) block copies the ranks make before the step, or None, taking nothing,
        when the free blocks do not cover it (one pass over the sequence's blocks: this runs
        for every running sequence every step)."""
        shared = self._shared_writes(seq)
        missing = self._missing(seq)
        if missing + len(shared) > len(self._free):
            return None
        copies = []
        for index in shared:
            old = seq.block_table[index]
            self._blocks[old].ref_count -= 1
            new = self._pop_free()
            seq.block_table[index] = new
            seq.table_changed = True
            copies.append((old, new))
        self._extend(seq, missing)
        return copies

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (last block first, so a prompt's head stays cached longest)."""
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} was freed twice"
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.digest is None:  # nothing to reuse: evict it first
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_registered_blocks = 0
        seq.table_changed = True

    # ----- prefix cache -----
    def register(self, seq: Sequence) -> None:
        """Enter ``seq``'s full, computed blocks into the prefix cache (after a step landed)."""
        if not self.enable_prefix_caching or seq.cache_epoch != self.epoch:
            return
        full = min(seq.num_cached_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        digests = self._digests(seq, full)
        for index in range(seq.num_registered_blocks, full):
            block = self._blocks[seq.block_table[index]]
            if block.digest is None and digests[index] not in self._cached:
                block.digest = digests[index]
                self._cached[block.digest] = seq.block_table[index]
        seq.num_registered_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their keys/values belong to older weights)."""
        for block_id in self._cached.values():
            block = self._blocks[block_id]
            block.digest = None
            if block.ref_count == 0:
                self._free.move_to_end(block_id, last=False)
        self._cached.clear()
        self.epoch += 1

    # ----- private helpers -----
    def _fits(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether free blocks cover ``seq``'s tokens beyond ``hits`` (cached hits nobody
        holds leave the free list too)."""
        taken_from_free = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        missing = blocks_for(len(seq), self.block_size) - len(hits)
        return missing + taken_from_free <= len(self._free)

    def _match(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s longest cached prefix; at least one token is left to
        compute (its logits sample the next token). None for a prompt being scored: every
        position's logits are needed."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        limit = (len(seq) - 1) // self.block_size
        hits = []
        for digest in self._digests(seq, limit):
            block_id = self._cached.get(digest)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _digests(self, seq: Sequence, count: int) -> list[bytes]:
        """Chained digests of ``seq``'s first ``count`` full blocks (kept on the sequence)."""
        digests, bs = seq.block_digests, self.block_size
        while len(digests) < count:
            i = len(digests)
            parent = digests[-1] if digests else seq.lora_key  # adapters cache apart
            digests.append(block_digest(parent, seq.token_ids[i * bs : i * bs + bs]))
        return digests

    def _missing(self, seq: Sequence) -> int:
        return max(0, blocks_for(len(seq), self.block_size) - len(seq.block_table))

    def _shared_writes(self, seq: Sequence) -> list[int]:
        """Indices of held blocks that this step's tokens write into and others hold too."""
        first = seq.num_cached_tokens // self.block_size
        last = min(len(seq.block_table), blocks_for(len(seq), self.block_size))
        return [i for i in range(first, last) if self._blocks[seq.block_table[i]].ref_count > 1]

    def _extend(self, seq: Sequence, count: int) -> None:
        """Append ``count`` blocks from the free list (eviction order) to ``seq``'s table, in
        ascending ids: the free list holds a released sequence's blocks in descending runs
        (last block first), and attention reads a context's rows front to back, where the
        CPU's prefetchers follow from one block into the next only if it is the adjacent one
        after it (docs/benchmarks.md, "Decode attention in row order")."""
        if count > 0:
            seq.block_table.extend(sorted(self._pop_free() for _ in range(count)))

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} is referenced"
        if block.digest is not None:  # evicted from the prefix cache
            del self._cached[block.digest]
            block.digest = None
        block.ref_count = 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1


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
