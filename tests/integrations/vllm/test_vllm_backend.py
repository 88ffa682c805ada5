"""tandem as vLLM's ``tandem`` weight-transfer backend, offline: ``vllm.LLM(...,
weight_transfer_config={"backend": "tandem"})`` with no worker extension (tandem's plugin entry
point registers the backend), pushed into through vLLM's own trainer API
(``WeightTransferTrainerFactory.trainer_init(TandemTrainerInitInfo(...), client=llm,
source=ModuleSource(model)).send_weights()``). vLLM then generates what transformers does on
the pushed weights; a wrong copy is rejected with the old weights serving; a commit that tears
vLLM's weights says so, and the next push lands; a version that does not go forward is refused
by the workers before any byte moves unless it is a rollback.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there). The engine core and
its one
worker (tensor_parallel_size=1) run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
faults can be injected where the worker places its boxes.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")  # vLLM's own CI switch: no inductor compile
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ModuleSource,
    ParamMeta,
    WeightSource,
)

from support.faulty_writes import faulty_sender, shifted  # noqa: E402
from support.vllm_models import (  # noqa: E402
    MODEL,
    assert_generates_like,
    engine_gone,
    generate,
    offline_llm,
    train_step,
)
from tandem.errors import StaleVersionError  # noqa: E402
from tandem.exchange import WeightSyncError  # noqa: E402
from tandem.exchange.transports.base import SenderHalf  # noqa: E402
from tandem.integrations.vllm import TandemTrainerInitInfo  # noqa: E402
from tandem.integrations.vllm.plugin import register  # noqa: E402
from tandem.integrations.vllm.receiver import VllmReceiver  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(model_factory):
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    llm = offline_llm(model_dir, weight_transfer_config={"backend": "tandem"})
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = WeightTransferTrainerFactory.trainer_init(
        TandemTrainerInitInfo(rank=0), client=llm, source=ModuleSource(model)
    )
    yield llm, trainer, model
    trainer.shutdown()
    del llm
    engine_gone()


def test_installing_tandem_registers_the_backend_with_vllm():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("tandem") == "tandem.integrations.vllm.plugin:register"
    register()  # vLLM calls it once per process; again is harmless
    register()


def test_pushes_through_vllms_trainer_api_land_and_vllm_generates_them(engine):
    llm, trainer, model = engine
    served = trainer.weight_state()["version"]
    for step in (1, 2):  # the second push reuses the plan and the staging
        train_step(model, seed=step)
        stats = trainer.send_weights()
        assert stats.version == served + step
        assert llm.get_weight_version() == str(stats.version)
        assert stats.bytes_moved == stats.bytes_needed > 0
        assert_generates_like(llm, model)
    assert trainer.weight_state() == {"version": served + 2, "torn": None}


def test_a_wrong_copy_is_rejected_and_the_old_weights_serve(engine, monkeypatch):
    llm, trainer, model = engine
    train_step(model, seed=11)
    trainer.send_weights()
    served, before = llm.get_weight_version(), generate(llm)
    train_step(model, seed=12)
    monkeypatch.setattr(SenderHalf, "write_box", faulty_sender(shifted))
    with pytest.raises(WeightSyncError, match="checksum mismatch.*as staged") as err:
        trainer.send_weights()
    assert f"version {served} keeps serving" in str(err.value)
    assert llm.get_weight_version() == served and generate(llm) == before
    monkeypatch.undo()  # vLLM's update ended cleanly: the next push lands
    trainer.send_weights()
    assert_generates_like(llm, model)


def test_a_torn_commit_is_reported_and_the_next_push_lands(engine, monkeypatch):
    """qkv_proj's boxes written one row off into vLLM's layer are found reading vLLM's kernels
    back; the answer says vLLM's weights are mixed, and so does the trainer until a push
    lands."""
    llm, trainer, model = engine
    load = VllmReceiver._load

    def rolled_qkv(self, records, boxes):
        boxes = [
            b.roll(1, 0) if "qkv_proj" in r.key else b for r, b in zip(records, boxes, strict=True)
        ]
        return load(self, records, boxes)

    served = llm.get_weight_version()
    train_step(model, seed=21)
    monkeypatch.setattr(VllmReceiver, "_load", rolled_qkv)
    with pytest.raises(WeightSyncError, match="weights are now mixed.*qkv_proj.*after commit"):
        trainer.send_weights()
    assert trainer.weight_state()["torn"] and llm.get_weight_version() == served
    monkeypatch.undo()
    stats = trainer.send_weights()
    assert trainer.weight_state() == {"version": stats.version, "torn": None}
    assert_generates_like(llm, model)


def another_trainer_pushes(llm, model: torch.nn.Module, version: int | None = None) -> int:
    """A second trainer pushes ``model`` into the same workers: the version they then serve."""
    other = WeightTransferTrainerFactory.trainer_init(
        TandemTrainerInitInfo(rank=0), client=llm, source=ModuleSource(model)
    )
    try:
        return other.send_weights(version).version
    finally:
        other.shutdown()


def test_a_stale_version_is_refused_by_the_workers_and_the_next_forward_one_lands(
    engine, monkeypatch
):
    """Another trainer pushed since this one last heard from vLLM's workers: a version not
    above theirs is refused by the workers themselves before any byte moves
    (`StaleVersionError` naming both), the served weights untouched; the next forward push
    lands, a rollback lands when asked for, and a push naming no version goes again as the
    workers' version + 1."""
    llm, trainer, model = engine
    train_step(model, seed=41)
    ahead = another_trainer_pushes(llm, model, trainer.weight_state()["version"] + 5)
    stale = trainer.weight_state()["version"] + 1  # this trainer knows no better
    phases = []
    run = VllmReceiver.run

    def recorded(self, phase, spec, records):
        phases.append(phase)
        return run(self, phase, spec, records)

    monkeypatch.setattr(VllmReceiver, "run", recorded)
    before = generate(llm)
    train_step(model, seed=42)
    with pytest.raises(StaleVersionError, match=f"version {stale} .* version {ahead}") as err:
        trainer.send_weights(version=stale)
    assert (err.value.requested, err.value.served) == (stale, ahead)
    assert phases == []  # no worker received, verified or committed anything
    assert llm.get_weight_version() == str(ahead) and generate(llm) == before
    assert trainer.weight_state() == {"version": ahead, "torn": None}  # learned from them
    with pytest.raises(StaleVersionError):  # now refused by this trainer's own exchange
        trainer.send_weights(version=ahead)
    assert phases == []
    monkeypatch.undo()
    assert trainer.send_weights().version == ahead + 1 == int(llm.get_weight_version())
    assert_generates_like(llm, model)
    train_step(model, seed=43)
    ahead = another_trainer_pushes(llm, model, ahead + 3)
    stats = trainer.send_weights(version=stale, rollback=True)  # the workers let it through
    assert stats.version == stale == int(llm.get_weight_version())
    assert trainer.weight_state() == {"version": stale, "torn": None}
    assert_generates_like(llm, model)
    train_step(model, seed=44)
    ahead = another_trainer_pushes(llm, model)
    assert trainer.send_weights().version == ahead + 1 == int(llm.get_weight_version())
    assert_generates_like(llm, model)


def test_a_trainer_pushing_over_dist_reaches_the_same_workers(engine):
    """A second trainer over the dist transport (torch.distributed point-to-point, the
    workers receiving while it sends): vLLM's workers report anew and the push lands. (Last
    here: the first trainer's idea of the version served is behind now.)"""
    llm, trainer, model = engine
    train_step(model, seed=5)
    over_dist = WeightTransferTrainerFactory.trainer_init(
        TandemTrainerInitInfo(rank=0, transport="dist"), client=llm, source=ModuleSource(model)
    )
    try:
        stats = over_dist.send_weights()
    finally:
        over_dist.shutdown()
    assert stats.transport == "dist" and stats.bytes_moved == stats.bytes_needed
    assert llm.get_weight_version() == str(stats.version)
    assert_generates_like(llm, model)


class TensorsSource(WeightSource):
    """A `WeightSource` that is not a module: (name, tensor) pairs, read afresh each pass."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def __iter__(self):
        for name, param in self.model.named_parameters():
            yield name, param.detach().clone()


def test_any_weight_source_is_read_afresh_each_push(engine):
    llm, _, model = engine
    pusher = WeightTransferTrainerFactory.trainer_init(
        TandemTrainerInitInfo(rank=0), client=llm, source=TensorsSource(model)
    )
    try:
        for seed in (31, 32):  # the second push sends the weights as they are then
            train_step(model, seed=seed)
            stats = pusher.send_weights()
            assert llm.get_weight_version() == str(stats.version)
            assert_generates_like(llm, model)
    finally:
        pusher.shutdown()
