"""Paged attention paths against one causal attention over the whole sequence."""

import itertools
import random

import torch
import torch.nn.functional as F

from tandem.engine.model_runner import MAX_DECODE_GROUPS, group_by_length
from tandem.layers.attention import Attention, AttentionMetadata, DecodeGroup, PrefillSpan

H, KV, D, N = 4, 2, 8, 11


def _reference(q, k, v):
    rep = H // KV
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def test_prefill_then_context_span_then_decode_match_full_causal_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, h, D, generator=gen) for h in (H, KV, KV))
    expected = _reference(q, k, v)
    attn = Attention(H, KV, D, D**-0.5)
    attn.k_cache, attn.v_cache = torch.zeros(32, KV, D), torch.zeros(32, KV, D)
    slots = torch.tensor([17, 3, 9, 25, 0, 30, 11, 4, 8, 21, 2])  # a scattered block table
    # tokens 0..5 as a prefill, 6..8 as a span with cached context, 9 and 10 decoded one by one
    out = attn(q[:6], k[:6], v[:6], AttentionMetadata(slots[:6], [PrefillSpan(0, 6)]))
    assert torch.allclose(out, expected[:6], atol=1e-5)
    meta = AttentionMetadata(slots[6:9], [PrefillSpan(0, 3, context_slots=slots[:9])])
    assert torch.allclose(attn(q[6:9], k[6:9], v[6:9], meta), expected[6:9], atol=1e-5)
    for t in (9, 10):
        group = DecodeGroup(torch.tensor([0]), slots[: t + 1][None], None)
        meta = AttentionMetadata(slots[t : t + 1], [], [group])
        assert torch.allclose(
            attn(q[t : t + 1], k[t : t + 1], v[t : t + 1], meta), expected[t : t + 1], atol=1e-5
        )


def _cost(groups, lengths, overhead):
    return sum(len(g) * max(lengths[i] for i in g) + overhead for g in groups)


def test_decode_groups_are_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 400) for _ in range(rng.randint(1, 9))]
        groups = group_by_length(lengths, 50)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert len(groups) <= MAX_DECODE_GROUPS
        ranked = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = min(
            _cost(
                [ranked[a:b] for a, b in itertools.pairwise((0, *cuts, len(ranked)))], lengths, 50
            )
            for n_cuts in range(MAX_DECODE_GROUPS)
            for cuts in itertools.combinations(range(1, len(ranked)), n_cuts)
        )
        assert _cost(groups, lengths, 50) == best


def test_shared_prefix_group_matches_each_sequence_attending_alone():
    """Three samples share a 3-block prompt (blocks 5, 1, 7) and then hold their own blocks;
    grouped, each must see the prefix and its own tokens only."""
    from tandem.engine.model_runner import shared_prefix_groups
    from tandem.layers.attention import SharedPrefixGroup

    bs, gen = 4, torch.Generator().manual_seed(1)
    attn = Attention(H, KV, D, D**-0.5)
    attn.k_cache, attn.v_cache = torch.randn(64, KV, D, generator=gen), torch.randn(64, KV, D)
    tables = [[5, 1, 7, 2, 9], [5, 1, 7, 3], [5, 1, 7, 11, 12]]
    lengths = [18, 14, 20]
    decodes = [(row, n, t) for row, (n, t) in enumerate(zip(lengths, tables, strict=True))]
    decodes.append((3, 6, [4, 6]))  # an unrelated sequence
    groups, rest = shared_prefix_groups(decodes, bs)
    assert groups == [([0, 1, 2], 3)] and rest == [3]
    q = torch.randn(3, H, D, generator=gen)
    slot = [[t[p // bs] * bs + p % bs for p in range(n)] for n, t in zip(lengths, tables)]  # noqa: B905
    shared = slot[0][:12]
    keys = shared + [s for own in slot for s in own[12:]]
    mask = torch.zeros(3, len(keys), dtype=torch.bool)
    mask[:, :12] = True
    offset = 12
    for i, own in enumerate(slot):
        mask[i, offset : offset + len(own) - 12] = True
        offset += len(own) - 12
    group = SharedPrefixGroup(torch.arange(3), torch.tensor(keys), mask[None, None])
    out = attn(q, q[:, :KV], q[:, :KV], AttentionMetadata(None, [], [], [group]))
    for i in range(3):
        alone = DecodeGroup(torch.tensor([0]), torch.tensor([slot[i]]), None)
        expected = attn(q[i : i + 1], q[:1, :KV], q[:1, :KV], AttentionMetadata(None, [], [alone]))
        assert torch.allclose(out[i : i + 1], expected, atol=1e-5)
