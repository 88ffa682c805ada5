"""The one-sided transport on the Mooncake Transfer Engine (TCP on this machine): trainers
stage into registered memory, the engine's ranks read it with one-sided batched reads, verify
against the trainers' CRC32s and commit; wrong bytes are caught before anything is served."""

from __future__ import annotations

import pytest
import torch
import transformers

from support.faulty_writes import faulty_sender, shifted
from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender, WeightSyncError
from tandem.exchange.transports.base import SenderHalf
from tandem.exchange.transports.mooncake import MooncakeReceiver, MooncakeSender

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(model_factory):
    trainer_dir = model_factory("llama", seed=1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    return model_factory("llama"), trainer.eval()


def _serves_the_trainer(llm, trainer) -> None:
    for ids, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        with torch.no_grad():
            full = trainer(torch.tensor([ids + out.outputs[0].token_ids])).logits[0]
        assert out.outputs[0].token_ids == full[len(ids) - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize(
    "tp, dp, dtype", [(2, 1, "float32"), (1, 2, "float32"), (2, 1, "bfloat16")]
)
def test_a_push_lands_by_one_sided_reads(models, tp, dp, dtype, monkeypatch):
    """TP=2 (worker processes read the trainer's registered tensors where a box is contiguous,
    its staging for the rest: column shards), a fleet of two replicas (both read the one
    trainer), and a bfloat16 engine (every box cast into staging)."""
    engine_dir, trainer = models
    staged, honest = [], SenderHalf.write_box

    def write_box(self, src, dst):
        staged.append(1)
        return honest(self, src, dst)

    monkeypatch.setattr(SenderHalf, "write_box", write_box)
    with LLM(engine_dir, tensor_parallel_size=tp, data_parallel_size=dp, dtype=dtype) as llm:
        stats = WeightSender(trainer, llm, transport="mooncake").push(version=3)
        boxes = sum(1 for _ in trainer.parameters())
        if dtype == "bfloat16":
            assert len(staged) >= boxes  # every box cast on the way
        elif tp == 2:
            assert 0 < len(staged) < boxes * tp  # column shards staged, the rest read in place
        else:
            assert not staged  # every box read straight from the trainer's tensors
        if dtype == "bfloat16":
            return  # its numerics: test_exchange_bf16.py (same sender-side cast)
        assert llm.weight_version == 3 and stats.version == 3
        needed = sum(p.numel() * 4 for p in trainer.parameters())
        assert stats.bytes_moved >= needed  # what the trainer staged (TP replicates norms)
        _serves_the_trainer(llm, trainer)
        if dp == 2:
            assert [s["version"] for s in llm.fleet_state()] == [3, 3]


def test_a_wrong_staging_write_is_caught_and_the_old_version_serves(models, monkeypatch):
    """Every box staged (none read from the trainer's tensors), each written shifted."""
    engine_dir, trainer = models
    with LLM(engine_dir, dtype="float32") as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        with monkeypatch.context() as m:
            m.setattr(MooncakeSender, "_in_place", staticmethod(lambda t, dtype: False))
            m.setattr(SenderHalf, "write_box", faulty_sender(shifted))
            with pytest.raises(WeightSyncError, match="checksum mismatch.*as staged") as err:
                WeightSender(trainer, llm, transport="mooncake").push(version=1)
        assert "version 0 keeps serving" in str(err.value) and llm.weight_version == 0
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == before
        WeightSender(trainer, llm, transport="mooncake").push(version=2)
        _serves_the_trainer(llm, trainer)


def test_a_read_from_the_wrong_place_is_caught(models, monkeypatch):
    """The engine's reads land one box's bytes shifted by 4 (a wrong remote address): what
    arrived is checked against the trainer's CRC32s, not against itself."""
    engine_dir, trainer = models
    honest = MooncakeReceiver.receive

    def receive(self, spec, records):
        n = honest(self, spec, records)
        first = records[0].nbytes
        landing = self._landing.data
        landing[: first - 4] = landing[4:first].clone()
        return n

    with LLM(engine_dir, dtype="float32") as llm:
        with monkeypatch.context() as m:
            m.setattr(MooncakeReceiver, "receive", receive)
            with pytest.raises(WeightSyncError, match="checksum mismatch"):
                WeightSender(trainer, llm, transport="mooncake").push(version=1)
        assert llm.weight_version == 0
        WeightSender(trainer, llm, transport="mooncake").push(version=2)
        _serves_the_trainer(llm, trainer)


def test_in_place_reads_land_in_the_live_parameters(models):
    """TP=2: each worker reads its boxes straight into its parameters (registered once) or,
    for boxes strided there, through its buffer; no parameter moves."""
    engine_dir, trainer = models
    with LLM(engine_dir, tensor_parallel_size=2, dtype="float32") as llm:
        WeightSender(trainer, llm, transport="mooncake", mode="in_place").push(version=1)
        assert llm.weight_version == 1
        _serves_the_trainer(llm, trainer)
        WeightSender(trainer, llm, transport="mooncake", mode="in_place").push(version=2)
        assert llm.weight_version == 2  # the pinned parameters serve a second push too


def _data_ptrs(model) -> list[int]:
    """Where each parameter's storage lives (a push in place keeps it)."""
    return [p.data_ptr() for p in model.parameters()]


def test_an_in_place_read_gone_wrong_tears_the_engine_until_a_good_push(models, monkeypatch):
    engine_dir, trainer = models
    honest = MooncakeReceiver.receive

    def receive(self, spec, records):  # one live byte flipped after the reads
        n = honest(self, spec, records)
        with torch.no_grad():
            box = self.live(records[:1])[0]
            box.view(-1)[0] += 1.0
        return n

    with LLM(engine_dir, dtype="float32") as llm:
        data_ptrs = llm.apply_model(_data_ptrs)
        with monkeypatch.context() as m:
            m.setattr(MooncakeReceiver, "receive", receive)
            with pytest.raises(WeightSyncError, match="checksum mismatch.*live parameter"):
                WeightSender(trainer, llm, transport="mooncake", mode="in_place").push(version=1)
        with pytest.raises(WeightSyncError, match="refused until a complete push"):
            llm.generate(PROMPTS, GREEDY)
        WeightSender(trainer, llm, transport="mooncake", mode="in_place").push(version=2)
        _serves_the_trainer(llm, trainer)
        assert llm.apply_model(_data_ptrs) == data_ptrs
