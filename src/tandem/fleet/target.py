"""A fleet of engines as one `WeightTarget`: one push updates every replica that can take it.

The fleet's receiving ranks are its member replicas' ranks (`ReplicaBoard.members`: neither
quarantined nor joining) numbered one after another, each layout saying its replica
(`RankLayout.replica`), so the planner sends every byte once and relays it from replica to
replica (`tandem.exchange.plan.plan_fleet`). Each phase runs on every replica at once (a relay
needs both of its ends), under a deadline.

A replica that dies, hangs past the deadline or fails a phase while others pass it is
quarantined and the push goes on without it (`FleetUpdate.failures` says which and why); when
every replica fails the same phase before any commit, the senders' bytes are at fault and the
whole fleet keeps the version it serves. ``policy="all"`` commits every replica together;
``policy="rolling"`` has each replica hold the new version (`PushPhase.HOLD`) and go back to
serving the old one, then commits the replicas in waves of at most ``max_unavailable``, each
wave out of the router's choice (and drained first with ``wave="wait"``) while the others
serve.

In place (``mode="in_place"``), only with ``policy="rolling"``: the senders write the first
wave's live weights (the push is planned over those replicas alone), which then serve the new
version; each later wave is written from a replica of the first (``pull``: a live replica in
the trainer's role, `tandem.fleet.peer`), one wave at a time, out of the router's choice
while written. A replica torn by its wave is quarantined and heals from a peer.

A delta push (`tandem.exchange.delta`) goes to the member replicas that hold the trainers'
base; one that does not (its weights came from elsewhere) is left out of it and, once it
lands, quarantined and healed: a dense copy from a replica that took it (``heal``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import PushPhase, PushSettings, UpdateSpec
from tandem.exchange.target import UpdateListener, UpdateWindow
from tandem.fleet.board import ReplicaBoard, ReplicaState

DRAIN_MARGIN_S = 5.0  # past a drain's own deadline, its wave stops waiting for it
# drain(replica, timeout_s): return once the replica runs no request, has left the wave
# (quarantined) or the time is up
Drain = Callable[[int, float], None]
# pull(peer, replica): write the peer's weights into the replica's (which serves nothing)
Pull = Callable[[int, int], None]


class FleetTarget:
    """The replicas of one fleet as a push target: each a `WeightTarget` of its own (an
    engine's `EngineTarget`, or a `tandem serve` behind `tandem router`). ``host``: where the
    fleet's exchange server listens for trainers. ``board``: the replicas' states, shared with
    the front's router. ``drain``: how a rolling wave waits for its requests (None: it does not).
    ``phase_timeout_s``: how long one phase may take on a replica before it is quarantined.
    ``pull``: how a replica takes a peer's weights (None: in-place rolling pushes are
    refused). ``stage_timeout_s``: the exchange server's (trainers staging, the dist group).
    ``lock``: the fleet's, held through each push (a replica healing from a peer holds it too,
    so no push writes the peer's weights while they are read). ``heal(replica)``: bring a
    quarantined replica back from a peer, later (None: a delta push goes dense to every
    replica unless all hold its base).

    The exchange server asks `refuses` first for every push, then `weight_layouts`, then
    opens `weight_update`: the settings `refuses` saw choose the replicas planned over."""

    def __init__(
        self,
        replicas: list,
        host: str = "127.0.0.1",
        board: ReplicaBoard | None = None,
        drain: Drain | None = None,
        phase_timeout_s: float = 600.0,
        pull: Pull | None = None,
        stage_timeout_s: float = 600.0,
        lock: threading.Lock | None = None,
        heal: Callable[[int], None] | None = None,
    ):
        self.replicas = replicas  # the fleet's own list: a restarted replica's target replaces
        self.host = host
        self.board = board or ReplicaBoard(
            len(replicas), lambda: [r.weight_version for r in replicas]
        )
        self.drain = drain
        self.pull = pull
        self.stage_timeout_s = stage_timeout_s
        self.phase_timeout_s = phase_timeout_s
        self.heal = heal
        self._settings: PushSettings | None = None  # of the push being planned
        # of the push being planned: member replicas left out of it (off a delta's base), and
        # why (they heal once it lands)
        self._aside: dict[int, str] = {}
        self._lock = lock or threading.Lock()  # one push (or one replica healing) at a time
        self.update_listeners: list[UpdateListener] = []
        self._exchange = None
        self._first_ranks: dict[int, int] = {}  # member replica -> its rank 0, fleet-wide

    def exchange_server(self):
        if self._exchange is None:
            from tandem.exchange.server import ExchangeServer

            self._exchange = ExchangeServer(
                self, host=self.host, stage_timeout_s=self.stage_timeout_s
            )
        return self._exchange

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()

    @property
    def weight_version(self) -> int:
        """The newest version any replica holds: a push without a version gets the next one,
        so versions never run backwards when a replica is lost."""
        return max(replica.weight_version for replica in self.replicas)

    @property
    def weight_base(self) -> str | None:
        """The push every member replica's weights came from, if they all hold the same (a
        delta then goes to all of them, relayed like any push); else None: a delta goes to
        those holding its base (`plan_over_base`), or dense to all."""
        bases = {self.replicas[r].weight_base for r in self.board.members()}
        return bases.pop() if len(bases) == 1 else None

    def plan_over_base(self, base: str) -> bool:
        """`tandem.exchange.target.ReplicatedTarget`: the push being planned goes to the
        member replicas holding push ``base``'s weights; the others heal once it lands."""
        if self.heal is None:
            return False
        members = self.board.members()
        bases = {r: self.replicas[r].weight_base for r in members}
        if base not in bases.values():
            return False
        self._aside = {
            r: "weights of another origin" if held is None else f"the weights of push {held}"
            for r, held in bases.items()
            if held != base
        }
        return True

    def _members(self) -> list[int]:
        """The member replicas the push being planned goes to."""
        return [r for r in self.board.members() if r not in self._aside]

    @property
    def weight_dtype(self) -> str:
        return self.replicas[0].weight_dtype

    @property
    def weight_device_type(self) -> str:
        return self.replicas[0].weight_device_type

    @property
    def receivers_in_process(self) -> bool:
        return any(replica.receivers_in_process for replica in self.replicas)

    def refuses(self, settings: PushSettings) -> str | None:
        self._settings, self._aside = settings, {}
        if settings.adapter is not None:
            return "a fleet takes no LoRA adapter pushes yet (data_parallel_size > 1)"
        if settings.in_place and not settings.rolling:
            return (
                "mode='in_place' into a fleet needs policy='rolling' (one wave written at a "
                "time, the others serving); policy='all' stages: every replica verifies "
                "the new version before any commits it"
            )
        if settings.in_place and self.pull is None:
            return (
                "mode='in_place' rolls from replica to replica, which needs the replicas' "
                "weights in reach of this process: push staged"
            )
        members = self.board.members()
        if not members:
            return self.board.why_none()
        for r in members:
            if (why := self.replicas[r].refuses(settings)) is not None:
                return f"replica {r}: {why}"
        return None

    def weight_layouts(self) -> list[RankLayout]:
        """Every member replica's ranks, numbered one after another (the numbering the push's
        records then use: kept until the next call)."""
        members = self._members()
        settings = self._settings
        if settings is not None and settings.in_place:  # the first wave only
            members = members[: settings.max_unavailable]
        per_replica = {r: self.replicas[r].weight_layouts() for r in members}
        self._first_ranks, first = {}, 0
        for r in members:
            self._first_ranks[r] = first
            first += len(per_replica[r])
        return [
            dataclasses.replace(lay, rank=self._first_ranks[r] + lay.rank, replica=r)
            for r in members
            for lay in per_replica[r]
        ]

    def unavailable(self) -> str | None:
        if self.board.allowed():
            return None
        return self.board.why_none()

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[FleetUpdate]:
        """Every member replica's window; leaving with an error aborts the push on every
        replica still in it (each drops what the push left on it)."""
        with self._lock:
            update = FleetUpdate(self, spec, list(self._first_ranks))
            aside, self._aside = self._aside, {}
            try:
                yield update
            except BaseException as exc:
                update.close_all(exc)
                raise
            else:
                update.close_all(None)
                for r, held in sorted(aside.items()):  # off the delta's base: a peer's copy
                    if self.board.state(r) is ReplicaState.SERVING:
                        self.board.quarantine(
                            r,
                            f"left out of the delta push of version {spec.version}: it "
                            f"held {held}, not the delta's base; heals from a peer",
                        )
                        self.heal(r)

    def replica_spec(self, spec: UpdateSpec, replica: int) -> UpdateSpec:
        return dataclasses.replace(spec, first_rank=self._first_ranks[replica])

    def split(self, records_by_rank: dict[int, list[Record]]) -> dict[int, dict[int, list]]:
        """Fleet-wide rank -> records, as each member replica's own rank -> records."""
        out: dict[int, dict[int, list[Record]]] = {r: {} for r in self._first_ranks}
        starts = sorted((first, r) for r, first in self._first_ranks.items())
        for rank, records in records_by_rank.items():
            first, r = max((f, r) for f, r in starts if f <= rank)
            out[r][rank - first] = records
        return out


class FleetUpdate:
    """One push's windows on the member replicas (`tandem.exchange.UpdateWindow`)."""

    def __init__(self, target: FleetTarget, spec: UpdateSpec, members: list[int]):
        self.target = target
        self._spec = spec
        self.windows: dict[int, UpdateWindow] = {}
        self._managers: dict[int, object] = {}
        self.failed: dict[int, str] = {}  # replica -> why it left the push
        self.held: list[int] = []  # rolling: replicas holding the new version, not committed
        self.committed: list[int] = []
        self._ingress: dict[int, tuple[int, float]] = {}
        self._hung: set[int] = set()  # past a phase's deadline: their threads still run
        self._opened = time.perf_counter()
        for r in members:
            self._open(r)
        if not self.windows:
            raise WeightSyncError(
                f"update to version {spec.version}: no replica could open "
                f"its window: {self._failures()}"
            )

    @property
    def spec(self) -> UpdateSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: UpdateSpec) -> None:
        self._spec = spec
        for r, window in self.windows.items():
            window.spec = self.target.replica_spec(spec, r)

    def expose(self) -> None:
        for window in self.windows.values():
            window.expose()

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        """``phase`` on every replica in the push at once; the bytes moved. A replica that
        fails while others pass is quarantined and leaves the push; if all fail, the push
        fails (`WeightSyncError` naming them)."""
        parts = self.target.split(records_by_rank)
        if phase is PushPhase.COMMIT and self.held:
            return self._waves(parts)
        if phase is PushPhase.COMMIT and self.committed and self.spec.settings.in_place:
            return self._peer_waves()
        replicas = sorted(self.windows)
        moved, errors = self._on(replicas, phase, parts)
        if errors and len(errors) == len(replicas) and phase is not PushPhase.COMMIT:
            detail = "; ".join(f"replica {r}: {why}" for r, why in sorted(errors.items()))
            for r in replicas:  # the senders' fault, not theirs: none is quarantined
                self._close(r, WeightSyncError(detail), quarantine=False)
            raise WeightSyncError(
                f"update to version {self.spec.version} rejected in "
                f"{phase.value} by every replica; each keeps the version it "
                f"serves: {detail}"
            )
        for r, why in errors.items():
            self._close(r, WeightSyncError(why), reason=f"{phase.value}: {why}")
        if phase is PushPhase.HOLD:  # rolling: back to serving the old version meanwhile
            for r in sorted(self.windows):
                self._close(r, None)
                self.held.append(r)
            self.target.board.rolling(self.spec.version)
        elif phase is PushPhase.COMMIT:
            self.committed += sorted(self.windows)
            if not self.windows:
                raise WeightSyncError(
                    f"the commit of version {self.spec.version} failed on "
                    f"every replica: {self._failures()}"
                )
            if self.spec.settings.in_place:  # the first wave serves the new version now
                for r in sorted(self.windows):
                    self._close(r, None)
        return moved

    def _peer_waves(self) -> int:
        """In place: the members the senders did not write, a wave at a time, each replica
        written from one of the first wave."""
        board, settings = self.target.board, self.spec.settings
        rest = [r for r in board.members() if r not in self.committed and r not in self.failed]
        sources = list(self.committed)
        for i in range(0, len(rest), settings.max_unavailable):
            wave = rest[i : i + settings.max_unavailable]
            for r in wave:
                board.set(r, ReplicaState.UPDATING)
            if settings.wave == "wait" and self.target.drain is not None:
                self._drain(wave)
            errors = self._pull_wave(wave, sources)
            for r in wave:
                if r in errors:
                    self._quarantine(r, f"written from a peer: {errors[r]}")
                else:
                    self.committed.append(r)
                    board.set(r, ReplicaState.SERVING)
        return 0

    def _waves(self, parts: dict[int, dict[int, list]]) -> int:
        """Commit the held replicas, at most ``max_unavailable`` at a time; the others
        serve."""
        settings, board, moved = self.spec.settings, self.target.board, 0
        pending, self.held = self.held, []
        try:
            while pending := self._still_in(pending):
                wave = pending[: settings.max_unavailable]
                pending = pending[settings.max_unavailable :]
                for r in wave:
                    board.set(r, ReplicaState.UPDATING)
                if settings.wave == "wait" and self.target.drain is not None:
                    self._drain(wave)
                for r in self._still_in(wave):  # one lost while it drained left the push
                    self._open(r)
                opened = [r for r in wave if r in self.windows]
                nbytes, errors = self._on(opened, PushPhase.COMMIT, parts)
                moved += nbytes
                for r in opened:
                    if r in errors:
                        self._close(r, WeightSyncError(errors[r]), reason=f"commit: {errors[r]}")
                    else:
                        self._close(r, None)
                        self.committed.append(r)
                        board.set(r, ReplicaState.SERVING)
        finally:
            board.rolling(None)
        if not self.committed:
            raise WeightSyncError(
                f"the commit of version {self.spec.version} failed on every "
                f"replica: {self._failures()}"
            )
        return moved

    def _still_in(self, replicas: list[int]) -> list[int]:
        """Those of ``replicas`` (held, waiting for their wave) still in the fleet: one
        quarantined meanwhile (its engine died, or it is healing) left the push, and heals to
        the newest version from a peer; none waits for it."""
        board, kept = self.target.board, []
        for r in replicas:
            state = board.state(r)
            if state in (ReplicaState.SERVING, ReplicaState.UPDATING):
                if (why := self.target.replicas[r].unavailable()) is None:
                    kept.append(r)
                    continue
                self._quarantine(r, f"lost before its wave committed: {why}")
            else:
                self.failed[r] = f"lost before its wave committed ({state.value}"
                self.failed[r] += f": {board.reason(r)})" if board.reason(r) else ")"
        return kept

    def _pull_wave(self, wave: list[int], sources: list[int]) -> dict[int, str]:
        """Write each replica of ``wave`` from one of ``sources``, side by side, under one
        deadline: replica -> error for those that failed."""
        errors: dict[int, str] = {}

        def one(k: int, r: int) -> None:
            try:
                self.target.pull(sources[k % len(sources)], r)
            except Exception as exc:
                errors[r] = str(exc) or type(exc).__name__

        threads = [
            threading.Thread(target=one, args=(k, r), name=f"tandem-wave-{r}", daemon=True)
            for k, r in enumerate(wave)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.target.phase_timeout_s
        for r, t in zip(wave, threads, strict=True):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                errors[r] = f"not written within {self.target.phase_timeout_s:g} s"
        return errors

    def _drain(self, wave: list[int]) -> None:
        """Each replica of ``wave`` finishes its requests (or is lost), side by side, under
        one deadline: the wave commits when it passes either way (requests still running
        then cross the commit, their version spans saying so)."""
        timeout = self.target.phase_timeout_s
        threads = [
            threading.Thread(
                target=self.target.drain, args=(r, timeout), name=f"tandem-drain-{r}", daemon=True
            )
            for r in wave
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout + DRAIN_MARGIN_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _on(self, replicas: list[int], phase: PushPhase, parts) -> tuple[int, dict[int, str]]:
        """``phase`` on ``replicas``, each on a thread, all under one deadline: (bytes moved,
        replica -> error). A replica past the deadline is abandoned with an error."""
        moved: dict[int, int] = {}
        errors: dict[int, str] = {}

        def one(r: int) -> None:
            try:
                moved[r] = self.windows[r].run(phase, parts.get(r, {}))
            except BaseException as exc:
                errors[r] = str(exc) or type(exc).__name__

        threads = {
            r: threading.Thread(target=one, args=(r,), name=f"tandem-push-replica-{r}", daemon=True)
            for r in replicas
        }
        for t in threads.values():
            t.start()
        deadline = time.monotonic() + self.target.phase_timeout_s
        for r, t in threads.items():
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self._hung.add(r)
                errors[r] = f"did not finish {phase.value} within {self.target.phase_timeout_s:g} s"
        return sum(moved.get(r, 0) for r in replicas if r not in errors), errors

    def _open(self, r: int) -> None:
        manager = self.target.replicas[r].weight_update(self.target.replica_spec(self.spec, r))
        try:
            self.windows[r] = manager.__enter__()
        except Exception as exc:
            self._quarantine(r, f"could not open its window: {exc}")
            return
        self._managers[r] = manager

    def _close(
        self, r: int, exc: BaseException | None, quarantine: bool = True, reason: str | None = None
    ) -> None:
        """Leave replica ``r``'s window: normally, or failed with ``exc`` (the replica drops
        what the push left on it, and is quarantined with ``reason`` if ``quarantine``)."""
        window, manager = self.windows.pop(r), self._managers.pop(r)
        bytes_in, _ = window.ingress()[0]
        if bytes_in or r not in self._ingress:
            self._ingress[r] = (bytes_in, time.perf_counter() - self._opened)

        def leave() -> None:
            try:
                if exc is None:
                    manager.__exit__(None, None, None)
                else:
                    manager.__exit__(type(exc), exc, exc.__traceback__)
            except Exception as error:  # a window that cannot close cleanly: quarantined
                if exc is None:
                    self._quarantine(r, f"closing its window failed: {error}")

        if r not in self._hung:  # its ranks drop the push before the next one can open
            leave()
        else:  # stuck in a phase, it still holds its engine: leave without waiting for it
            threading.Thread(target=leave, name=f"tandem-push-abort-{r}", daemon=True).start()
        if exc is not None and quarantine:
            self._quarantine(r, reason or str(exc))

    def _quarantine(self, r: int, why: str) -> None:
        self.failed[r] = why
        self.target.board.quarantine(r, f"push of version {self.spec.version} failed: {why}")

    def _failures(self) -> str:
        return "; ".join(f"replica {r}: {why}" for r, why in sorted(self.failed.items()))

    def close_all(self, exc: BaseException | None) -> None:
        for r in sorted(self.windows):
            if exc is None:
                self._close(r, None)
            else:
                self._close(r, exc, quarantine=False)
        if exc is not None and self.held:  # held but never committed: dropped everywhere
            for r in self.held:
                self._open(r)
                if r in self.windows:
                    self._close(r, exc, quarantine=False)  # its ranks drop what they held
            self.held = []
            self.target.board.rolling(None)

    def ingress(self) -> dict[int, tuple[int, float]]:
        return dict(self._ingress)

    def failures(self) -> dict[int, str]:
        return dict(self.failed)
