"""Both ways of starting workers give the same engine: forked from a template (the default
on Linux) and fresh interpreters (``worker_start="exec"``)."""

from __future__ import annotations

from tandem import LLM, SamplingParams

PROMPTS = ["the quick brown fox", "one two three"]


def test_forked_and_execd_workers_generate_the_same_tokens(llama_dir):
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    tokens = {}
    for start in ("fork", "exec"):
        with LLM(llama_dir, tensor_parallel_size=2, worker_start=start) as llm:
            outs = llm.generate(PROMPTS, greedy)
            tokens[start] = [o.outputs[0].token_ids for o in outs]
    assert tokens["fork"] == tokens["exec"]
    assert all(len(t) == 8 for t in tokens["fork"])
