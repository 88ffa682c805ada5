"""One push updates every replica of a fleet: the trainer sends each byte once (counted by its
transport), the other replicas get theirs by relay (dist) or from the one staging (shm), every
replica verifies against the trainer's CRCs; one that fails leaves the push (quarantined, then
healed from a peer) while the others commit."""

import subprocess
import sys
import textwrap

import pytest
import torch

from support.fleets import matches, wait_serving
from support.trainers import hf_model, run_trainer
from tandem import LLM
from tandem.exchange import WeightSender, WeightSyncError

pytestmark = pytest.mark.timeout(300)


def _one_copy(stats, replicas: int) -> None:
    """Counted: the trainer sent one copy; every replica took in exactly what it holds."""
    assert stats.bytes_moved == stats.bytes_needed > 0
    assert [r.replica for r in stats.replicas] == list(range(replicas))
    for r in stats.replicas:
        assert r.bytes_in == r.bytes_needed == stats.bytes_needed, r


@pytest.mark.parametrize(("replicas", "transport"), [(2, "shm"), (3, "dist")])
def test_one_push_updates_every_replica_sending_each_byte_once(model_factory, replicas, transport):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=replicas) as llm:
        stats = WeightSender(trainer, llm, transport=transport).push(version=4)
        assert llm.weight_version == 4 and stats.version == 4
        assert [s["version"] for s in llm.fleet_state()] == [4] * replicas
        _one_copy(stats, replicas)
        relayed = [r.bytes_relayed for r in stats.replicas]
        if transport == "dist":  # a chain: 0 -> 1 -> 2, each link one copy
            assert relayed == [stats.bytes_needed] * (replicas - 1) + [0]
        else:  # every replica reads the trainer's one staging
            assert relayed == [0] * replicas
        matches(llm, trainer, 4, replicas)
        with torch.no_grad():  # a second push of changed weights lands everywhere too
            for p in trainer.parameters():
                p.mul_(0.9)
        WeightSender(trainer, llm.exchange_address, transport=transport).push(version=5)
        matches(llm, trainer, 5, replicas)


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_fsdp2_trainer_processes_push_into_a_fleet_of_tp2_replicas(model_factory, transport):
    engine_dir = model_factory("llama", vocab_size=509)
    trainer_dir = model_factory("llama", seed=1, vocab_size=509)
    with LLM(engine_dir, data_parallel_size=2, tensor_parallel_size=2) as llm:
        # each trainer rank asserts the counted bytes moved equal one copy's
        assert run_trainer(trainer_dir, llm.exchange_address, 6, transport) == [0, 0]
        assert llm.weight_version == 6
        matches(llm, hf_model(trainer_dir), 6, 2)


def test_in_place_pushes_need_rolling_and_are_refused_before_any_byte_moves(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        sender = WeightSender(hf_model(trainer_dir), llm, transport="shm", mode="in_place")
        with pytest.raises(WeightSyncError, match="policy='rolling'"):
            sender.push(version=2)
        assert llm.weight_version == 0 and llm.fleet.fleet_state()[1]["state"] == "serving"


CORRUPT_RELAY = """
    import torch
    from tandem.exchange.transports import p2p

    honest = p2p.Forwarder.send

    def send(self, data):  # the relay passes on a copy with one byte flipped
        wrong = data.clone()
        wrong[len(wrong) // 2] ^= 0xFF
        self._keep = getattr(self, "_keep", []) + [wrong]
        return honest(self, wrong)

    p2p.Forwarder.send = send
"""


def test_a_wrong_copy_on_a_relay_quarantines_that_replica_and_it_heals_from_a_peer(
    model_factory, tmp_path, monkeypatch
):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(CORRUPT_RELAY))
    monkeypatch.syspath_prepend(str(tmp_path))  # the replicas' workers start with it
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        stats = WeightSender(trainer, llm, transport="dist").push(version=3)
        # replica 0 took the trainer's bytes and committed; replica 1 got a wrong copy by
        # relay, caught it against the trainer's CRCs and left the push
        assert [(r.replica, r.state) for r in stats.replicas] == [(0, "committed"), (1, "failed")]
        assert "checksum mismatch" in stats.failed[1]
        assert llm.fleet_state()[0]["version"] == 3
        wait_serving(llm, 2)  # healed from replica 0: a push of its own, not the relay
        assert [s["version"] for s in llm.fleet_state()] == [3, 3]
        matches(llm, trainer, 3, 2)


def test_the_relay_fault_is_injected_in_worker_processes_only(tmp_path):
    """The corrupting sitecustomize above really loads in a fresh process (the check above is
    not passing for want of a fault)."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(CORRUPT_RELAY))
    code = "from tandem.exchange.transports import p2p; print(p2p.Forwarder.send.__module__)"
    env = {"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "sitecustomize", out.stderr
