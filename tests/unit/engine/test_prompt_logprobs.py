"""Prompt scoring (`SamplingParams(prompt_logprobs=k)`): every prompt token's log-prob given the
ones before it, checked against transformers' own forward, across prefill chunks, tensor and
pipeline parallel ranks, preemption and shared samples."""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)


def _prompts(vocab: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _reference(ref, ids: list[int], k: int):
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    scores = [None] + [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]
    tops = [None] + [
        dict(zip(*(t.tolist() for t in reversed(lp[p - 1].topk(k))), strict=True))
        for p in range(1, len(ids))
    ]
    return scores, tops


def _check(out, ref, k: int, tol: float = 1e-4) -> None:
    want, want_top = _reference(ref, out.prompt_token_ids, k)
    got = out.prompt_logprobs
    assert len(got) == len(want) and got[0] is None and out.prompt_top_logprobs[0] is None
    assert got[1:] == pytest.approx(want[1:], abs=tol, rel=0)
    for g, w in zip(out.prompt_top_logprobs[1:], want_top[1:], strict=True):
        assert list(g) == list(w)  # same tokens in the same order
        assert [g[t] for t in w] == pytest.approx(list(w.values()), abs=tol, rel=0)


@pytest.fixture(scope="module")
def model(model_factory):
    path = model_factory("llama")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ref


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_equal_transformers_whole_and_chunked(model, chunk):
    path, ref = model
    options = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_num_seqs": 2}
    with LLM(path, **options) as llm:
        prompts = _prompts(llm.engine.spec.vocab_size, [1, 2, 9, 30])
        params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3, logprobs=0)
        outs = llm.generate(prompts, params)
        for out in outs:
            _check(out, ref, 3)
            assert len(out.outputs[0].token_ids) == 3
        # a cached prefix is not reused for a scored prompt: scores are complete the 2nd time
        _check(llm.generate(prompts[3:], params)[0], ref, 3)


def test_max_tokens_zero_scores_the_prompt_only(model):
    path, ref = model
    with LLM(path) as llm:
        prompts = _prompts(llm.engine.spec.vocab_size, [12, 5])
        outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))
        for out in outs:
            assert [c.token_ids for c in out.outputs] == [[], []]
            assert {c.finish_reason for c in out.outputs} == {"length"}
            assert out.prompt_top_logprobs is None
            want, _ = _reference(ref, out.prompt_token_ids, 1)
            assert out.prompt_logprobs[0] is None
            assert out.prompt_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
        with pytest.raises(ValueError, match="max_tokens=0 needs prompt_logprobs"):
            SamplingParams(max_tokens=0)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_prompt_logprobs_under_tensor_and_pipeline_parallel(model, tp, pp):
    path, ref = model
    with LLM(
        path,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    ) as llm:
        prompts = _prompts(llm.engine.spec.vocab_size, [3, 21, 40])
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=2))
        for out in outs:
            _check(out, ref, 2)


def _bytes_for_blocks(path: str, num_blocks: int, block_size: int) -> int:
    config = transformers.AutoConfig.from_pretrained(path)
    head_dim = config.hidden_size // config.num_attention_heads
    per_block = 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * head_dim
    return per_block * 4 * num_blocks


@pytest.mark.parametrize(
    "hog_prompt,blocks,scored_before",
    [(23, 14, 7), (22, 14, 14), (23, 15, 30)],
    ids=["after-1-chunk", "after-2-chunks", "while-decoding"],
)
def test_a_scored_prompt_preempted_midway_keeps_exact_scores(
    model, hog_prompt, blocks, scored_before
):
    """A running request needs a KV block while a 30-token scored prompt is being prefilled
    in 7-token chunks (or is decoding): the scored one, the newest, is preempted with part of
    its prompt scored, recomputes from scratch, and its scores and tokens equal transformers'
    and an unpreempted run's."""
    path, ref = model
    bs = 4
    options = dict(
        block_size=bs,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        kv_cache_memory=_bytes_for_blocks(path, blocks, bs),
    )
    scored_params = SamplingParams(
        max_tokens=2, temperature=0, prompt_logprobs=3, logprobs=0, ignore_eos=True
    )
    with LLM(path, **options) as llm:
        engine = llm.engine
        hog_ids, scored_ids = _prompts(engine.spec.vocab_size, [hog_prompt, 30])
        hog_params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        hog = engine.admission.make_sequences("hog", hog_ids, hog_params)
        engine.add(hog)
        while hog[0].num_output_tokens == 0:
            engine.step()
        scored = engine.admission.make_sequences("scored", scored_ids, scored_params)
        engine.add(scored)
        preempted_at = []
        while engine.has_unfinished():
            engine.step()
            if scored[0].preempted:
                preempted_at.append(len(scored[0].prompt_logprobs))
    assert sorted(set(preempted_at)) == [scored_before]
    want, want_top = _reference(ref, scored_ids, 3)
    assert scored[0].prompt_logprobs[0] is None and len(scored[0].prompt_logprobs) == 30
    assert scored[0].prompt_logprobs[1:] == pytest.approx(want[1:], abs=1e-4, rel=0)
    for got, expected in zip(scored[0].prompt_top_logprobs[1:], want_top[1:], strict=True):
        assert list(got) == list(expected)
    with LLM(path) as alone:
        unpressed = alone.generate([scored_ids], scored_params)[0].outputs[0]
    assert scored[0].output_token_ids == unpressed.token_ids
    assert scored[0].logprobs == pytest.approx(unpressed.logprobs, abs=1e-5, rel=0)
