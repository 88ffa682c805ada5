"""A fleet: ``data_parallel_size`` independent engines (each its own tensor x pipeline worker
processes) behind one front. The front routes each request to one replica (`RoutingPolicy`) among
those the `ReplicaBoard` allows (serving, within ``max_staleness`` of the newest version),
drives every replica with work on a thread of its own, fans the RL controls out to all of
them, and is one `WeightTarget` for pushes (`tandem.fleet.target`): one push updates
every replica, all at once or in rolling waves.

A replica that dies, hangs or fails a push is quarantined: requests go elsewhere (those it
held and had not finished run again on another replica), and with ``heal`` it comes back by
pulling the weights from a live peer (`tandem.fleet.peer`; restarted first, reading
nothing from disk, if its workers are gone). `add_replica` grows a running fleet the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.executor import EngineDeadError
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineState
from tandem.fleet.board import NoReplicaError, ReplicaBoard, ReplicaState
from tandem.fleet.peer import push_from_peer
from tandem.fleet.policy import Routed, RoutingPolicy
from tandem.fleet.target import FleetTarget

log = logging.getLogger(__name__)

FAULTS = (EngineState.DEAD, EngineState.TORN)  # what quarantines a replica
VERSION_POLL_S = 0.05  # `wait_for_version` looks again at least this often (a commit by a
# push with policy "all" changes versions without a board change)


class Fleet:
    """The replicas of an `LLM` with ``data_parallel_size`` > 1, or of a `tandem serve` (one
    replica there: a fleet of one under `AsyncFleet`; an `LLM` of one replica is its engine)."""

    def __init__(self, config: EngineConfig):
        replicas = config.parallel.data_parallel_size
        self.config = config
        configs = [self.replica_config(r) for r in range(replicas)]
        if replicas == 1:
            self.engines = [LLMEngine(configs[0])]
        else:
            self.engines = _start_all(configs)
        lead = self.engines[0]
        self.targets = [engine.target for engine in self.engines]  # what a push updates
        # every replica, restarted or added ones too, runs the dtype the lead resolved
        self.config = config.model_copy(update={"dtype": lead.config.dtype})
        self.router = RoutingPolicy(
            replicas, lead.config.cache.block_size, lead.stats().kv_blocks_total
        )
        self.lock = threading.Lock()  # the router's, and the replica list's
        self.board = ReplicaBoard(replicas, self._versions, config.parallel.max_staleness)
        self.timeout_s = config.parallel.push_phase_timeout_s
        self.target = (
            lead.target
            if replicas == 1
            # what pushes update: the transport's waits end first (timeout_s), then a replica's
            # ranks are declared hung (hung_after_s), then the fleet stops waiting for it
            else FleetTarget(
                self.targets,
                lead.config.exchange_host,
                self.board,
                drain=self._drain,
                pull=self._pull_now,
                phase_timeout_s=2 * config.parallel.hung_after_s - self.timeout_s,
                stage_timeout_s=self.timeout_s,
            )
        )
        self.target.update_listeners.append(self._pushed)
        self._healing: set[int] = set()
        self._closed = False  # shut down: nothing heals any more
        # called with (replica, engine) when a replica's engine is new (restarted, or added),
        # before it takes requests: a server puts its engine thread on it
        self.replica_listeners: list = []

    def replica_config(self, replica: int, load_format: str = "auto") -> EngineConfig:
        parallel = self.config.parallel
        size = max(parallel.data_parallel_size, replica + 1)
        return self.config.model_copy(update={"load_format": load_format,
                                              "parallel": parallel.model_copy(update={
            "data_parallel_rank": replica, "data_parallel_size": size})})  # fmt: skip

    @property
    def lead(self) -> LLMEngine:
        """Replica 0: its config, model spec and tokenizer are every replica's."""
        return self.engines[0]

    def _versions(self) -> list[int]:
        return [engine.weight_version for engine in self.engines]

    def route(self, prompt_ids: list[int], samples: int, max_tokens: int,
              avoid: int | None = None, wait_s: float | None = None) -> Routed:  # fmt: skip
        """The replica for one request among those allowed now (waiting up to ``wait_s``,
        default the push deadline, while none is but one will be: a rolling wave, a replica
        joining); `NoReplicaError` if none can."""
        self.check_replicas()
        allowed = self.board.wait_allowed(self.timeout_s if wait_s is None else wait_s)
        if avoid is not None and len(allowed) > 1:
            allowed = [r for r in allowed if r != avoid]
        with self.lock:
            return self.router.route(prompt_ids, samples, max_tokens, allowed)

    def finished(self, routed: Routed) -> None:
        with self.lock:
            self.router.finished(routed)

    def check_replicas(self) -> None:
        """Quarantine every replica found dead or torn (and heal it, if asked). A fleet of
        one has no other replica: its engine's own state says why it refuses requests."""
        if len(self.engines) == 1:
            return
        for r, engine in enumerate(list(self.engines)):
            if self.board.state(r) in (ReplicaState.SERVING, ReplicaState.UPDATING):
                engine.check_health()  # a worker gone while idle
                if engine.state in FAULTS:
                    self.board.quarantine(r, engine.unavailable() or engine.state.value)
            if self.board.state(r) is ReplicaState.QUARANTINED:
                self.heal_later(r)

    def _pushed(self, version: int, seconds: float, error: str | None) -> None:
        """A push emptied the replicas' prefix caches (`LLMEngine.weight_update`); replicas
        it quarantined are healed."""
        self.forget_prefixes()
        self.check_replicas()

    def forget_prefixes(self) -> None:
        """The replicas' prefix caches were reset: route as if nothing is cached."""
        with self.lock:
            self.router.forget()

    def _pull_now(self, peer: int, replica: int) -> None:
        """An in-place rolling wave: ``peer``'s weights into ``replica`` (out of routing)."""
        push_from_peer(self.engines[peer], self._address(replica), self.timeout_s)
        with self.lock:
            self.router.forget(replica)

    def _address(self, replica: int) -> str:
        return self.engines[replica].target.exchange_server().address

    def _drain(self, replica: int, timeout_s: float) -> None:
        """Return once ``replica`` runs no request (a rolling wave's ``wait``), or has left
        its wave: dead (its requests run again elsewhere) or quarantined."""
        deadline = time.monotonic() + timeout_s
        engine = self.engines[replica]
        while engine.has_unfinished() and time.monotonic() < deadline:
            if engine.state in FAULTS or self.board.state(replica) is not ReplicaState.UPDATING:
                return
            time.sleep(0.005)

    def heal_later(self, replica: int) -> None:
        """`heal` on a thread of its own, unless asked not to or already under way."""
        if not self.config.parallel.heal or self._closed:
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

    def heal(self, replica: int) -> None:
        """Bring ``replica`` back: restarted (reading nothing from disk) if its workers are
        gone, then filled with the weights of the live peer at the newest version, checked,
        and only then given requests again. Raises if it cannot; it stays quarantined."""
        if not isinstance(self.target, FleetTarget):
            raise ValueError("a fleet of one replica has no peer to heal from")
        reason = self.board.reason(replica)
        self.board.set(replica, ReplicaState.JOINING, reason)  # why it heals
        try:
            engine = self.engines[replica]
            engine.check_health()  # workers that exited while it sat quarantined
            if engine.state is EngineState.DEAD:
                engine.shutdown()
                engine = LLMEngine(self.replica_config(replica, "dummy"))
                with self.lock:
                    if self._closed:  # shut down meanwhile: leave nothing behind
                        engine.shutdown()
                        raise RuntimeError("the fleet was shut down")
                    self.engines[replica] = engine
                    self.targets[replica] = engine.target
                for listener in self.replica_listeners:
                    listener(replica, engine)
            self._pull(replica)
        except Exception as exc:
            self.board.quarantine(replica, f"{reason}; healing failed: {exc}")
            raise

    def add_replica(self) -> int:
        """Grow the fleet by one replica (elastic scale-out): started reading nothing from
        disk, filled from a live peer like a healed replica, then routed to. Its number."""
        if not isinstance(self.target, FleetTarget):
            raise ValueError("add_replica needs a fleet: start the LLM with "
                             "data_parallel_size >= 2")  # fmt: skip
        replica = len(self.engines)
        engine = LLMEngine(self.replica_config(replica, "dummy"))
        with self.lock:
            if self.board.add(ReplicaState.JOINING) != replica:
                raise RuntimeError("replicas were added at the same time")
            self.router.add_replica()
            self.engines.append(engine)
            self.targets.append(engine.target)
        for listener in self.replica_listeners:
            listener(replica, engine)
        try:
            self._pull(replica)
        except Exception as exc:
            self.board.quarantine(replica, f"joining failed: {exc}")
            raise
        return replica

    def _pull(self, replica: int) -> None:
        """``replica`` (joining) takes the newest serving peer's weights; then it serves."""
        # no push writes the peer's weights while they are read: a push under way (a rolling
        # one, its waves bounded by their deadlines) ends first
        if not self.target.lock.acquire(timeout=self.timeout_s):
            raise TimeoutError(f"replica {replica} waited {self.timeout_s:g} s for the push "
                               "under way to end; it heals on the next check")  # fmt: skip
        try:
            versions = self._versions()
            peers = [r for r in self.board.allowed() if r != replica]
            if not peers:
                raise NoReplicaError(f"no live peer to pull from: {self.board.why_none()}")
            peer = max(peers, key=lambda r: (versions[r], -r))
            push_from_peer(self.engines[peer], self._address(replica), self.timeout_s)
            if (mode := self.engines[peer].controls.paused) is not None:  # paused as the fleet is
                self.engines[replica].controls.pause(mode)
            with self.lock:
                self.router.forget(replica)
            self.board.set(replica, ReplicaState.SERVING)
        finally:
            self.target.lock.release()
        log.info("replica %d serves version %d, pulled from replica %d", replica,
                 self.engines[replica].weight_version, peer)  # fmt: skip

    def run(self, work: dict[int, list[Sequence]]) -> dict[int, str]:
        """Step each replica until its sequences in ``work`` (replica -> sequences, queued
        there) are finished: the first in this thread, the others each on a thread of its own.
        A replica that dies meanwhile is quarantined and its unfinished sequences left for the
        caller to run elsewhere: the replicas lost so far -> why. Any other error (or the
        death of a fleet's only replica) is raised once every replica stopped."""
        items = [(r, seqs) for r, seqs in sorted(work.items()) if seqs]
        errors: list[BaseException] = []
        lost: dict[int, str] = {}

        def drive(r: int, seqs: list[Sequence]) -> None:
            try:
                _drive(self.engines[r], seqs)
            except EngineDeadError as exc:
                if len(self.engines) == 1:
                    errors.append(exc)
                    return
                lost[r] = str(exc)
                self.board.quarantine(r, str(exc))
                self.heal_later(r)
            except BaseException as exc:
                errors.append(exc)
                for other, mine in work.items():  # the caller gets its error now, not after all
                    self.engines[other].abort([s for s in mine if not s.finished])

        threads = [threading.Thread(target=drive, args=item, name=f"tandem-replica-{item[0]}",
                                    daemon=True) for item in items[1:]]  # fmt: skip
        for t in threads:
            t.start()
        if items:
            drive(*items[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return lost

    def each(self, call) -> list:
        """``call(engine)`` on every replica at once; their results in replica order (the
        first error is raised once all returned)."""
        if len(self.engines) == 1:
            return [call(self.engines[0])]
        with ThreadPoolExecutor(len(self.engines)) as pool:
            futures = [pool.submit(call, engine) for engine in self.engines]
        return [f.result() for f in futures]

    def exchange_server(self):
        """Where trainers push: the engine's own exchange server, or with several replicas
        the fleet's (one push updates every replica)."""
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
        return [{**loc, "replica": r}
                for r, engine in enumerate(self.engines)
                for loc in engine.worker_locations()]  # fmt: skip

    def fleet_state(self) -> list[dict]:
        self.check_replicas()
        with self.lock:
            loads = list(self.router.loads)
        states = self.board.snapshot()
        rolling_to = self.board.rolling_to
        out = []
        for r, engine in enumerate(self.engines):
            state = states[r].state.value
            if states[r].state is ReplicaState.SERVING and engine.controls.lifecycle.updating:
                state = "updating"  # policy "all": every replica's window is open
            entry = {"replica": r, "state": state, "version": engine.weight_version,
                     "load": loads[r]}  # fmt: skip
            if states[r].reason and states[r].state is ReplicaState.QUARANTINED:
                entry["reason"] = states[r].reason
            if rolling_to is not None and engine.weight_version < rolling_to:
                entry["rolling_to"] = rolling_to
            out.append(entry)
        return out

    def wait_for_version(self, version: int, timeout_s: float | None = None) -> None:
        """Until every serving replica serves ``version`` or newer (see `LLM`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.check_replicas()  # a replica dead meanwhile serves nothing: not waited for
            states, versions = self.board.snapshot(), self._versions()
            # a replica in its wave serves again once committed: it is waited for; one
            # quarantined or joining heals to the newest version and is not
            serving = [versions[r] for r, s in enumerate(states)
                       if s.state in (ReplicaState.SERVING, ReplicaState.UPDATING)]  # fmt: skip
            if serving and min(serving) >= version:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                now = ", ".join(f"replica {r} {s['state']} at {s['version']}"
                                for r, s in enumerate(self.fleet_state()))  # fmt: skip
                raise TimeoutError(f"not every serving replica serves version {version} after "
                                   f"{timeout_s:g} s: {now}")  # fmt: skip
            with self.board.changed:
                self.board.changed.wait(
                    VERSION_POLL_S if left is None else min(left, VERSION_POLL_S)
                )

    def shutdown(self) -> None:
        with self.lock:
            self._closed = True
        if self.target is not self.lead.target:
            self.target.close()
        for engine in self.engines:
            engine.shutdown()


def _start_all(configs: list[EngineConfig]) -> list[LLMEngine]:
    """Start replica 0, then the others side by side in the dtype it resolved (each waits on
    its own workers; what a process sets up once, such as joining a Ray cluster, the first one
    has done); if any fails, the others are shut down and the first error raised."""
    first = LLMEngine(configs[0])
    same = {"dtype": first.config.dtype}  # "auto" resolved once: one dtype per fleet
    with ThreadPoolExecutor(len(configs) - 1) as pool:
        futures = [pool.submit(LLMEngine, c.model_copy(update=same)) for c in configs[1:]]
    engines, errors = [first], []
    for f in futures:
        try:
            engines.append(f.result())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        for engine in engines:
            engine.shutdown()
        raise errors[0]
    return engines


def _drive(engine: LLMEngine, seqs: list[Sequence]) -> None:
    engine.run(seqs)  # the engine's stepping thread runs them, other callers' beside
