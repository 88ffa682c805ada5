"""Pushes from a float32 trainer into a bfloat16 engine: the sender casts to bfloat16 and
checksums the cast bytes, so what lands is exactly the trainer's weights rounded to bfloat16
(the same values a bfloat16 engine loads from the trainer's checkpoint), on every transport
and mode; a writer that casts wrongly (truncating instead of rounding to nearest) or puts a box
in the wrong place is caught by verification."""

from __future__ import annotations

import pytest
import torch
import transformers

from support.faulty_writes import faulty_sender, shifted
from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender, WeightSyncError
from tandem.exchange.transports.base import SenderHalf

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)


def _truncated(src: torch.Tensor, dst: torch.Tensor) -> None:
    """To bfloat16 by dropping float32's low 16 bits, not rounding to nearest: about half the
    values land one bfloat16 step off."""
    bits = src.float().contiguous().view(torch.int32) & -65536
    dst.copy_(bits.view(torch.float32))


FAULTS = {"truncated": _truncated, "shifted": shifted}


@pytest.fixture(scope="module")
def dirs(model_factory):
    """(the engine's model, the trainer's: another seed)."""
    return model_factory("llama"), model_factory("llama", seed=1)


@pytest.fixture(scope="module")
def trainer(dirs):
    return transformers.AutoModelForCausalLM.from_pretrained(dirs[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded(dirs):
    """The trainer's checkpoint loaded by a bfloat16 engine: its parameters."""
    with LLM(dirs[1], dtype="bfloat16") as llm:
        [params] = llm.apply_model(lambda m: {k: p.clone() for k, p in m.named_parameters()})
        return params


def _outputs(llm) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    ("transport", "mode"),
    [("shm", "staged"), ("shm", "in_place"), ("dist", "staged"), ("dist", "in_place")],
)
def test_a_float32_push_lands_as_the_trainers_weights_in_bfloat16(
    dirs, trainer, loaded, transport, mode
):
    with LLM(dirs[0], dtype="bfloat16") as llm:
        stats = WeightSender(trainer, llm, transport=transport, mode=mode).push(version=1)
        assert llm.weight_version == 1
        assert stats.bytes_needed == sum(p.numel() * 2 for p in loaded.values())
        [live] = llm.apply_model(lambda m: dict(m.named_parameters()))
        assert live.keys() == loaded.keys()
        for name, param in live.items():
            assert param.dtype == torch.bfloat16
            assert torch.equal(param, loaded[name]), name


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_wrong_bfloat16_copy_is_rejected_and_the_old_version_keeps_serving(
    dirs, trainer, monkeypatch, fault
):
    with LLM(dirs[0], dtype="bfloat16") as llm:
        before = _outputs(llm)
        with monkeypatch.context() as m:
            m.setattr(SenderHalf, "write_box", faulty_sender(FAULTS[fault]))
            with pytest.raises(WeightSyncError, match="checksum mismatch.*as staged"):
                WeightSender(trainer, llm, transport="shm").push(version=1)
        assert llm.weight_version == 0 and _outputs(llm) == before


def test_tensor_parallel_ranks_in_place_reject_truncation_then_land_exactly(dirs, trainer):
    """TP=2 workers' shared bfloat16 parameters written by the trainer: a truncating cast
    tears the engine; an honest push then serves exactly what a TP=2 bfloat16 engine loaded
    from the trainer's checkpoint does (same weights, same ranks: the same tokens and log-probs)."""
    with LLM(dirs[1], dtype="bfloat16", tensor_parallel_size=2) as llm:
        expected = _outputs(llm)
    with LLM(dirs[0], dtype="bfloat16", tensor_parallel_size=2) as llm:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(SenderHalf, "write_box", faulty_sender(_truncated))
            with pytest.raises(WeightSyncError, match="checksum mismatch.*live parameter"):
                WeightSender(trainer, llm, transport="shm", mode="in_place").push(version=1)
        with pytest.raises(WeightSyncError, match="refused until a complete push"):
            llm.generate(PROMPTS, GREEDY)
        WeightSender(trainer, llm, transport="shm", mode="in_place").push(version=2)
        assert llm.weight_version == 2
        got = _outputs(llm)
    # Same tokens; log-probs within 1e-5: two engines' timed GEMM kernel choice may differ
    # by an ulp under load (a truncated bfloat16 weight moves them by far more).
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, logprobs), (_, want) in zip(got, expected, strict=True):
        assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < 1e-5
