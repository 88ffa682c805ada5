"""A fleet losing a replica while a rolling update is still committing: the waves go on over the
live replicas, the lost one is quarantined and healed from a peer at the newest version, the
next push completes, and the rollout can be waited on (`PushStats.wait`,
`LLM.wait_for_version`). Every replica is checked against transformers on the last pushed
weights."""

import os
import signal
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from support.fleets import Load, matches
from support.kills import KILL_IN_HEAL, KILL_IN_PHASE
from support.serving import alive
from support.trainers import hf_model, rolling_trainer, scale
from support.waits import until
from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender, WeightSyncError

pytestmark = pytest.mark.timeout(240)

LOAD = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
DEADLINE_S = 60.0  # every wait below ends well within it, or the test fails naming it


def _until(what: str, ok, timeout_s: float = DEADLINE_S):
    return until(what, ok, timeout_s)


@contextmanager
def _fleet_under_load(model_factory, transport: str = "shm", **options):
    """(llm, trainer, sender, load): a fleet of 3 with requests running on every replica."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = hf_model(trainer_dir)
    with LLM(engine_dir, data_parallel_size=3, **options) as llm:
        load = Load(llm, LOAD)
        _until("requests on every replica", lambda: all(s["load"] for s in llm.fleet_state()))
        yield llm, trainer, WeightSender(trainer, llm, transport=transport), load


def _kill(llm, replica: int) -> None:
    (pid,) = [w["pid"] for w in llm.worker_locations() if w["replica"] == replica]
    assert pid != os.getpid()
    os.kill(pid, signal.SIGKILL)


def test_a_replica_lost_while_a_rolling_update_commits_heals_and_the_next_push_lands(
    model_factory,
):
    """The reported case: push v1 rolling, SIGKILL replica 2 while replica 0's wave drains,
    push v2 at once (it used to hang: the waves waited for the dead replica, whose heal
    waited for the waves)."""
    with _fleet_under_load(model_factory) as (llm, trainer, sender, load):
        first = sender.push(version=1, policy="rolling", max_unavailable=1)
        assert first.rolling and [r.state for r in first.replicas] == ["rolling"] * 3
        _until("replica 0's wave", lambda: llm.fleet_state()[0]["state"] == "updating")
        _kill(llm, 2)
        scale(trainer, 1.02)
        start = time.monotonic()
        second = sender.push(version=2, policy="rolling", max_unavailable=1)
        ended = first.wait(timeout=DEADLINE_S)
        assert ended.committed == [0, 1] and list(ended.failed) == [2], ended
        assert "lost before its wave" in ended.failed[2] and "exited" in ended.failed[2]
        assert not first.rolling
        second.wait(timeout=DEADLINE_S)
        llm.wait_for_version(2, timeout=DEADLINE_S)
        assert time.monotonic() - start < DEADLINE_S
        _until(
            "replica 2 healed",
            lambda: [(s["state"], s["version"]) for s in llm.fleet_state()] == [("serving", 2)] * 3,
        )
        calls = load.stop()  # no generate call failed meanwhile
        assert calls
        matches(llm, trainer, 2, 3)


def test_wait_on_a_push_that_is_not_rolling_returns_at_once(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        stats = WeightSender(hf_model(trainer_dir), llm).push(version=3)
        assert not stats.rolling
        ended = stats.wait(timeout=0)
        assert (ended.version, ended.committed, ended.failed) == (3, [0, 1], {})
        llm.wait_for_version(3, timeout=0)
        with pytest.raises(TimeoutError, match=r"version 4 after 0\.2 s: replica 0 serving at 3"):
            llm.wait_for_version(4, timeout=0.2)


def test_a_push_issued_while_a_rollout_commits_is_queued_behind_it(model_factory):
    """Documented: a second push waits (its trainer up to its own timeout) until the rollout
    under way has ended, then lands on every replica."""
    with _fleet_under_load(model_factory) as (llm, trainer, sender, load):
        first = sender.push(version=5, policy="rolling", max_unavailable=1)
        assert any(s.get("rolling_to") == 5 for s in llm.fleet_state())
        scale(trainer, 1.02)
        second = sender.push(version=6, policy="rolling", max_unavailable=1)
        ended = first.wait(timeout=DEADLINE_S)  # it had ended before the second began
        assert ended.committed == [0, 1, 2] and not first.rolling
        assert second.wait(timeout=DEADLINE_S).committed == [0, 1, 2]
        llm.wait_for_version(6, timeout=DEADLINE_S)
        assert all("rolling_to" not in s for s in llm.fleet_state())
        load.stop()
        matches(llm, trainer, 6, 3)


def _healed_at(llm, version: int, trainer, load) -> None:
    """Every replica serving ``version``; no generate call of the load failed meanwhile; then
    every replica equals transformers on the trainer's weights."""
    llm.wait_for_version(version, timeout=DEADLINE_S)
    _until(f"every replica serving {version}", lambda: _states(llm) == [("serving", version)] * 3)
    assert load.stop()
    matches(llm, trainer, version, 3)


def _states(llm) -> list[tuple[str, int]]:
    return [(s["state"], s["version"]) for s in llm.fleet_state()]


def _updating(llm) -> list[int]:
    """The replicas whose wave is draining or committing (a list: truthy once one is)."""
    return [s["replica"] for s in llm.fleet_state() if s["state"] == "updating"]


def _kill_in(phase: str, tmp_path, monkeypatch, sig: str = "SIGKILL") -> None:
    """The worker of the first replica to reach ``phase`` of the push of version 1 is sent
    ``sig`` there (a `sitecustomize` every worker starts with)."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(KILL_IN_PHASE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TANDEM_TEST_KILL_MARK", str(tmp_path / "killed"))
    monkeypatch.setenv("TANDEM_TEST_KILL_PHASE", phase)
    monkeypatch.setenv("TANDEM_TEST_KILL_SIGNAL", sig)


def test_a_replica_killed_receiving_fails_the_push_at_its_deadline_and_the_retry_lands(
    model_factory, tmp_path, monkeypatch
):
    """Matrix cell (a), over dist (where replicas receive: shm replicas read the trainer's
    staging as they verify): the push's process group breaks, so the push fails on every
    replica by the group's deadline and each keeps version 0; the lost one heals; the retry
    reaches all three."""
    _kill_in("receive", tmp_path, monkeypatch)
    with _fleet_under_load(model_factory, "dist", push_phase_timeout_s=5) as (
        llm,
        trainer,
        sender,
        load,
    ):
        start = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.push(version=1, policy="rolling", max_unavailable=1)
        assert time.monotonic() - start < 30 and (tmp_path / "killed").exists()
        _until("the lost replica healed", lambda: _states(llm) == [("serving", 0)] * 3)
        assert sender.push(version=1, policy="rolling").wait(DEADLINE_S).committed == [0, 1, 2]
        _healed_at(llm, 1, trainer, load)


@pytest.mark.parametrize("phase", ["verify", "hold", "commit"])
def test_a_replica_killed_in_each_phase_of_a_rolling_push_heals_and_nothing_is_lost(
    model_factory, tmp_path, monkeypatch, phase
):
    """Matrix cells (b) verifying, (c) holding its copy, (e) committing its wave."""
    _kill_in(phase, tmp_path, monkeypatch)
    with _fleet_under_load(model_factory) as (llm, trainer, sender, load):
        stats = sender.push(version=1, policy="rolling", max_unavailable=1)
        ended = stats.wait(timeout=DEADLINE_S)
        assert (tmp_path / "killed").exists()
        assert len(ended.committed) == 2 and len(ended.failed) == 1, ended
        assert "exited" in next(iter(ended.failed.values())), ended
        _healed_at(llm, 1, trainer, load)


def test_the_replica_draining_for_its_wave_killed_heals_and_nothing_is_lost(model_factory):
    """Matrix cell (d): the replica whose wave drains is the one lost."""
    with _fleet_under_load(model_factory) as (llm, trainer, sender, load):
        stats = sender.push(version=1, policy="rolling", max_unavailable=1)
        (draining,) = _until("a wave draining", lambda: _updating(llm))
        _kill(llm, draining)
        ended = stats.wait(timeout=DEADLINE_S)
        # (it may have committed just before it died: then it heals to the version it had)
        assert list(ended.failed) in ([draining], []), ended
        _healed_at(llm, 1, trainer, load)


def _all_back(llm) -> bool:
    """Every replica serving, on workers that are running (not killed and unreaped)."""
    if any(state != "serving" for state, _ in _states(llm)):
        return False
    for w in llm.worker_locations():
        try:
            status = Path(f"/proc/{w['pid']}/status").read_text()
        except OSError:
            return False
        if "\nState:\tZ" in status:
            return False
    return True


@pytest.mark.parametrize("victim", ["healing", "peer"])
def test_a_replica_or_its_peer_killed_during_a_heal_both_heal_and_a_push_lands(
    model_factory, tmp_path, monkeypatch, victim
):
    """Matrix cells (g) a replica being healed and (h) the peer it heals from, each SIGKILLed
    while the peer's push into the healing replica verifies: every lost replica heals again
    (from a live peer), then a rolling push reaches all three."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(KILL_IN_HEAL))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TANDEM_TEST_KILL_MARK", str(tmp_path / "killed"))
    monkeypatch.setenv("TANDEM_TEST_KILL_PID", "")
    with _fleet_under_load(model_factory) as (llm, trainer, sender, load):
        pids = {w["replica"]: w["pid"] for w in llm.worker_locations()}
        if victim == "peer":  # replica 2 heals from replica 0 (the lowest at the newest version)
            monkeypatch.setenv("TANDEM_TEST_KILL_PID", str(pids[0]))  # its restarted worker's
        _kill(llm, 2)
        _until("the heal's fault", lambda: (tmp_path / "killed").exists())

        def back() -> bool:  # (the peer's worker killed: restarted; the kill may lag the mark)
            now = {w["replica"]: w["pid"] for w in llm.worker_locations()}
            return (victim == "healing" or now[0] != pids[0]) and _all_back(llm)

        _until("every replica serving again on live workers", back, timeout_s=2 * DEADLINE_S)
        stats = sender.push(version=1, policy="rolling", max_unavailable=1)
        assert stats.wait(timeout=DEADLINE_S).committed == [0, 1, 2]
        _healed_at(llm, 1, trainer, load)


def test_the_replica_draining_for_its_wave_stopped_past_the_deadline_heals(model_factory):
    """Matrix cell (d) with SIGSTOP: the stopped replica's step is not answered within
    ``collective_timeout_s`` (or its commit within the push deadline), so its workers are
    killed; its requests run again elsewhere, the waves go on, it heals; nothing hangs."""
    options = {"collective_timeout_s": 3.0, "push_phase_timeout_s": 2.0}
    with _fleet_under_load(model_factory, **options) as (llm, trainer, sender, load):
        start = time.monotonic()
        stats = sender.push(version=1, policy="rolling", max_unavailable=1)
        (draining,) = _until("a wave draining", lambda: _updating(llm))
        (pid,) = [w["pid"] for w in llm.worker_locations() if w["replica"] == draining]
        os.kill(pid, signal.SIGSTOP)
        ended = stats.wait(timeout=DEADLINE_S)
        assert len(ended.committed) >= 2, ended
        _healed_at(llm, 1, trainer, load)
        assert time.monotonic() - start < DEADLINE_S
        assert not alive(pid)  # killed, not left stopped


def test_a_replica_stopped_while_verifying_past_the_deadline_heals(
    model_factory, tmp_path, monkeypatch
):
    """Matrix cell (b) with SIGSTOP: the stopped replica does not answer the verify phase
    within ``push_phase_timeout_s``: it fails the push by timeout (the others commit their
    waves), its workers are killed, not left stopped, and it heals."""
    _kill_in("verify", tmp_path, monkeypatch, "SIGSTOP")
    options = {"collective_timeout_s": 3.0, "push_phase_timeout_s": 2.0}
    with _fleet_under_load(model_factory, **options) as (llm, trainer, sender, load):
        pids = {w["replica"]: w["pid"] for w in llm.worker_locations()}
        start = time.monotonic()
        stats = sender.push(version=1, policy="rolling", max_unavailable=1)
        ended = stats.wait(timeout=DEADLINE_S)
        assert (tmp_path / "killed").exists()
        assert len(ended.committed) == 2 and len(ended.failed) == 1, ended
        ((stopped, why),) = ended.failed.items()
        assert "verify" in why and "within 4 s (push_phase_timeout_s" in why, why
        _healed_at(llm, 1, trainer, load)
        assert time.monotonic() - start < DEADLINE_S
        pid = pids[stopped]
        assert not alive(pid)  # killed, not left stopped


def test_the_trainer_killed_while_replicas_receive_leaves_every_replica_serving_the_old_one(
    model_factory,
):
    """The trainer (its own process, over dist) dies a few boxes into its send, the replicas
    receiving: the push fails on every replica within the push deadline, none is
    torn or quarantined, every replica serves version 0 throughout, and the next push lands."""
    with _fleet_under_load(model_factory, "dist", push_phase_timeout_s=5) as (
        llm,
        trainer,
        sender,
        load,
    ):
        start = time.monotonic()
        proc = rolling_trainer(
            model_factory("llama", seed=1), llm.exchange_address, 1, "receiving", "dist"
        )
        assert proc.wait(DEADLINE_S) == 17
        _until(
            "every replica serving 0, none updating", lambda: _states(llm) == [("serving", 0)] * 3
        )
        assert time.monotonic() - start < DEADLINE_S
        assert sender.push(version=1, policy="rolling").wait(DEADLINE_S).committed == [0, 1, 2]
        _healed_at(llm, 1, trainer, load)
