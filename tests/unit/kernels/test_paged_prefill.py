"""tandem's C prefill kernels (tandem.kernels.paged_prefill: AMX in bfloat16 where the CPU grants
it, the vector kernel in float32 and bfloat16) against causal attention over each chunk's
context gathered by hand (float32 SDPA on the same inputs)."""

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.kernels import paged_prefill as pp
from tandem.layers import attention

DTYPES = [
    pytest.param(
        torch.float32,
        marks=pytest.mark.skipif(not pp.available(torch.float32), reason="no C compiler here"),
    ),
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(not pp.available(torch.bfloat16), reason="no C compiler here"),
    ),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

BS = 16


def _attention_layers(model) -> list[tuple]:
    """(causal, dtype, heads, KV heads, head size) of each of the model's attention layers."""
    dtype = next(model.parameters()).dtype
    return [
        (a.causal, dtype, a.num_heads, a.num_kv_heads, a.head_dim)
        for a in model.modules()
        if isinstance(a, attention.Attention)
    ]


def _case(heads, kv_heads, dim, chunks, seed=0, dtype=torch.bfloat16):
    """chunks: (query tokens, cached prefix) each; scattered block tables, one shared prefix
    block, chunks packed into a flat batch after two rows that are not prefills."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 96
    k = torch.randn(blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(blocks * BS, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    specs, row = [], 2
    for count, prefix in chunks:
        n = prefix + count
        specs.append((row, count, n, [order.pop() for _ in range(-(-n // BS))]))
        row += count
    if chunks[0][1] >= BS and chunks[1][1] >= BS:
        specs[1][3][0] = specs[0][3][0]  # a shared cached prompt block
    q = torch.randn(row + 3, heads, dim, generator=gen).to(dtype)
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, kv_heads, dim", [(8, 4, 64), (4, 4, 128), (16, 2, 64), (6, 2, 128)]
)
@pytest.mark.parametrize(
    "chunks, threads",
    [([(37, 0), (5, 0), (70, 0), (1, 3), (16, 0)], 2), ([(9, 40), (33, 17), (2, 100)], 3)],
)
def test_kernel_matches_causal_attention_over_the_gathered_context(
    dtype, heads, kv_heads, dim, chunks, threads
):
    """Fresh prompts (tails of every length against the 8- and 16-key tiles, chunks longer than
    a work item's queries: 32 on AMX, 8 in the vector kernel) and chunks after a cached prefix
    (a prefix-cache hit, a later chunk of a long prompt); in bfloat16 the output is rounded once
    (and, on AMX, the probabilities are rounded for their product)."""
    q, k, v, specs = _case(heads, kv_heads, dim, chunks, dtype=dtype)
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
            torch.testing.assert_close(
                out[row].float(), expected[row], atol=TOLERANCE[dtype], rtol=0
            )
        else:
            assert (out[row] == 7.0).all()  # rows that are not prefills are left alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_refuses_a_head_size_it_cannot_serve(dtype):
    q, k, v, specs = _case(4, 2, 64, [(3, 0), (4, 0)], dtype=dtype)
    out = torch.empty_like(q)
    q48, k48, v48, out48 = (x[..., :48].contiguous() for x in (q, k, v, out))
    with pytest.raises(RuntimeError, match="size 48"):
        pp.paged_prefill(q48, k48, v48, out48, pp.PagedPrefill.of(specs, BS), 1.0)
    assert not pp.supports(dtype, torch.device("cpu"), 4, 2, 48)
    assert not pp.supports(torch.float16, torch.device("cpu"), 4, 2, 64)
    assert pp.supports(dtype, torch.device("cpu"), 4, 2, 64)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_on_the_kernel_matches_the_torch_path(model_factory, monkeypatch, dtype):
    """Engine in float32 and bf16, heads of 64: fresh prompts, prompts chunked over steps (a
    chunk after its own cached part) and samples sharing a cached prompt, on the kernel, give
    the torch path's (``paged_kernels=False``) greedy tokens and log-probs within rounding
    (1e-4 in float32, bf16's in bf16), the torch path scoring each of the kernel's sequences
    (its decode path rounds bf16 differently too, so near-ties may pick other tokens in a run
    of its own); float32 leaves no near-ties: its own run gives the same tokens. The kernel
    serves the model's causal layers, and the kernel engine's prompt chunks ran on it."""
    path = model_factory("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    prompts = [[(7 * i + 3) % 500 + 1 for i in range(n)] for n in (9, 70, 2, 33)]
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    calls = []
    monkeypatch.setattr(
        attention, "paged_prefill", lambda *a: calls.append(1) or pp.paged_prefill(*a)
    )
    for on in (True, False):
        calls.clear()
        with LLM(
            str(path),
            dtype=str(dtype).removeprefix("torch."),
            enable_prefix_caching=True,
            max_num_batched_tokens=48,
            max_num_seqs=8,
            paged_kernels=on,
        ) as llm:
            # again: from the prefix cache
            outputs = llm.generate(prompts, params) + llm.generate(prompts, params)
            if on:
                kernel = outputs
                [layers] = llm.apply_model(_attention_layers)
                assert layers and all(causal for causal, *_ in layers)
                assert all(pp.supports(d, torch.device("cpu"), *heads) for _, d, *heads in layers)
            else:
                gathered = outputs
                # the torch path's log-probs along the kernel's sequences (teacher-forced)
                forced = [
                    llm.score([out.prompt_token_ids + c.token_ids for c in out.outputs])
                    for out in kernel
                ]
        assert bool(calls) == on  # the prompt chunks ran on the kernel, or none did
    for out, scored in zip(kernel, forced, strict=True):
        n = len(out.prompt_token_ids)
        for c, logp in zip(out.outputs, scored, strict=True):
            rows = logp[n - 1 : -1]
            picked = rows.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            assert (rows.max(dim=-1).values - picked).max().item() <= tol  # the best, or a tie
            assert (torch.tensor(c.logprobs) - picked).abs().max().item() <= tol
    if dtype == torch.float32:
        for a, b in zip(kernel, gathered, strict=True):
            for x, y in zip(a.outputs, b.outputs, strict=True):
                assert x.token_ids == y.token_ids
                gap = max(abs(p - r) for p, r in zip(x.logprobs, y.logprobs, strict=True))
                assert gap < tol
