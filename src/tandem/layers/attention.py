"""Attention over a packed (flat, unpadded) batch of sequences with a paged KV cache.

The batch is one flat run of tokens. Each layer writes the new keys/values into the cache at
``slot_mapping``; sequences with several query tokens (prefill) attend one by one, and all
single-token (decode) sequences attend in a few groups of similar context length, each through
one gather of their cached keys/values (grouping bounds the padding to the group's longest).
Decoding sequences whose contexts begin with the same cached blocks (a request's samples share
their prompt's) attend as one group that gathers the shared prefix once. Where tandem's C
kernel serves (`tandem.kernels.paged`: CPU, float32 or bfloat16), every decode sequence of the
step attends in one call that reads the paged cache in place instead (``paged``); where its
prefill kernels serve (`tandem.kernels.paged_prefill`: AMX in bfloat16, else vector code in
float32 and bfloat16; head sizes 64 and 128), so do every causal prompt chunk of the step
(``paged_prefill``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import pointwise
from tandem.kernels.paged import PagedDecode, paged_decode
from tandem.kernels.paged_prefill import PagedPrefill, paged_prefill


@dataclass(slots=True)
class PrefillSpan:
    """Query rows ``[start, end)`` of the flat batch, one sequence. ``context_slots`` is None
    when the span's own keys are its whole context; else the cache slots of the full context."""

    start: int
    end: int
    context_slots: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one query token each, attending together."""

    rows: torch.Tensor  # [B] their rows in the flat batch
    slots: torch.Tensor  # [B, L] cache slots of each context, padded to the longest
    mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is attended; None: no padding


@dataclass(slots=True)
class SharedPrefixGroup:
    """Sequences with one query token each whose contexts start with the same cached blocks
    (a request's samples, or requests with a cached prefix in common): their keys are gathered
    once, the shared prefix and then each member's own part, and a mask lets each member see
    the prefix and its own part only."""

    rows: torch.Tensor  # [B] their rows in the flat batch
    slots: torch.Tensor  # [L] cache slots: the shared prefix, then each member's own tokens
    mask: torch.Tensor  # [1, 1, B, L] True where a member attends


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [T] cache slot of each flat token; None: cache untouched
    prefills: list[PrefillSpan]
    decodes: list[DecodeGroup] = field(default_factory=list)
    shared_decodes: list[SharedPrefixGroup] = field(default_factory=list)
    paged: PagedDecode | None = None  # every decode sequence, for the in-place kernel
    paged_prefill: PagedPrefill | None = None  # every prompt chunk (then ``prefills`` is empty)
    # rows of the flat batch this layer's output keeps (None: all): attention runs on every
    # row (the cache needs every key and value) and returns these rows only, so the layer's
    # output projection and MLP skip the rest; `kept` selects them from the residual
    keep: torch.Tensor | None = None

    def kept(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.keep is None else x[self.keep]

    def decode_only(self, rows: int) -> bool:
        """Whether each of the step's ``rows`` rows is one decode token, every one attending
        through the paged kernel (``paged``), written to the cache and kept."""
        return (
            self.paged is not None
            and len(self.paged.rows) == rows
            and self.slot_mapping is not None
            and self.keep is None
            and self.paged_prefill is None
            and not (self.prefills or self.decodes or self.shared_decodes)
        )


class Attention(nn.Module):
    """``causal=False``: each sequence's tokens see all of it (encoders; prefill spans only)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: bool = True
    ):
        super().__init__()
        self.causal = causal
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # [slots, KV, D], bound by the model runner
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KV, D] -> [T, H, D] (the ``meta.keep`` rows where set)."""
        if self.k_cache is not None and meta.slot_mapping is not None:
            pointwise.scatter_rows(self.k_cache, meta.slot_mapping, k)
            pointwise.scatter_rows(self.v_cache, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for span in meta.prefills:
            qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
            if span.context_slots is None:
                ks, vs = k[span.start : span.end], v[span.start : span.end]
                ks, vs = ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]
                o = self._sdpa(qs, ks, vs, None, self.causal)
            else:
                ks = self.k_cache.index_select(0, span.context_slots).transpose(0, 1)[None]
                vs = self.v_cache.index_select(0, span.context_slots).transpose(0, 1)[None]
                n_q, n_ctx = qs.shape[2], ks.shape[2]
                q_pos = torch.arange(n_ctx - n_q, n_ctx, device=q.device)
                mask = torch.arange(n_ctx, device=q.device)[None, :] <= q_pos[:, None]
                o = self._sdpa(qs, ks, vs, mask, False)
            out[span.start : span.end] = o[0].transpose(0, 1)
        if meta.paged_prefill is not None:
            paged_prefill(q, self.k_cache, self.v_cache, out, meta.paged_prefill, self.scale)
        if meta.paged is not None:
            paged_decode(q, self.k_cache, self.v_cache, out, meta.paged, self.scale)
        for group in meta.decodes:
            qd = q[group.rows].unsqueeze(2)  # [B, H, 1, D]
            kd, vd = self._gather(self.k_cache, group), self._gather(self.v_cache, group)
            out[group.rows] = self._sdpa(qd, kd, vd, group.mask, False).squeeze(2)
        for group in meta.shared_decodes:
            qd = q[group.rows].transpose(0, 1)[None]  # [1, H, B, D]
            kd = self.k_cache.index_select(0, group.slots).transpose(0, 1)[None]  # [1, KV, L, D]
            vd = self.v_cache.index_select(0, group.slots).transpose(0, 1)[None]
            out[group.rows] = self._sdpa(qd, kd, vd, group.mask, False)[0].transpose(0, 1)
        return meta.kept(out)

    @staticmethod
    def _gather(cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """Decode contexts from the paged cache as [B, KV, L, D] (one flat index_select)."""
        b, length = group.slots.shape
        flat = cache.index_select(0, group.slots.view(-1))
        return flat.view(b, length, *cache.shape[1:]).transpose(1, 2)

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
