"""The last decoder layer past attention runs on the rows a step samples from only
(`AttentionMetadata.keep`, set by the model runner for models that declare ``keeps_rows``)."""

import pytest

from tandem import LLM, SamplingParams


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt2"])
def test_last_layer_runs_on_sampled_rows_with_the_same_tokens(model_factory, family):
    """Prompts chunked over steps (a chunk samples nothing; the next one its last row), samples
    sharing a prompt: the trimmed engine gives the untrimmed one's tokens and log-probs, and
    the last layer's MLP saw at most one row per sequence in every step (one, unread, in the
    step that samples nothing) while the first layer's saw every row."""
    path = model_factory(family)
    prompts = [[(5 * i + 1) % 200 + 3 for i in range(n)] for n in (40, 3, 17)]
    params = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    results, seen = [], {}
    with LLM(path, max_num_batched_tokens=32, max_num_seqs=8, dtype="float32") as llm:
        [model] = llm.apply_model(lambda m: m)  # the served model, to hook its layers
        assert model.keeps_rows
        layers = [
            m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))
        ]
        mlps = {"first": layers[0].mlp, "last": layers[-1].mlp}
        for name, mlp in mlps.items():
            mlp.register_forward_hook(
                lambda _m, args, _out, name=name: seen[name].append(args[0].shape[0])
            )
        for trim in (True, False):
            seen.update(first=[], last=[])
            llm.apply_model(lambda m, trim=trim: setattr(m, "keeps_rows", trim))
            results.append(llm.generate(prompts, params))
            if trim:
                rows_trimmed = (list(seen["first"]), list(seen["last"]))
    first, last = rows_trimmed
    assert sum(first) > sum(last)  # prompt rows went through the first layer only
    assert last[0] == 1 and first[0] == 32  # the first step: 32 tokens of the long prompt
    assert max(last) <= len(prompts) * params.n  # at most a row per sequence
    assert seen["last"] == seen["first"]  # untrimmed: every row everywhere
    for a, b in zip(results[0], results[1], strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5


def test_prompt_logprobs_keep_every_row(model_factory):
    """A request scoring its prompt needs every row's hidden state: no trimming that step."""
    path = model_factory("llama")
    prompt = [(3 * i + 2) % 200 + 3 for i in range(12)]
    with LLM(path, dtype="float32") as llm:
        [model] = llm.apply_model(lambda m: m)
        rows = []
        model.layers[-1].mlp.register_forward_hook(lambda _m, a, _o: rows.append(a[0].shape[0]))
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        out = llm.generate([prompt], params)[0]
    assert rows[0] == len(prompt)
    assert len(out.prompt_logprobs) == len(prompt)
