"""tandem's C bf16 prefill kernel (tandem.kernels.paged_prefill) against causal attention over
each chunk's context gathered by hand (float32 SDPA on the same bf16 inputs)."""

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.kernels import paged_prefill as pp

pytestmark = pytest.mark.skipif(
    not pp.available(), reason="no C compiler here, or no AMX-BF16 on this CPU"
)

BS = 16


def _case(heads, kv_heads, dim, chunks, seed=0):
    """chunks: (query tokens, cached prefix) each; scattered block tables, one shared prefix
    block, chunks packed into a flat batch after two rows that are not prefills."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 96
    k = torch.randn(blocks * BS, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(blocks * BS, kv_heads, dim, generator=gen).bfloat16()
    order = torch.randperm(blocks, generator=gen).tolist()
    specs, row = [], 2
    for count, prefix in chunks:
        n = prefix + count
        specs.append((row, count, n, [order.pop() for _ in range(-(-n // BS))]))
        row += count
    if chunks[0][1] >= BS and chunks[1][1] >= BS:
        specs[1][3][0] = specs[0][3][0]  # a shared cached prompt block
    q = torch.randn(row + 3, heads, dim, generator=gen).bfloat16()
    return q, k, v, specs


def _expected(q, k, v, specs, scale):
    out = {}
    for row, count, n, table in specs:
        slots = torch.tensor([table[t // BS] * BS + t % BS for t in range(n)])
        ks = k[slots].float().transpose(0, 1)[None]
        vs = v[slots].float().transpose(0, 1)[None]
        qs = q[row : row + count].float().transpose(0, 1)[None]
        mask = torch.arange(n)[None, :] <= torch.arange(n - count, n)[:, None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        for i in range(count):
            out[row + i] = o[0, :, i]
    return out


@pytest.mark.parametrize(
    "heads, kv_heads, dim", [(8, 4, 64), (4, 4, 128), (16, 2, 64), (6, 2, 128)]
)
@pytest.mark.parametrize(
    "chunks, threads",
    [([(37, 0), (5, 0), (70, 0), (1, 3), (16, 0)], 2), ([(9, 40), (33, 17), (2, 100)], 3)],
)
def test_kernel_matches_causal_attention_over_the_gathered_context(
    heads, kv_heads, dim, chunks, threads
):
    """Fresh prompts (tails of every length against the 16-key tiles, a chunk longer than a work
    item's 32 queries) and chunks after a cached prefix (a prefix-cache hit, a later chunk of a
    long prompt); the output is rounded once to bfloat16 and products of bf16 probabilities."""
    q, k, v, specs = _case(heads, kv_heads, dim, chunks)
    out = torch.full_like(q, 7.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pp.paged_prefill(q, k, v, out, pp.PagedPrefill.of(specs, BS), dim**-0.5)
    finally:
        torch.set_num_threads(before)
    expected = _expected(q, k, v, specs, dim**-0.5)
    for row in range(len(q)):
        if row in expected:
            torch.testing.assert_close(out[row].float(), expected[row], atol=2e-2, rtol=0)
        else:
            assert (out[row] == 7.0).all()  # rows that are not prefills are left alone


def test_refuses_a_head_size_it_cannot_serve():
    q, k, v, specs = _case(4, 2, 64, [(3, 0), (4, 0)])
    out = torch.empty_like(q)
    q48, k48, v48, out48 = (x[..., :48].contiguous() for x in (q, k, v, out))
    with pytest.raises(RuntimeError, match="size 48"):
        pp.paged_prefill(q48, k48, v48, out48, pp.PagedPrefill.of(specs, BS), 1.0)
    assert not pp.supports(torch.bfloat16, torch.device("cpu"), 4, 2, 48)
    assert not pp.supports(torch.float32, torch.device("cpu"), 4, 2, 64)


@pytest.mark.timeout(300)
def test_engine_on_the_kernel_matches_the_torch_path(model_factory):
    """bf16 engine, heads of 64: fresh prompts, prompts chunked over steps (a chunk after its
    own cached part) and samples sharing a cached prompt give the torch path's greedy tokens,
    log-probs within bf16 rounding."""
    path = model_factory("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(n)] for n in (9, 70, 2, 33)]
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    results = []
    with LLM(
        str(path),
        dtype="bfloat16",
        enable_prefix_caching=True,
        max_num_batched_tokens=48,
        max_num_seqs=8,
    ) as llm:
        runner = llm.engine.executor.runner
        assert runner.paged_prefill
        for on in (True, False):
            runner.paged_prefill = on
            results.append(llm.generate(prompts, params))
            results.append(llm.generate(prompts, params))  # again: from the prefix cache
    for a, b in zip(results[0] + results[1], results[2] + results[3], strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert max(abs(p - r) for p, r in zip(x.logprobs, y.logprobs, strict=True)) < 5e-2
