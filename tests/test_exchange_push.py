"""WeightSender pushes a trainer model into a live engine, in place, over shared memory."""

import pytest
import torch
import transformers

from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender, WeightSyncError

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]


def _trainer(path: str) -> torch.nn.Module:
    """The "trainer": transformers' model of another random init (different weights)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_push_into_single_process_engine_in_place(model_factory, family):
    engine_dir, trainer_dir = model_factory(family), model_factory(family, seed=1)
    trainer = _trainer(trainer_dir)
    with LLM(engine_dir) as llm:
        runner = llm.engine.runner
        before = {n: p.data_ptr() for n, p in runner.model.named_parameters()}
        assert (runner.score([PROMPTS[0]])[0] - _logits(trainer, PROMPTS[0])).abs().max() > 1e-2
        stats = WeightSender(trainer, llm).push(version=7)
        assert llm.weight_version == 7 and stats.version == 7 and stats.transport == "shm"
        assert stats.bytes_sent == stats.bytes_needed > 0
        assert {n: p.data_ptr() for n, p in runner.model.named_parameters()} == before
        for ids in PROMPTS:
            assert (runner.score([ids])[0] - _logits(trainer, ids)).abs().max() <= 1e-4
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
        assert out[0].weight_version == 7


def test_push_into_tensor_parallel_engine(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = _trainer(trainer_dir)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    with LLM(trainer_dir) as reference:
        expected = reference.generate(PROMPTS, params)
    with LLM(engine_dir, tensor_parallel_size=2) as llm:
        stats = WeightSender(trainer, llm).push(version=3)
        assert stats.bytes_sent == stats.bytes_needed
        got = llm.generate(PROMPTS, params)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert (
            max(
                abs(a - b)
                for a, b in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True)
            )
            <= 1e-5
        )
        assert g.weight_version == 3


class _CorruptingSender(WeightSender):
    def _before_ready(self, segment):
        view = segment.view(0, 4)
        view[0] ^= 0xFF  # one flipped byte in transit


def test_checksum_mismatch_rejects_the_update(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = _trainer(trainer_dir)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(engine_dir) as llm:
        before = llm.generate(PROMPTS, params)
        with pytest.raises(
            WeightSyncError, match="checksum mismatch.*version 0 keeps serving|rejected"
        ):
            _CorruptingSender(trainer, llm).push(version=1)
        assert llm.weight_version == 0
        after = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
        WeightSender(trainer, llm).push(version=2)  # the next push succeeds
        assert llm.weight_version == 2
