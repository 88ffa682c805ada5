"""tandem's C decode kernel (tandem.kernels.paged) against attention over each sequence's
context gathered by hand, and the engine on it against the engine on the torch path."""

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.kernels import paged
from tandem.layers import attention

pytestmark = pytest.mark.skipif(not paged.available(), reason="no C compiler here")

BS = 4


def _attention_shapes(model) -> set[tuple]:
    """(dtype, heads, KV heads, head size) of the model's attention layers."""
    dtype = next(model.parameters()).dtype
    return {
        (dtype, a.num_heads, a.num_kv_heads, a.head_dim)
        for a in model.modules()
        if isinstance(a, attention.Attention)
    }


def _case(dtype, heads, kv_heads, dim, lens, seed=0):
    """Random caches, scattered block tables (two sequences sharing their first block), rows
    out of order in a batch with rows that are not decodes, q a strided view."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 64
    k = torch.randn(blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables = []
    for n in lens:
        need = -(-n // BS)
        tables.append([order.pop() for _ in range(need)])
    tables[1][0] = tables[0][0]  # a shared prompt block
    rows = torch.randperm(len(lens) + 3, generator=gen)[: len(lens)].tolist()
    # q a view of a wider row (the fused qkv output): its tokens further apart than H * D
    fused = torch.randn(len(lens) + 3, heads * dim + 3 * dim, generator=gen).to(dtype)
    q = fused[:, dim : dim + heads * dim].view(-1, heads, dim)
    return q, k, v, [(r, n, t) for r, n, t in zip(rows, lens, tables, strict=True)]


def _expected(q, k, v, decodes, scale):
    out = {}
    for row, n, table in decodes:
        slots = torch.tensor([table[t // BS] * BS + t % BS for t in range(n)])
        ks, vs = k[slots].float().transpose(0, 1)[None], v[slots].float().transpose(0, 1)[None]
        qs = q[row].float()[None, :, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)
        out[row] = o[0, :, 0]
    return out


@pytest.mark.parametrize(
    "dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]
)  # bf16: the output is rounded once to bfloat16 (values below 4 in magnitude)
@pytest.mark.parametrize(
    "heads, kv_heads, dim",
    [(4, 2, 64), (6, 6, 128), (8, 1, 24), (16, 2, 128), (12, 3, 64), (24, 8, 64), (32, 2, 64)],
)  # 24/8: more than 16 query heads a sequence, the 17th sharing its kv head with the 16th
@pytest.mark.parametrize("lens, threads", [([5, 8, 1, 13, 4, 30], 2), ([17, 30], 3)])
def test_kernel_matches_attention_over_the_gathered_context(
    dtype, atol, heads, kv_heads, dim, lens, threads
):
    """Six sequences run with all of a sequence's kv heads on one thread; two on three
    threads split each sequence's kv heads into slices."""
    q, k, v, decodes = _case(dtype, heads, kv_heads, dim, lens)
    out = torch.full_like(q, 7.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged.paged_decode(q, k, v, out, paged.PagedDecode.of(decodes, BS), dim**-0.5)
    finally:
        torch.set_num_threads(before)
    expected = _expected(q, k, v, decodes, dim**-0.5)
    for row in range(len(q)):
        if row in expected:
            torch.testing.assert_close(out[row].float(), expected[row], atol=atol, rtol=0)
        else:
            assert (out[row] == 7.0).all()  # rows that are not decodes are left alone


def test_loading_the_kernel_keeps_subnormal_floats():
    """Built with -ffast-math but linked without it: no flush-to-zero set for the process
    (hypothesis, numpy and torch all see subnormals)."""
    assert paged.available()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() > 0
    assert float.fromhex("0x1p-1070") * 1.0 > 0


def test_kernel_reads_the_block_table_not_the_slot_order():
    """A wrong slot (the table of another sequence) shows: the check can fail."""
    q, k, v, decodes = _case(torch.float32, 4, 2, 64, [9, 9, 9])
    out = torch.zeros_like(q)
    swapped = [(decodes[0][0], 9, decodes[2][2])] + decodes[1:]
    paged.paged_decode(q, k, v, out, paged.PagedDecode.of(swapped, BS), 0.125)
    expected = _expected(q, k, v, decodes, 0.125)
    assert not torch.allclose(out[decodes[0][0]], expected[decodes[0][0]], atol=1e-3)


def test_refuses_a_head_grouping_it_cannot_serve():
    q, k, v, decodes = _case(torch.float32, 4, 2, 64, [3, 3])
    with pytest.raises(RuntimeError, match="refused"):
        paged.paged_decode(
            q,
            k[:, :1].expand(-1, 3, -1).contiguous(),
            v[:, :1].expand(-1, 3, -1).contiguous(),
            torch.zeros_like(q),
            paged.PagedDecode.of(decodes, BS),
            1.0,
        )
    assert not paged.supports(torch.float32, torch.device("cpu"), 130, 2, 64)
    assert not paged.supports(torch.float32, torch.device("cpu"), 4, 2, 2048)
    assert not paged.supports(torch.float16, torch.device("cpu"), 4, 2, 64)


@pytest.mark.timeout(300)
def test_engine_on_the_kernel_matches_the_torch_path(model_factory, monkeypatch):
    """Greedy tokens and their log-probs, with samples sharing a prompt (the prefix cache) and
    requests of different lengths, equal the gather path's (``paged_kernels=False``); the
    kernel serves the model's head shape and the first engine's decode steps ran on it."""
    path = model_factory("llama")
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6], [11, 12], [3] * 21]
    params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    calls = []
    monkeypatch.setattr(
        attention, "paged_decode", lambda *a: calls.append(1) or paged.paged_decode(*a)
    )
    results = []
    for on in (True, False):
        calls.clear()
        with LLM(
            str(path), dtype="float32", block_size=4, enable_prefix_caching=True, paged_kernels=on
        ) as llm:
            if on:
                [shapes] = llm.apply_model(_attention_shapes)
                assert shapes and all(
                    paged.supports(dtype, torch.device("cpu"), *heads) for dtype, *heads in shapes
                )
            results.append(llm.generate(prompts, params))
        assert bool(calls) == on  # the decode steps ran on the kernel, or none did
    for a, b in zip(*results, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert len(x.logprobs) == 12
            assert max(abs(p - r) for p, r in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
