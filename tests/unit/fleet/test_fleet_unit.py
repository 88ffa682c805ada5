"""The `Fleet`'s own rules, over replicas of this test's making (the `Replica` protocol's
edge): quarantine, heal from the newest peer, the lag check, joining, routing around a
replica that does not answer, a rolling wave's drain by the ledger. No worker processes:
the replicas behind `LLM`, `tandem serve` and `tandem router` run these same rules
(test_fleet_rolling.py, test_fleet_faults.py, test_router.py, test_router_faults.py)."""

import threading
import time

import pytest

from tandem.fleet.board import NoReplicaError, ReplicaState
from tandem.fleet.fleet import Fleet, FleetSettings
from tandem.fleet.remote import RemoteReplica
from tandem.fleet.replica import Health

pytestmark = pytest.mark.timeout(60)


class FakeTarget:
    def __init__(self):
        self.update_listeners: list = []


class FakeReplica:
    """A replica whose health the test sets; a peer push copies the version."""

    kind = "tandem serve"
    in_process = False
    block = 4
    cache_blocks = 64

    def __init__(self, name: str, version: int = 0):
        self.name = name
        self._version = version
        self.ok = True
        self.fault: str | None = None
        self.target = FakeTarget()
        self.running = False
        self.sent_to: list[str] = []
        self.closed = False

    @property
    def version(self) -> int:
        return self._version

    def health(self) -> Health:
        return Health(
            ok=self.ok and self.fault is None,
            version=self._version,
            fault=self.fault,
            reason=self.fault or (None if self.ok else "no answer"),
        )

    def refresh(self) -> None:
        pass

    def busy(self):
        return None

    def lost(self, reason: str) -> bool:
        self.ok = False
        return self.fault is not None

    def receive_address(self) -> str:
        return self.name

    def send_to(self, other, timeout_s: float) -> int:
        self.sent_to.append(other.name)
        other._version, other.fault = self._version, None
        return self._version

    def paused(self):
        return None

    def pause(self, mode: str) -> None:
        pass

    def restarted(self):
        return None

    def report(self) -> dict:
        return {"url": self.name}

    def close(self) -> None:
        self.closed = True


def _fleet(*versions: int, heal: bool = True) -> tuple[Fleet, list[FakeReplica]]:
    replicas = [FakeReplica(f"r{i}", v) for i, v in enumerate(versions)]
    return Fleet(replicas, FleetSettings(stage_timeout_s=5.0, heal=heal)), replicas


def _until(fleet: Fleet, predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    with fleet.board.changed:
        while not predicate():
            left = deadline - time.monotonic()
            assert left > 0, f"not reached in {timeout_s} s: {fleet.fleet_state()}"
            fleet.board.changed.wait(min(left, 0.05))


def _states(fleet: Fleet) -> list[tuple[str, int]]:
    return [(s["state"], s["version"]) for s in fleet.fleet_state()]


def test_a_faulty_replica_is_quarantined_then_healed_from_the_newest_peer():
    fleet, (a, b, c) = _fleet(4, 2, 4)
    b.fault = "torn: the push failed after its commit began"
    fleet.check()
    _until(fleet, lambda: fleet.board.state(1) is ReplicaState.SERVING)
    assert a.sent_to == ["r1"] and c.sent_to == []  # the newest, lowest index first
    assert b.version == 4
    assert fleet.fleet_state()[1] == {
        "replica": 1,
        "url": "r1",
        "state": "serving",
        "version": 4,
        "load": 0,
    }


def test_without_heal_a_quarantined_replica_stays_out_until_healed_by_hand():
    fleet, (a, b) = _fleet(1, 1, heal=False)
    a._version = 2
    b.fault = "dead: worker 0 exited"
    state = fleet.fleet_state()[1]
    assert state["state"] == "quarantined" and "worker 0 exited" in state["reason"]
    assert {fleet.route([1, 2, 3, 4], 1, 4, wait_s=0).replica for _ in range(4)} == {0}
    assert fleet.heal(1) == {"replica": 1, "peer": 0, "version": 2}
    assert _states(fleet) == [("serving", 2), ("serving", 2)]


def test_a_replica_that_does_not_answer_is_skipped_not_quarantined():
    fleet, (a, b) = _fleet(2, 2)
    b.ok = False
    for _ in range(6):
        routed = fleet.route([1, 2, 3, 4, 5], 1, 8, wait_s=0)
        assert routed.replica == 0
        fleet.finished(routed)
    assert fleet.board.state(1) is ReplicaState.SERVING  # back as it is once it answers
    b.ok = True
    loads = {fleet.route([i] * 5, 1, 100, wait_s=0).replica for i in range(4)}
    assert loads == {0, 1}
    assert b.sent_to == [] and a.sent_to == []
    a.ok = b.ok = False
    with pytest.raises(NoReplicaError, match="r0: no answer; r1: no answer"):
        fleet.route([1], 1, 1, wait_s=0)


def test_a_replica_back_at_an_older_version_outside_a_push_heals():
    fleet, (a, b, c) = _fleet(5, 5, 5)
    b._version = 0  # restarted on its checkpoint
    fleet.check()
    _until(fleet, lambda: b.version == 5 and fleet.board.state(1) is ReplicaState.SERVING)
    assert a.sent_to == ["r1"]  # newest peer, lowest index first


def test_versions_held_apart_by_a_push_or_a_fleet_wide_control_are_not_lag():
    fleet, (a, b) = _fleet(5, 5)
    with fleet.holding_pushes():
        b._version = 0  # a reload under way on every replica, this one first
        fleet.check()
        assert fleet.board.state(1) is ReplicaState.SERVING
        a._version = 0
    fleet.check()
    assert _states(fleet) == [("serving", 0), ("serving", 0)] and a.sent_to == b.sent_to == []


def test_a_replica_joins_from_a_live_peer_and_is_refused_twice_or_unhealthy():
    fleet, (a, b) = _fleet(7, 7)
    joined = fleet.add(FakeReplica("r2"))
    assert joined == {"replica": 2, "peer": 0, "version": 7}
    assert _states(fleet) == [("serving", 7)] * 3
    with pytest.raises(ValueError, match="r1 is already a replica"):
        fleet.add(FakeReplica("r1"))
    down = FakeReplica("r3")
    down.ok = False
    with pytest.raises(ValueError, match="r3 is not healthy: no answer"):
        fleet.add(down)
    assert fleet.fleet_state()[3]["state"] == "quarantined"
    other = FakeReplica("r4")
    other.kind = "vllm serve"  # a server of another engine cannot copy its peers' weights
    with pytest.raises(ValueError, match="r4 is a vllm serve, the fleet's replicas are each"):
        fleet.add(other)
    assert other.closed and len(fleet.fleet_state()) == 4


def test_a_heal_with_no_live_peer_fails_and_stays_quarantined_saying_why():
    fleet, (a, b) = _fleet(1, 1, heal=False)
    a.fault, b.fault = "dead: a", "dead: b"
    fleet.check()
    with pytest.raises(NoReplicaError, match="no live peer"):
        fleet.heal(1)
    assert "healing failed: no live peer" in fleet.fleet_state()[1]["reason"]


def test_a_rolling_waves_drain_waits_for_what_the_ledger_says_the_replica_owes():
    fleet, (a, b) = _fleet(1, 1)
    routed = fleet.route([1, 2, 3], 1, 10, wait_s=0)
    fleet.board.set(routed.replica, ReplicaState.UPDATING)
    threading.Timer(0.2, fleet.finished, args=(routed,)).start()
    start = time.monotonic()
    fleet.drain(routed.replica, 5.0)  # what a rolling wave with wave="wait" does
    assert 0.15 < time.monotonic() - start < 4.0
    again = fleet.route([1, 2, 3], 1, 10, wait_s=0)
    fleet.board.set(again.replica, ReplicaState.UPDATING)
    start = time.monotonic()
    fleet.drain(again.replica, 0.3)  # the deadline ends a drain that does not
    assert 0.25 < time.monotonic() - start < 2.0
    fleet.board.quarantine(again.replica, "dead")  # one that left its wave: at once
    start = time.monotonic()
    fleet.drain(again.replica, 5.0)
    assert time.monotonic() - start < 1.0


def test_a_lost_request_runs_again_elsewhere_and_its_replica_is_held_out():
    fleet, (a, b) = _fleet(3, 3, heal=False)
    first = fleet.route([1] * 8, 2, 10, wait_s=0)
    lost, other = first.replica, 1 - first.replica
    [a, b][lost].fault = "dead: worker 1 exited"  # died with the request: quarantined
    again = fleet.rerun(first, "dead: worker 1 exited", [1] * 8, 2, 10, wait_s=0)
    assert again.replica == other
    assert fleet.board.state(lost) is ReplicaState.QUARANTINED
    loads = [s["load"] for s in fleet.fleet_state()]
    assert loads[lost] == 0 and loads[other] == again.load  # the lost lease was released
    with pytest.raises(NoReplicaError):  # no other replica left
        fleet.rerun(again, "dead", [1] * 8, 2, 10, wait_s=0)
    assert [s["load"] for s in fleet.fleet_state()] == [0, 0]


def test_a_request_its_replica_could_not_take_goes_elsewhere_and_the_replica_rejoins():
    fleet, (a, b) = _fleet(3, 3)
    first = fleet.route([2] * 8, 1, 10, wait_s=0)
    again = fleet.rerun(first, "unreachable (ConnectError)", [2] * 8, 1, 10, wait_s=0)
    assert again.replica != first.replica
    assert fleet.board.state(first.replica) is ReplicaState.SERVING  # skipped, not quarantined
    [a, b][first.replica].ok = True  # it answers again: routed to, no push needed
    fleet.finished(again)
    assert {fleet.route([i] * 8, 1, 50, wait_s=0).replica for i in range(4)} == {0, 1}
    assert a.sent_to == b.sent_to == []


def test_a_remote_replicas_health_is_its_latest_check_and_one_replica_each():
    """What `tandem router` makes of a replica's ``GET /health`` answers (recorded as they
    come back; no server needed to say what an answer means)."""
    replica = RemoteReplica("http://127.0.0.1:9", None, 10.0)
    assert not replica.health().ok and replica.health().reason == "not checked yet"
    late, early = time.monotonic(), time.monotonic() - 1
    replica.record(late, 200, {"status": "ok", "weight_version": 4, "replicas": [{}]}, None)
    replica.record(early, None, {}, "no answer")  # sent before the one recorded: dropped
    assert replica.health() == Health(ok=True, version=4)
    replica.record(time.monotonic(), 503, {"status": "unavailable", "reason": "torn"}, None)
    assert replica.health() == Health(ok=False, version=0, reason="torn")  # no version said
    replica.record(time.monotonic(), 200, {"status": "ok", "replicas": [{}, {}]}, None)
    health = replica.health()
    assert not health.ok and "--data-parallel-size" in health.reason
    assert health.fault is None  # held out, never quarantined for it
    replica.close()


class LaggingReplica(FakeReplica):
    """A replica over HTTP as the fleet sees it: the version its last health check read,
    until it is looked at again (`refresh`)."""

    def __init__(self, name: str, version: int = 0):
        super().__init__(name, version)
        self.seen = version

    def health(self) -> Health:
        health = super().health()
        return Health(health.ok, self.seen, health.fault, health.reason, health.updating)

    def refresh(self) -> None:
        self.seen = self._version


def test_a_replica_whose_record_lags_is_looked_at_again_before_it_is_held_out():
    """A health check read before a rolling wave reached the replica (its record says the
    old version) does not quarantine it: the fleet asks again first. One that is behind
    indeed is quarantined, saying so."""
    lagging = LaggingReplica("r1", 1)
    fleet = Fleet([FakeReplica("r0", 2), lagging], FleetSettings(stage_timeout_s=5.0, heal=False))
    lagging._version = 2  # its wave committed after the record was taken
    fleet.check()
    assert _states(fleet) == [("serving", 2), ("serving", 2)]
    behind = LaggingReplica("r1", 1)
    fleet = Fleet([FakeReplica("r0", 2), behind], FleetSettings(stage_timeout_s=5.0, heal=False))
    fleet.check()
    assert fleet.fleet_state()[1]["state"] == "quarantined"
    assert "serves version 1, the fleet 2" in fleet.fleet_state()[1]["reason"]
