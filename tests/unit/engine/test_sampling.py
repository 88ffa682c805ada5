"""Sampling behaviour of the offline engine on a tiny Llama (no reference model needed)."""

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.layers.attention import Attention


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir) as engine:
        yield engine


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=123, ignore_eos=True)
    alone = llm.generate("The quick dog", params)[0].outputs[0].token_ids
    again = llm.generate("The quick dog", params)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=30, temperature=0.9)
    batch = llm.generate(["A red bird", "The quick dog", "12 + 7 ="], [others, params, others])
    assert alone == again == batch[1].outputs[0].token_ids
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, seed=124, ignore_eos=True)
    assert llm.generate("The quick dog", other_seed)[0].outputs[0].token_ids != alone


def test_greedy_is_batch_invariant(llm):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = llm.generate("Every policy learns", params)[0].outputs[0].token_ids
    prompts = [f"Prompt number {i} with some words" * (1 + i % 3) for i in range(31)]
    batch = llm.generate(prompts[:15] + ["Every policy learns"] + prompts[15:], params)
    assert batch[15].outputs[0].token_ids == alone


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate("The quick dog", SamplingParams(max_tokens=16, temperature=0.0))
    top_k = llm.generate("The quick dog", SamplingParams(max_tokens=16, top_k=1, seed=1))
    top_p = llm.generate("The quick dog", SamplingParams(max_tokens=16, top_p=1e-6, seed=2))
    assert _tokens(greedy) == _tokens(top_k) == _tokens(top_p)


def test_top_k_limits_choices_and_processed_logprobs_follow_temperature(llm):
    prompt = llm.tokenizer.encode("The quick dog")
    params = SamplingParams(
        max_tokens=10, temperature=0.5, top_k=5, seed=3, logprobs=0, logprobs_mode="processed"
    )
    out = llm.generate([prompt], params)[0].outputs[0]
    logits = llm.score([prompt + out.token_ids], logprobs=False)[0][len(prompt) - 1 : -1]
    for step, token in enumerate(out.token_ids):
        top5 = (logits[step] / 0.5).topk(5)
        assert token in top5.indices.tolist()
        expected = torch.log_softmax(top5.values, dim=-1)[top5.indices.tolist().index(token)]
        assert abs(out.logprobs[step] - expected.item()) <= 1e-4
    raw = llm.generate([prompt], SamplingParams(**{**params.__dict__, "logprobs_mode": "raw"}))
    raw_out = raw[0].outputs[0]
    assert raw_out.token_ids == out.token_ids
    expected_raw = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])
    assert torch.allclose(torch.tensor(raw_out.logprobs), expected_raw.squeeze(1), atol=1e-4)


def test_top_logprobs_are_sorted_and_include_the_greedy_token(llm):
    out = llm.generate("A red bird", SamplingParams(max_tokens=5, temperature=0, logprobs=3))
    c = out[0].outputs[0]
    assert len(c.top_logprobs) == 5
    for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
        values = list(top.values())
        assert values == sorted(values, reverse=True) and len(top) == 3
        assert top[token] == pytest.approx(lp) and lp == pytest.approx(values[0])


def test_stop_string_cuts_text(llm):
    base = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    text = base[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text[: text.find(stop)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[stop, "@@@@"])
    out = llm.generate("Hello", params)[0].outputs[0]
    assert out.text == cut
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = SamplingParams(**{**params.__dict__, "include_stop_str_in_output": True})
    assert llm.generate("Hello", kept)[0].outputs[0].text == cut + stop


def test_stop_token_ids_max_tokens_and_eos(llm):
    base = llm.generate("Hello", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    ids = base[0].outputs[0].token_ids
    assert len(ids) == 20 and base[0].outputs[0].finish_reason == "length"
    stop_id = ids[5]
    out = llm.generate(
        "Hello", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == ids[: ids.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # Declare the 4th greedy token the model's EOS: generation stops there unless ignore_eos.
    outputs = llm.engine.outputs
    eos, outputs.eos_token_ids = outputs.eos_token_ids, {ids[3]}
    try:
        eos_out = llm.generate("Hello", SamplingParams(max_tokens=20, temperature=0))[0].outputs[0]
        assert eos_out.token_ids == ids[: ids.index(ids[3]) + 1]
        assert eos_out.finish_reason == "stop" and eos_out.stop_reason is None
        assert eos_out.text == llm.tokenizer.decode(eos_out.token_ids)
    finally:
        outputs.eos_token_ids = eos


def test_n_samples_differ_and_prompt_order_is_kept(llm):
    out = llm.generate(
        ["First", "Second"], SamplingParams(n=3, max_tokens=12, seed=5, ignore_eos=True)
    )
    assert [o.prompt for o in out] == ["First", "Second"]
    samples = [c.token_ids for c in out[0].outputs]
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(s) for s in samples}) == 3


def test_preemption_when_kv_cache_is_small_gives_identical_outputs(llama_dir, llm):
    prompts = [f"Request {i}: the model reads many words" for i in range(12)]
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True)
    expected = _tokens(llm.generate(prompts, params))
    block_size = llm.engine.config.cache.block_size
    [layers] = llm.apply_model(lambda m: [a for a in m.modules() if isinstance(a, Attention)])
    block_bytes = sum(2 * block_size * a.num_kv_heads * a.head_dim * 4 for a in layers)  # K, V
    with LLM(llama_dir, kv_cache_memory=12 * block_bytes) as small:
        got = _tokens(small.generate(prompts, params))
        stats = small.engine.stats()
        assert stats.num_preemptions > 0
        assert stats.kv_blocks_used == 0 and stats.kv_blocks_total > 0
    assert got == expected


def test_prompts_as_strings_and_token_ids_agree(llm):
    ids = llm.tokenizer.encode("The quick dog")
    params = SamplingParams(max_tokens=8, temperature=0)
    from_text, from_ids = llm.generate(["The quick dog", ids], params)
    assert from_text.prompt_token_ids == ids and from_ids.prompt is None
    assert from_text.outputs[0].token_ids == from_ids.outputs[0].token_ids
    assert from_text.weight_version == 0 and llm.weight_version == 0


def _batch(rows, temperature=1.0, top_k=None, generators=None):
    from tandem.layers.sampler import SamplingBatch

    big = torch.iinfo(torch.long).max
    return SamplingBatch(
        temperatures=torch.full((rows,), temperature),
        top_k=torch.full((rows,), big if top_k is None else top_k, dtype=torch.long),
        top_p=torch.ones(rows),
        generators=generators or [None] * rows,
        processed_logprobs=torch.zeros(rows, dtype=torch.bool),
    )


@pytest.mark.parametrize("inference", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampler_draws_from_the_softmax_of_the_scaled_logits(temperature, inference):
    """20,000 draws of one row over 6 tokens: each token's frequency within 4 standard
    errors of softmax(logits / T); top_k=3 never draws the three least likely tokens. In
    inference mode an unfiltered batch takes the one-pass kernel (pointwise.sample), outside
    it torch's ops."""
    from tandem.layers.sampler import Sampler

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    rows = 20_000
    sampler = Sampler(torch.Generator().manual_seed(0))
    with torch.inference_mode(inference):
        out = sampler(logits.expand(rows, -1), _batch(rows, temperature))
    freq = torch.bincount(out.token_ids, minlength=6).double() / rows
    p = torch.softmax(logits[0].double() / temperature, -1)
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / rows).sqrt() + 1e-4).all(), (freq, p)
    raw = torch.log_softmax(logits[0], -1)
    torch.testing.assert_close(out.logprobs, raw[out.token_ids])  # raw logprobs
    top3 = sampler(logits.expand(rows, -1), _batch(rows, temperature, top_k=3))
    assert set(top3.token_ids.tolist()) == {0, 1, 2}


def test_sampler_seeded_rows_follow_their_own_stream():
    from tandem.layers.sampler import Sampler

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))

    def draw(shared_seed):
        gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(7), None]
        sampler = Sampler(torch.Generator().manual_seed(shared_seed))
        return [sampler(logits, _batch(4, generators=gens)).token_ids.tolist() for _ in range(20)]

    a, b = draw(0), draw(1)
    assert [r[0] for r in a] == [r[0] for r in b]  # seeded row: its stream only
    assert [r[2] for r in a] == [r[2] for r in b]
    assert [r[1] for r in a] != [r[1] for r in b]  # shared stream moved with its seed


def test_greedy_rows_take_the_first_maximum_and_its_log_softmax():
    """All-greedy batches run one kernel pass (tandem.kernels.pointwise.greedy): the same
    tokens as torch.argmax (the first of tied maxima) and log_softmax's value there; a batch
    asking for top logprobs, or outside inference, takes torch's path with the same answer."""
    from tandem.layers.sampler import Sampler

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(37, 8192, generator=gen) * 4
    logits[3, [10, 500, 8000]] = logits[3].max() + 1.0  # a tie: the first index wins
    logits[5, -1] = logits[5].max() + 1.0  # the maximum in the last column
    expected_tokens = logits.argmax(-1)
    expected = torch.log_softmax(logits, -1).gather(1, expected_tokens[:, None]).squeeze(1)
    assert expected_tokens[3] == 10 and expected_tokens[5] == 8191
    sampler = Sampler(torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = sampler(logits, _batch(37, temperature=0.0))
    assert torch.equal(out.token_ids, expected_tokens)
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-5)
    batch = _batch(37, temperature=0.0)
    batch.num_top_logprobs = 2
    with torch.inference_mode():
        top = sampler(logits, batch)
    assert torch.equal(top.token_ids, expected_tokens)
    torch.testing.assert_close(top.logprobs, out.logprobs, rtol=0, atol=1e-5)


def test_the_sampling_kernel_picks_what_the_cdf_inversion_picks():
    """The kernel path (inference mode, no top-k/top-p) and torch's ops draw the same uniform
    per row and invert the same CDF: the same tokens, and log-probs within float32 rounding,
    raw or processed, on a batch mixing greedy, temperature 1 and 0.7 rows and seeded rows,
    over a 49k vocabulary."""
    from tandem.layers.sampler import Sampler

    rows, vocab = 48, 49152
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 3
    batch = _batch(rows)
    batch.temperatures = torch.tensor([0.0, 1.0, 0.7] * (rows // 3))
    batch.processed_logprobs = torch.arange(rows) % 2 == 0
    picks = {}
    for inference in (True, False):
        batch.generators = [
            torch.Generator().manual_seed(r) if r % 4 == 1 else None for r in range(rows)
        ]
        with torch.inference_mode(inference):
            picks[inference] = Sampler(torch.Generator().manual_seed(9))(logits, batch)
    kernel, ops = picks[True], picks[False]
    assert torch.equal(kernel.token_ids, ops.token_ids)
    torch.testing.assert_close(kernel.logprobs, ops.logprobs, rtol=0, atol=2e-5)
    greedy = batch.temperatures == 0
    assert torch.equal(kernel.token_ids[greedy], logits[greedy].argmax(-1))
    assert not torch.equal(kernel.token_ids[~greedy], logits[~greedy].argmax(-1))
