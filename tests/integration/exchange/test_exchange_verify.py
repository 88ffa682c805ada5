"""Verification catches real wrong copies: a writer that puts a box in the wrong place, in the
wrong order or through the wrong dtype is rejected, for every transport and mode.

The faults are injected where the bytes are written (the sender's writer for shm and cuda_ipc,
the engine's receive or commit for dist), never by faking a checksum: the sender's CRC32 still
comes from the trainer's tensor, and the receiver's from what landed. Staged pushes rejected
before commit keep the old version serving; a push that wrote live weights leaves the engine
refusing requests until a complete push lands.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from support.faulty_writes import faulty_sender, shifted
from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender, WeightSyncError
from tandem.exchange.transports.base import ReceiverHalf, SenderHalf
from tandem.exchange.transports.dist import DistReceiver
from tandem.layers.placement import LocalRegion

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)


def _transposed(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The box's elements in transposed order (a transpose the writer should not have done)."""
    dst.copy_(src.t().reshape(src.shape) if src.dim() == 2 else src.flip(0))


def _wrong_dtype(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Through bfloat16 on the way (float32 engine): every value rounded."""
    dst.copy_(src.to(torch.bfloat16))


FAULTS = {"shifted": shifted, "transposed": _transposed, "dtype": _wrong_dtype}


def _trainer(path: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _lands(llm, trainer, version: int, **kwargs) -> None:
    """A fault-free push lands and the engine then generates what the trainer does."""
    WeightSender(trainer, llm, **kwargs).push(version=version)
    assert llm.weight_version == version
    for ids, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        with torch.no_grad():
            full = trainer(torch.tensor([ids + out.outputs[0].token_ids])).logits[0]
        assert out.outputs[0].token_ids == full[len(ids) - 1 : -1].argmax(-1).tolist()


@pytest.fixture(scope="module")
def models(model_factory):
    return model_factory("llama"), _trainer(model_factory("llama", seed=1))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_shm_staged_wrong_copy_is_rejected_and_the_old_version_keeps_serving(
    models, monkeypatch, fault
):
    engine_dir, trainer = models
    with LLM(engine_dir) as llm:
        before = _tokens(llm)
        with monkeypatch.context() as m:
            m.setattr(SenderHalf, "write_box", faulty_sender(FAULTS[fault]))
            with pytest.raises(WeightSyncError, match="checksum mismatch.*as staged") as err:
                WeightSender(trainer, llm, transport="shm").push(version=1)
        assert "version 0 keeps serving" in str(err.value) and llm.weight_version == 0
        assert _tokens(llm) == before  # the old weights, untouched
        _lands(llm, trainer, 2, transport="shm")


@pytest.mark.parametrize("fault", list(FAULTS))
def test_shm_in_place_wrong_copy_tears_the_engine_until_a_complete_push(models, monkeypatch, fault):
    """Trainer writes straight into a TP=2 engine's shared parameters (worker processes)."""
    engine_dir, trainer = models
    with LLM(engine_dir, tensor_parallel_size=2) as llm:
        with monkeypatch.context() as m:
            m.setattr(SenderHalf, "write_box", faulty_sender(FAULTS[fault]))
            with pytest.raises(WeightSyncError, match="checksum mismatch.*live parameter"):
                WeightSender(trainer, llm, transport="shm", mode="in_place").push(version=1)
        assert llm.weight_version == 0
        with pytest.raises(WeightSyncError, match="refused until a complete push"):
            llm.generate(PROMPTS, GREEDY)
        _lands(llm, trainer, 2, transport="shm", mode="in_place")


def test_unverified_push_serves_the_wrong_copy(models, monkeypatch):
    """The faults are real: with verify=False the same wrong copy lands and is served."""
    engine_dir, trainer = models
    with LLM(engine_dir) as llm:
        with monkeypatch.context() as m:
            m.setattr(SenderHalf, "write_box", faulty_sender(shifted))
            WeightSender(trainer, llm, transport="shm", verify=False).push(version=1)
        assert llm.weight_version == 1
        with torch.no_grad():
            expected = trainer(torch.tensor([PROMPTS[0]])).logits[0]
        got = llm.score([PROMPTS[0]], logprobs=False)[0]
        assert (got - expected).abs().max() > 1e-2


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_staged_commit_that_writes_wrong_is_caught_after_commit_and_tears(
    models, monkeypatch, transport
):
    """The engine's own commit copy goes wrong: the staging checked out, the live parameters
    do not; the engine refuses requests rather than serve them."""
    engine_dir, trainer = models
    with LLM(engine_dir) as llm:
        with monkeypatch.context() as m:
            m.setattr(ReceiverHalf, "write_box", lambda self, src, dst: shifted(src, dst))
            with pytest.raises(WeightSyncError, match="after commit.*|refused until"):
                WeightSender(trainer, llm, transport=transport).push(version=1)
        with pytest.raises(WeightSyncError, match="refused until a complete push"):
            llm.generate(PROMPTS, GREEDY)
        _lands(llm, trainer, 2, transport=transport)


def test_dist_in_place_receive_into_the_wrong_offset_tears_the_engine(models, monkeypatch):
    """The engine's receive writes one box a row off (a wrong target): the bytes that arrived
    are right, but not where the record says, and the read-back catches it."""
    engine_dir, trainer = models

    def targets(self, records):
        views = self.live(records)
        params = dict(self.model.named_parameters())
        for i, r in enumerate(records):
            (a, b), *rest = r.region.slices
            if not r.region.transposed and b < params[r.key].shape[0] and b - a > 1:
                views[i] = LocalRegion(((a + 1, b + 1), *rest)).view(params[r.key])
                break
        return views

    with LLM(engine_dir) as llm:
        with monkeypatch.context() as m:
            m.setattr(DistReceiver, "targets", targets)
            with pytest.raises(WeightSyncError, match="checksum mismatch.*live parameter"):
                WeightSender(trainer, llm, transport="dist", mode="in_place").push(version=1)
        with pytest.raises(WeightSyncError, match="refused until a complete push"):
            llm.generate(PROMPTS, GREEDY)
        _lands(llm, trainer, 2, transport="dist", mode="in_place")
