"""A fleet: replicas behind one front (`tandem.llm.LLM`, `tandem serve`, `tandem router`),
each driven through the `Replica` protocol: an engine of this process (`LocalReplica`), or a
`tandem serve` or a ``vllm serve`` over HTTP (`tandem.fleet.remote`), all of one kind. The
fleet routes each request to one replica (`RoutingPolicy`, one ledger of what each replica
owes) among those the `ReplicaBoard` allows (serving, within ``max_staleness`` of the
newest version), and is one `WeightTarget` for pushes (`tandem.fleet.target`): one push
updates every replica, all at once or in rolling waves.

A replica that dies, hangs or fails a push is quarantined: requests go elsewhere (the front
runs again those it held and had not begun to answer), and with ``heal`` it comes back by
taking the weights of a live peer (`Replica.send_to`; restarted first, reading nothing from
disk, if its workers are gone). A replica found serving an older version than the others
outside a push (a server restarted on its checkpoint) is quarantined and healed the same way.
`add` grows a running fleet the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.fleet.board import NoReplicaError, ReplicaBoard, ReplicaState
from tandem.fleet.local import LocalReplica
from tandem.fleet.policy import Routed, RoutingPolicy
from tandem.fleet.remote import server_replica
from tandem.fleet.replica import Health, Replica
from tandem.fleet.target import FleetTarget

log = logging.getLogger(__name__)

# why a fleet is of one kind of replica
MIXED = (
    "a fleet's replicas are all of one kind (a replica heals, joins or takes a rolling wave "
    "from a peer's weights, and vLLM's and tandem's engines do not copy each other's)"
)
VERSION_POLL_S = 0.05  # `wait_for_version` looks again at least this often (a commit by a
# push with policy "all" changes versions without a board change)
DRAIN_POLL_S = 0.005


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """A fleet's own settings.

    ``stage_timeout_s``: how long a push's transport waits (trainers staging, the dist group,
    each transfer) before it fails the push, and how long a healing replica waits for a push
    under way; ``phase_timeout_s``: how long a replica may stay silent in a push phase before
    the fleet quarantines it and goes on (past the transport's waits and the hung-rank margin).
    ``max_staleness``: how many versions behind the newest a replica may serve requests (None:
    any). ``heal``: quarantined replicas heal from a peer. ``exchange_host``: where the
    fleet's exchange server listens for trainers.
    """

    stage_timeout_s: float = 300.0
    max_staleness: int | None = None
    heal: bool = True
    exchange_host: str = "127.0.0.1"

    def __post_init__(self):
        if not self.stage_timeout_s > 0:
            raise ValueError(f"the push phase timeout must be > 0 s, got {self.stage_timeout_s}")

    @property
    def phase_timeout_s(self) -> float:
        # a replica's ranks are declared hung min(30 s, stage) past the transport's waits;
        # the fleet stops waiting for the replica as long again after that
        return self.stage_timeout_s + 2 * min(30.0, self.stage_timeout_s)


class Fleet:
    """The replicas of one front. ``grow(index)`` starts a replica for `add_replica` (None:
    replicas are added by `add`, started by someone else)."""

    def __init__(
        self,
        replicas: list[Replica],
        settings: FleetSettings,
        grow: Callable[[int], Replica] | None = None,
    ):
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.replicas = list(replicas)
        self.settings = settings
        self._grow = grow
        self.timeout_s = settings.stage_timeout_s
        first = self.replicas[0]
        self.policy = RoutingPolicy(len(self.replicas), first.block, first.cache_blocks)
        self.lock = threading.Lock()  # the policy's, and the replica list's
        self.push_lock = threading.Lock()  # one push, or one replica healing, at a time
        self.board = ReplicaBoard(len(self.replicas), self._versions, settings.max_staleness)
        self.targets = [r.target for r in self.replicas]  # what a push updates
        self.target = (
            first.target
            if len(self.replicas) == 1
            else FleetTarget(
                self.targets,
                settings.exchange_host,
                self.board,
                drain=self.drain,
                # a wave written from a peer in place: both ends in this process
                pull=self._pull_now if all(r.in_process for r in self.replicas) else None,
                phase_timeout_s=settings.phase_timeout_s,
                stage_timeout_s=settings.stage_timeout_s,
                lock=self.push_lock,
                heal=self.heal_later if settings.heal else None,
            )
        )
        self.target.update_listeners.append(self._pushed)
        self._healing: set[int] = set()
        self._closed = False  # shut down: nothing heals any more
        # called with (index, replica) when a replica is new (restarted, or added), before it
        # takes requests: a server puts an engine thread on it
        self.replica_listeners: list[Callable[[int, Replica], None]] = []

    @classmethod
    def local(cls, config: EngineConfig) -> Fleet:
        """``config.parallel.data_parallel_size`` engines of this process (replica 0 first,
        the others side by side in the dtype it resolved)."""
        size = config.parallel.data_parallel_size
        first = LocalReplica(config, 0)
        # every replica, restarted or added ones too, runs the dtype the lead resolved
        config = config.model_copy(update={"dtype": first.engine.config.dtype})
        try:
            replicas = [first] + _start_others(config, size)
        except BaseException:
            first.close()
            raise
        parallel = config.parallel
        settings = FleetSettings(
            stage_timeout_s=parallel.push_phase_timeout_s,
            max_staleness=config.fleet.max_staleness,
            heal=config.fleet.heal,
            exchange_host=first.engine.config.exchange_host,
        )
        return cls(
            replicas, settings, grow=lambda index: LocalReplica(config, index, load_format="dummy")
        )

    @classmethod
    def remote(
        cls,
        urls: list[str],
        settings: FleetSettings,
        admin_key: str | None = None,
        check_timeout_s: float = 2.0,
    ) -> Fleet:
        """The `tandem serve` instances at ``urls`` (sharing ``admin_key``)."""
        if not urls:
            raise ValueError("a router needs at least one --replica URL")
        replicas = [
            server_replica(url, admin_key, settings.phase_timeout_s, check_timeout_s)
            for url in urls
        ]
        if len({r.name for r in replicas}) != len(replicas):
            raise ValueError(f"a replica is listed twice: {urls}")
        if len({r.kind for r in replicas}) > 1:
            named = ", ".join(f"{r.name}: {r.kind}" for r in replicas)
            raise ValueError(f"the replicas are of different kinds ({named}): {MIXED}")
        return cls(replicas, settings)

    # ----- the engines of a fleet of this process (the fronts that step them) -----
    @property
    def engines(self) -> list[LLMEngine]:
        return [r.engine for r in self.replicas]

    @property
    def lead(self) -> LLMEngine:
        """Replica 0's engine: its config, model spec and tokenizer are every replica's."""
        return self.replicas[0].engine

    def __len__(self) -> int:
        return len(self.replicas)

    def _versions(self) -> list[int]:
        return [r.version for r in list(self.replicas)]

    # ----- requests -----
    def route(
        self,
        units: list[int],
        samples: int,
        max_tokens: int,
        avoid: int | None = None,
        wait_s: float | None = None,
    ) -> Routed:
        """The replica for one request among those allowed now (waiting up to ``wait_s``,
        default the push deadline, while none is but one will be: a rolling wave, a replica
        joining); `NoReplicaError` if none can. ``units``: its prompt's token ids (or
        characters, for a fleet of remote replicas)."""
        healths = self.check()
        allowed = self.board.wait_allowed(self.timeout_s if wait_s is None else wait_s)
        allowed = [r for r in allowed if r >= len(healths) or healths[r].ok]
        if not allowed:
            raise NoReplicaError(f"no replica can take requests now ({self.why_none()})")
        if avoid is not None and len(allowed) > 1:
            allowed = [r for r in allowed if r != avoid]
        with self.lock:
            return self.policy.route(units, samples, max_tokens, allowed)

    def finished(self, routed: Routed) -> None:
        with self.lock:
            self.policy.finished(routed)

    def rerun(
        self,
        lost: Routed | int,
        reason: str,
        units: list[int],
        samples: int,
        max_tokens: int,
        wait_s: float | None = None,
    ) -> Routed:
        """Where a request goes that its replica lost (it died, was torn, or could not be
        reached) before any of it went out to its client: the one rule every front follows.
        The replica is held out (`Replica.lost`: quarantined to heal, or a remote one skipped
        until it answers), the request's lease released (``lost`` as `route` gave it; a
        replica number where the front released it), and the request routed among the
        others (as `route`). `NoReplicaError` if none can take it: the front ends it, naming
        the lost replica."""
        replica = lost.replica if isinstance(lost, Routed) else lost
        if isinstance(lost, Routed):
            self.finished(lost)
        self.hold_out(replica, reason)
        if len(self.replicas) == 1:
            raise NoReplicaError(f"{self.replicas[0].name} was lost: {reason}")
        return self.route(units, samples, max_tokens, avoid=replica, wait_s=wait_s)

    def hold_out(self, replica: int, reason: str) -> None:
        """``replica`` failed a request: quarantined (and healed), or, where it only could
        not be reached, skipped until it answers again. One already out (quarantined,
        healing) is left to its heal."""
        if not self.replicas[replica].lost(reason) or len(self.replicas) == 1:
            return
        if self.board.state(replica) in (ReplicaState.SERVING, ReplicaState.UPDATING):
            self.board.quarantine(replica, reason)
            self.heal_later(replica)

    def why_none(self) -> str:
        reasons = zip(self.replicas, self._why_not(), strict=False)
        return "; ".join(f"{r.name}: {why}" for r, why in reasons if why is not None) or (
            self.board.why_none()
        )

    def _why_not(self) -> list[str | None]:
        out = []
        for r, replica in enumerate(list(self.replicas)):
            health, state = replica.health(), self.board.state(r)
            if state is not ReplicaState.SERVING:
                reason = self.board.reason(r)
                out.append(f"{state.value}" + (f": {reason}" if reason else ""))
            else:
                out.append(None if health.ok else health.reason)
        return out

    # ----- keeping the fleet whole -----
    def check(self) -> list[Health]:
        """Quarantine every replica found dead or torn, or serving an older version than the
        others outside a push (restarted on its checkpoint); heal the quarantined ones that
        can be (restarted, or answering again). Each replica's health, in replica order."""
        replicas = list(self.replicas)
        healths = [r.health() for r in replicas]
        if len(replicas) == 1:  # no peer: its own state says why it refuses requests
            return healths
        for r, health in enumerate(healths):
            in_use = self.board.state(r) in (ReplicaState.SERVING, ReplicaState.UPDATING)
            if health.fault is not None and in_use:
                self.board.quarantine(r, health.fault)
        if self.push_lock.acquire(blocking=False):  # a push holds versions apart on purpose
            try:
                live = [
                    r
                    for r, h in enumerate(healths)
                    if h.ok and self.board.state(r) is ReplicaState.SERVING
                ]
                newest = max((healths[r].version for r in live), default=None)
                for r in live:
                    if healths[r].version < newest:
                        # looked at again first: a record taken before a push's commit reached
                        # the replica (a rolling wave's) may lag what it serves now
                        replicas[r].refresh()
                        healths[r] = replicas[r].health()
                        if healths[r].ok and healths[r].version < newest:
                            self.board.quarantine(
                                r,
                                f"serves version {healths[r].version}, the fleet {newest} "
                                "(restarted?)",
                            )
            finally:
                self.push_lock.release()
        for r, health in enumerate(healths):
            if self.board.state(r) is ReplicaState.QUARANTINED and (
                health.ok or health.fault is not None
            ):  # a remote replica that does not answer heals once it does
                self.heal_later(r)
        return healths

    @contextmanager
    def holding_pushes(self):
        """No push (nor heal) runs meanwhile: for controls that change every replica's
        version together (`reload_weights`), so no replica is seen behind the others."""
        if not self.push_lock.acquire(timeout=self.timeout_s):
            raise TimeoutError(f"waited {self.timeout_s:g} s for the push under way to end")
        try:
            yield
        finally:
            self.push_lock.release()

    def _pushed(self, version: int, seconds: float, error: str | None) -> None:
        """After every push, before its trainers are answered: each replica looked at again
        (the versions the push left, not the last check's); a push emptied the replicas'
        prefix caches; the replicas it quarantined heal."""
        self._each_replica(lambda r: r.refresh())
        self.forget_prefixes()
        self.check()

    def forget_prefixes(self) -> None:
        """The replicas' prefix caches were reset: route as if nothing is cached."""
        with self.lock:
            self.policy.forget()

    def _pull_now(self, peer: int, replica: int) -> None:
        """An in-place rolling wave: ``peer``'s weights into ``replica`` (out of routing)."""
        self.replicas[peer].send_to(self.replicas[replica], self.timeout_s)
        with self.lock:
            self.policy.forget(replica)

    def drain(self, replica: int, timeout_s: float) -> None:
        """Return once ``replica`` runs no request (a rolling wave's ``wait``), or has left
        its wave: dead (its requests run again elsewhere) or quarantined."""
        deadline = time.monotonic() + timeout_s
        member = self.replicas[replica]
        while time.monotonic() < deadline:
            busy = member.busy()
            if busy is None:  # what the front sent it, by the ledger
                with self.lock:
                    busy = self.policy.loads[replica] > 0
            if not busy:
                return
            if member.health().fault or self.board.state(replica) is not ReplicaState.UPDATING:
                return
            time.sleep(DRAIN_POLL_S)

    def heal_later(self, replica: int) -> None:
        """`heal` on a thread of its own, unless asked not to or already under way."""
        if not self.settings.heal or self._closed:
            return
        with self.lock:
            if replica in self._healing:
                return
            self._healing.add(replica)

        def run() -> None:
            try:
                self.heal(replica)
            except Exception as exc:  # it stays quarantined, saying why
                log.warning("replica %d could not be healed: %s", replica, exc, exc_info=True)
            finally:
                with self.lock:
                    self._healing.discard(replica)

        threading.Thread(target=run, name=f"tandem-heal-{replica}", daemon=True).start()

    def heal(self, replica: int) -> dict:
        """Bring ``replica`` back: restarted (reading nothing from disk) if its workers are
        gone, then filled with the weights of the live peer at the newest version, checked,
        and only then given requests again; ``{replica, peer, version}``. Raises if it
        cannot; it stays quarantined."""
        if len(self.replicas) < 2:
            raise ValueError("a fleet of one replica has no peer to heal from")
        reason = self.board.reason(replica)
        member = self.replicas[replica]
        member.refresh()  # workers that exited while it sat quarantined
        if not (health := member.health()).ok and health.fault is None:
            # a remote replica that does not answer: quarantined until a check finds it up
            raise RuntimeError(f"{member.name} cannot be healed yet: {health.reason}")
        self.board.set(replica, ReplicaState.JOINING, reason)  # why it heals
        try:
            fresh = member.restarted()
            if fresh is not None:
                with self.lock:
                    if self._closed:  # shut down meanwhile: leave nothing behind
                        fresh.close()
                        raise RuntimeError("the fleet was shut down")
                    self.replicas[replica] = fresh
                    self.targets[replica] = fresh.target
                for listener in self.replica_listeners:
                    listener(replica, fresh)
            return self._pull(replica)
        except Exception as exc:
            self.board.quarantine(replica, f"{reason}; healing failed: {exc}")
            raise

    def add_replica(self) -> int:
        """Grow the fleet by one replica of this process (elastic scale-out): started reading
        nothing from disk, filled from a live peer like a healed replica, then routed to."""
        if self._grow is None or len(self.replicas) < 2:
            raise ValueError(
                "add_replica needs a fleet: start the LLM with data_parallel_size >= 2"
            )
        return self.add(self._grow(len(self.replicas)))["replica"]

    def add(self, replica: Replica) -> dict:
        """Grow the fleet by ``replica`` (the same model; a remote one with the fleet's admin
        key): it takes the fleet's weights from a live peer, then requests;
        ``{replica, peer, version}``. Raises ValueError if it cannot join."""
        with self.lock:
            if replica.name in [r.name for r in self.replicas]:
                replica.close()
                raise ValueError(f"{replica.name} is already a replica")
            if replica.kind != self.replicas[0].kind:
                replica.close()
                raise ValueError(
                    f"{replica.name} is a {replica.kind}, the fleet's replicas are each a "
                    f"{self.replicas[0].kind}: {MIXED}"
                )
            index = self.board.add(ReplicaState.JOINING)
            if index != len(self.replicas):
                raise RuntimeError("replicas were added at the same time")
            self.policy.add_replica()
            self.replicas.append(replica)
            self.targets.append(replica.target)
        for listener in self.replica_listeners:
            listener(index, replica)
        replica.refresh()
        if not (health := replica.health()).ok:
            self.board.quarantine(index, health.reason or "unhealthy")
            raise ValueError(f"{replica.name} is not healthy: {health.reason}")
        try:
            return self._pull(index)
        except Exception as exc:
            self.board.quarantine(index, f"joining failed: {exc}")
            raise

    def _pull(self, replica: int) -> dict:
        """``replica`` (joining) takes the newest serving peer's weights; then it serves."""
        # no push writes the peer's weights while they are read: a push under way (a rolling
        # one, its waves bounded by their deadlines) ends first
        if not self.push_lock.acquire(timeout=self.timeout_s):
            raise TimeoutError(
                f"replica {replica} waited {self.timeout_s:g} s for the push "
                "under way to end; it heals on the next check"
            )
        try:
            healths = [r.health() for r in self.replicas]
            peers = [r for r in self.board.allowed() if r != replica and healths[r].ok]
            if not peers:
                raise NoReplicaError(f"no live peer to pull from: {self.why_none()}")
            peer = max(peers, key=lambda r: (healths[r].version, -r))
            member = self.replicas[replica]
            version = self.replicas[peer].send_to(member, self.timeout_s)
            member.refresh()
            if (mode := self.replicas[peer].paused()) is not None:  # paused as the fleet is
                member.pause(mode)
            with self.lock:
                self.policy.forget(replica)
            self.board.set(replica, ReplicaState.SERVING)
        finally:
            self.push_lock.release()
        log.info("replica %d serves version %d, pulled from replica %d", replica, version, peer)
        return {"replica": replica, "peer": peer, "version": version}

    # ----- the fleet as a whole -----
    def each(self, call) -> list:
        """``call(engine)`` on every replica's engine at once; their results in replica order
        (the first error is raised once all returned)."""
        return self._each_replica(lambda r: call(r.engine))

    def _each_replica(self, call) -> list:
        replicas = list(self.replicas)
        if len(replicas) == 1:
            return [call(replicas[0])]
        with ThreadPoolExecutor(len(replicas)) as pool:
            futures = [pool.submit(call, r) for r in replicas]
        return [f.result() for f in futures]

    def exchange_server(self):
        """Where trainers push: the lone replica's own exchange server, or the fleet's (one
        push updates every replica)."""
        return self.target.exchange_server()

    @property
    def update_listeners(self) -> list:
        """Called after every push into the fleet (`tandem.exchange.WeightTarget`)."""
        return self.target.update_listeners

    @property
    def weight_version(self) -> int:
        """The newest version a serving replica serves."""
        return self.board.newest()

    def worker_locations(self) -> list[dict]:
        return [
            {**loc, "replica": r}
            for r, engine in enumerate(self.engines)
            for loc in engine.worker_locations()
        ]

    def fleet_state(self) -> list[dict]:
        """Each replica: ``{replica, state, version, load}`` (state: serving, updating,
        quarantined, joining), with ``reason`` when quarantined, ``rolling_to`` while a
        rolling push has not reached it, and what its kind adds (a remote one's ``url``):
        `report` less what only a health check shows."""
        out = []
        for entry in self.report():
            reason = entry.pop("reason")
            del entry["status"], entry["requests"]
            if entry["state"] == "quarantined":
                entry["reason"] = reason
            out.append(entry)
        return out

    def report(self) -> list[dict]:
        """The one state report, of which `fleet_state`, ``/fleet_state`` and the replicas of
        ``/health`` (`tandem serve`, `tandem router`) are views: each replica's ``{replica,
        state, version, load, requests, status, reason}`` (status ok, or unavailable with the
        reason), ``rolling_to`` while a rolling push has not reached it, and what its kind
        adds (a remote one's ``url``)."""
        healths = self.check()
        with self.lock:
            loads, requests = list(self.policy.loads), list(self.policy.requests)
        states = self.board.snapshot()
        rolling_to = self.board.rolling_to
        out = []
        for r, replica in enumerate(list(self.replicas)):
            status, health = states[r], healths[r] if r < len(healths) else replica.health()
            state = status.state.value
            if status.state is ReplicaState.SERVING and health.updating:
                state = "updating"  # policy "all": every replica's window is open
            if status.state in (ReplicaState.QUARANTINED, ReplicaState.JOINING):
                reason = status.reason or state
            else:
                reason = health.reason
            entry = {
                "replica": r,
                **replica.report(),
                "state": state,
                "version": health.version,
                "load": loads[r],
                "requests": requests[r],
                "status": "ok" if reason is None else "unavailable",
                "reason": reason,
            }
            if rolling_to is not None and health.version < rolling_to:
                entry["rolling_to"] = rolling_to
            out.append(entry)
        return out

    def wait_for_version(self, version: int, timeout_s: float | None = None) -> None:
        """Until every serving replica serves ``version`` or newer (see `LLM`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.check()  # a replica dead meanwhile serves nothing: not waited for
            states, versions = self.board.snapshot(), self._versions()
            # a replica in its wave serves again once committed: it is waited for; one
            # quarantined or joining heals to the newest version and is not
            serving = [
                versions[r]
                for r, s in enumerate(states)
                if s.state in (ReplicaState.SERVING, ReplicaState.UPDATING)
            ]
            if serving and min(serving) >= version:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                now = ", ".join(
                    f"replica {r} {s['state']} at {s['version']}"
                    for r, s in enumerate(self.fleet_state())
                )
                raise TimeoutError(
                    f"not every serving replica serves version {version} after "
                    f"{timeout_s:g} s: {now}"
                )
            with self.board.changed:
                self.board.changed.wait(
                    VERSION_POLL_S if left is None else min(left, VERSION_POLL_S)
                )

    def shutdown(self) -> None:
        with self.lock:
            self._closed = True
        if self.target is not self.replicas[0].target:
            self.target.close()
        for replica in self.replicas:
            replica.close()


def _start_others(config: EngineConfig, size: int) -> list[Replica]:
    """Replicas 1 .. size-1 side by side (each waits on its own workers; what a process sets
    up once, such as joining a Ray cluster, replica 0 has done); if any fails, the others are
    shut down and the first error raised."""
    if size == 1:
        return []
    with ThreadPoolExecutor(size - 1) as pool:
        futures = [pool.submit(LocalReplica, config, r) for r in range(1, size)]
    replicas, errors = [], []
    for f in futures:
        try:
            replicas.append(f.result())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        for replica in replicas:
            replica.close()
        raise errors[0]
    return replicas
