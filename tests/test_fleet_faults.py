"""A fleet losing a replica while a rolling update is still committing: the waves go on over the
live replicas, the lost one is quarantined and healed from a peer at the newest version, the
next push completes, and the rollout can be waited on (`PushStats.wait`,
`LLM.wait_for_version`). Every replica is checked against transformers on the last pushed
weights."""

import os
import signal
import time
from contextlib import contextmanager

import pytest

from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender
from test_fleet_push import _matches, _trainer  # noqa: E402
from test_fleet_rolling import _Load, _scale  # noqa: E402

pytestmark = pytest.mark.timeout(240)

LOAD = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
DEADLINE_S = 60.0  # every wait below ends well within it, or the test fails naming it


def _until(what: str, ok, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := ok():
            return value
        time.sleep(0.001)
    raise AssertionError(f"{what} did not happen within {timeout_s:g} s")


@contextmanager
def _fleet_under_load(model_factory, replicas: int = 3):
    """(llm, trainer, sender, load): a fleet with requests running on every replica."""
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    trainer = _trainer(trainer_dir)
    with LLM(engine_dir, data_parallel_size=replicas) as llm:
        load = _Load(llm, LOAD)
        _until("requests on every replica", lambda: all(s["load"] for s in llm.fleet_state()))
        yield llm, trainer, WeightSender(trainer, llm), load


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
        _scale(trainer, 1.02)
        start = time.monotonic()
        second = sender.push(version=2, policy="rolling", max_unavailable=1)
        ended = first.wait(timeout=DEADLINE_S)
        assert ended.committed == [0, 1] and list(ended.failed) == [2], ended
        assert "lost before its wave" in ended.failed[2] and "exited" in ended.failed[2]
        assert not first.rolling
        second.wait(timeout=DEADLINE_S)
        llm.wait_for_version(2, timeout=DEADLINE_S)
        assert time.monotonic() - start < DEADLINE_S
        _until("replica 2 healed", lambda: [(s["state"], s["version"]) for s in
                                            llm.fleet_state()] == [("serving", 2)] * 3)  # fmt: skip
        calls = load.stop()  # no generate call failed meanwhile
        assert calls
        _matches(llm, trainer, 2, 3)


def test_wait_on_a_push_that_is_not_rolling_returns_at_once(model_factory):
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(engine_dir, data_parallel_size=2) as llm:
        stats = WeightSender(_trainer(trainer_dir), llm).push(version=3)
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
        _scale(trainer, 1.02)
        second = sender.push(version=6, policy="rolling", max_unavailable=1)
        ended = first.wait(timeout=DEADLINE_S)  # it had ended before the second began
        assert ended.committed == [0, 1, 2] and not first.rolling
        assert second.wait(timeout=DEADLINE_S).committed == [0, 1, 2]
        llm.wait_for_version(6, timeout=DEADLINE_S)
        assert all("rolling_to" not in s for s in llm.fleet_state())
        load.stop()
        _matches(llm, trainer, 6, 3)
