"""lm-evaluation-harness, as a user runs it, against `tandem serve`: its `local-completions`
model scores loglikelihood requests (every multiple-choice task) through /v1/completions with
`echo` + `logprobs`, and the answers equal its own `hf` backend on the same model."""

from __future__ import annotations

import pytest

from support.serving import Server

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test extra (pip install -e .[test])")
pytestmark = pytest.mark.timeout(300)

PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " a small village by the sea"),
    ("Two plus two equals", " four"),
    ("Question: which is heavier, a feather or a stone?\nAnswer:", " a stone"),
    ("Once upon a time", " there lived a king who had three daughters"),
    ("x", " y"),
]


def test_loglikelihood_through_tandem_equals_lm_evals_hf_backend(llama_dir):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    def requests():
        return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]

    hf = HFLM(pretrained=llama_dir, device="cpu", dtype="float32", batch_size=1)
    want = hf.loglikelihood(requests())
    with Server(llama_dir, "--served-model-name", "tiny") as server:
        api = LocalCompletionsAPI(
            base_url=f"{server.url}/v1/completions",
            model="tiny",
            tokenizer=llama_dir,
            tokenizer_backend="huggingface",
            tokenized_requests=True,
            num_concurrent=2,
            max_retries=1,
        )
        got = api.loglikelihood(requests())
    assert len(got) == len(want) == len(PAIRS)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want, strict=True):
        assert lp == pytest.approx(ref_lp, abs=1e-4)
        assert greedy == ref_greedy
