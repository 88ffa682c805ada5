"""A `WeightTarget`'s door for weight pushes from trainer processes (`llm.exchange_address`).

A background thread accepts trainer ranks, plans (cached while layouts are unchanged), and runs
each push as a session: staged transports whose senders deliver on their own (shm, cuda_ipc)
are delivered while the target keeps serving, and only verify and commit pause it; pushes that
write into the live parameters (``in_place``) or need the receiving ranks to take part (dist)
pause it first (`Transport.pauses_to_deliver`, `WeightTarget.weight_update`). What a transport
adds to a push (dist: its process group; shm in place: the arenas) its `Coordinator` adds; the
server never tests a transport's name. All socket I/O happens on this thread, never inside
a phase. A trainer rank that disconnects before the commit aborts the push: the old
weights keep serving, unless it was writing them in place, in which case the target refuses
requests until a complete push lands.
"""

from __future__ import annotations

import dataclasses
import queue
import secrets
import socket
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from tandem.errors import StaleVersionError
from tandem.exchange import collector
from tandem.exchange.address import ExchangeAddress
from tandem.exchange.items import Record
from tandem.exchange.layout import LayoutMismatch
from tandem.exchange.plan import PlanCache
from tandem.exchange.protocol import PUSH, PushDone, PushEncoded, PushHello, PushPlan, PushReady
from tandem.exchange.push_items import push_items, replica_figures
from tandem.exchange.quantize import scale_sources
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.rollout import RolloutReport
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.exchange.target import AdapterTarget, ReplicatedTarget, UpdateWindow, WeightTarget
from tandem.exchange.transports import TRANSPORTS, check
from tandem.exchange.transports.base import Coordinator
from tandem.wire import MAX_FRAME, PeerGone, read_hello, recv_frame, send_frame

HANDSHAKE_TIMEOUT_S = 30.0
MAX_HANDSHAKES = 64  # connections saying hello at once; more are dropped

_SERVING_HERE: weakref.WeakValueDictionary[ExchangeAddress, ExchangeServer] = (
    weakref.WeakValueDictionary()
)


def target_here(address: ExchangeAddress) -> WeightTarget | None:
    """The target behind ``address`` when its exchange server runs in this process."""
    server = _SERVING_HERE.get(address)
    return None if server is None else server.target


class ExchangeServer:
    """Pushes into ``target``, reached at `endpoint` (`address`: its string form)."""

    def __init__(
        self, target: WeightTarget, host: str = "127.0.0.1", stage_timeout_s: float = 600.0
    ):
        self.target = target
        self.token = secrets.token_hex(16)
        self.stage_timeout_s = stage_timeout_s
        self.plans = PlanCache()
        self._coordinators: dict[str, Coordinator] = {}  # by transport, made on first use
        self._listener = socket.create_server((host, 0))
        self.endpoint = ExchangeAddress(*self._listener.getsockname()[:2], self.token)
        _SERVING_HERE[self.endpoint] = self
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="tandem-exchange", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port/token``, what `WeightSender` takes (`ExchangeAddress.parse`)."""
        return str(self.endpoint)

    def transports(self) -> list[str]:
        """The transports that reach the target's ranks (`Transport.device_types`)."""
        device_type = self.target.weight_device_type
        return [
            name
            for name, t in TRANSPORTS.items()
            if device_type in t.device_types and t.sender is not None
        ]

    def close(self) -> None:
        self._closed = True
        _SERVING_HERE.pop(self.endpoint, None)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _serve(self) -> None:
        """Accept; each connection says hello on a thread of its own (a silent peer cannot hold
        up the others), and pushes run one at a time on the session thread."""
        hellos: queue.Queue = queue.Queue()
        threading.Thread(
            target=self._sessions, args=(hellos,), name="tandem-exchange-push", daemon=True
        ).start()
        greeting = threading.BoundedSemaphore(MAX_HANDSHAKES)
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                hellos.put(None)
                return
            if not greeting.acquire(blocking=False):
                sock.close()  # a flood of connections: drop the excess
                continue
            threading.Thread(target=self._greet, args=(sock, hellos, greeting), daemon=True).start()

    def _greet(self, sock: socket.socket, hellos: queue.Queue, greeting) -> None:
        """Queue the trainer rank's hello once it proved the token (`tandem.wire.read_hello`: a
        stranger can make this read no more than a small first frame); close anyone else's
        connection. A hello holds the rank's whole layout: it may be as large as any frame."""
        try:
            hello = read_hello(sock, self.token, PUSH, PushHello, HANDSHAKE_TIMEOUT_S, MAX_FRAME)
        finally:
            greeting.release()
        if hello is None:
            return
        if not 0 <= hello.rank < hello.world:
            sock.close()
            return
        hellos.put((sock, hello))

    def _sessions(self, hellos: queue.Queue) -> None:
        gathering: dict[int, tuple[socket.socket, PushHello]] = {}  # by trainer rank
        while (item := hellos.get()) is not None:
            sock, hello = item
            stale = gathering.pop(hello.rank, None)
            if stale is not None:  # that rank gave up on an earlier push and came back
                stale[0].close()
            gathering[hello.rank] = (sock, hello)
            if len(gathering) >= hello.world:
                session, gathering = gathering, {}
                self._run([session[r] for r in sorted(session)])

    def _run(self, conns: list[tuple[socket.socket, PushHello]]) -> None:
        """One push, Python's garbage collector held off until its trainers are answered (a
        rolling push's waves go on after that, collected as usual)."""
        with collector.Held() as hold:
            self._drive(conns, hold.release)

    def _drive(
        self, conns: list[tuple[socket.socket, PushHello]], answered_all: Callable[[], None]
    ) -> None:
        socks = [s for s, _ in conns]
        hellos = [h for _, h in conns]
        version = None
        start = time.perf_counter()
        answered = []
        report: list[RolloutReport] = []  # a rolling push's, once its trainers were answered

        def answer(done: PushDone) -> None:
            """Tell every trainer rank how the push went (once): they are free then. A
            rolling push held everywhere keeps their connections to report its rollout."""
            if answered:
                return
            answered.append(done)
            for sock in socks:
                try:
                    send_frame(sock, PUSH.encode(done))
                except OSError:
                    pass
                if not report:
                    sock.close()
            answered_all()

        try:
            planned = self._plan(hellos)
            version = planned.spec.version
            if planned.why_dense is None:
                self._encode(planned, socks)
            spec = self._coordinator(planned.spec.settings.transport).prepare(
                planned.spec,
                planned.plans,
                planned.receivers,
                self.target.weight_device_type,
            )
            plans, records = planned.plans, planned.records
            needed, per_replica = planned.needed, planned.per_replica
            outcome = (None, spec.delta, planned.why_dense or None)

            def held(update, moved: int) -> None:  # rolling: the trainers are free now
                def so_far():
                    return replica_figures(
                        per_replica, update.ingress(), update.failures(), "rolling"
                    )

                report.append(RolloutReport(socks, version, so_far))
                # the replicas commit it in their waves (or leave and heal, which takes their
                # base): the next push finds out which
                answer(PushDone(version, None, needed, moved, so_far(), *outcome, spec.push_id))
                report[0].start()

            moved, update = self._push(spec, socks, plans, records, held)
            figures = replica_figures(per_replica, update.ingress(), update.failures())
            # the id a trainer's shadow may take as its base: only where the target keeps it
            kept = spec.push_id if self.target.weight_base == spec.push_id else ""
            done = PushDone(version, None, needed, moved, figures, *outcome, kept)
        except StaleVersionError as exc:  # refused before any plan went out: nothing moved
            done = PushDone(exc.requested, str(exc), stale_served=exc.served)
        except (PeerGone, OSError) as exc:
            self._retire_group()
            done = PushDone(
                version or -1, f"a trainer rank disconnected mid-push ({exc}); {self._serving()}"
            )
        except (WeightSyncError, LayoutMismatch, ValueError) as exc:
            self._retire_group()
            done = PushDone(version or -1, str(exc))
        except Exception as exc:  # report any other failure to the trainers, never hang them
            self._retire_group()
            done = PushDone(version or -1, f"{type(exc).__name__}: {exc}")
        for listener in self.target.update_listeners:
            listener(done.version, time.perf_counter() - start, done.error)
        if report:  # the rollout's end, to the trainers answered when it was held
            report[0].finish(done.replicas, done.error)
        answer(done)

    def _serving(self) -> str:
        reason = self.target.unavailable()
        if reason is not None:
            return f"requests are refused until a complete push lands ({reason})"
        return f"version {self.target.weight_version} keeps serving"

    def _push(
        self, spec: UpdateSpec, socks: list, plans: list[PushPlan], records: tuple, held
    ) -> tuple[int, UpdateWindow]:
        """Deliver, verify and commit one push: (the bytes the trainers moved, as counted;
        the window it ran in, which says what arrived where and which replicas left it).
        ``held(window, moved)`` is called when a rolling push is held everywhere."""
        transport = TRANSPORTS[spec.settings.transport]
        if not transport.pauses_to_deliver(spec.settings):
            self._send_plans(socks, plans)  # trainers stage while the target serves
            spec, by_receiver, moved = self._readies(spec, socks, records)
            with self.target.weight_update(spec) as update:
                if transport.pulls:  # the target's ranks read what the trainers staged
                    update.run(PushPhase.RECEIVE, by_receiver)
                update.run(PushPhase.VERIFY, by_receiver)
                self._commit(update, by_receiver, lambda: held(update, moved))
            return moved, update
        with self.target.weight_update(spec) as update:
            if spec.settings.in_place:
                update.expose()  # from here trainers (or the target's ranks) write live weights
            self._send_plans(socks, plans)
            if transport.engine_receives:
                update.run(PushPhase.RECEIVE, self._by_receiver(_interleaved(records)))
            spec, by_receiver, moved = self._readies(spec, socks, records)
            update.spec = spec
            if transport.pulls:  # the target's ranks read what the trainers offer
                update.run(PushPhase.RECEIVE, by_receiver)
            update.run(PushPhase.VERIFY, by_receiver)
            self._commit(update, by_receiver, lambda: held(update, moved))
        return moved, update

    @staticmethod
    def _commit(update: UpdateWindow, by_receiver: dict, held) -> None:
        """Commit a verified push. Rolling: once every replica holds it (staged), or the
        first wave written in place has committed it, the trainers are answered (they are
        free) and the target rolls it out in waves."""
        if update.spec.settings.rolling:
            first = PushPhase.COMMIT if update.spec.settings.in_place else PushPhase.HOLD
            update.run(first, by_receiver)
            held()
        update.run(PushPhase.COMMIT, by_receiver)

    def _send_plans(self, socks: list, plans: list[PushPlan]) -> None:
        for sock, plan in zip(socks, plans, strict=True):
            sock.settimeout(self.stage_timeout_s)
            send_frame(sock, PUSH.encode(plan))

    def _readies(self, spec: UpdateSpec, socks: list, records: tuple):
        """Every trainer rank's `PushReady`: (the spec with their staging handles, records by
        engine rank with the senders' CRC32s, relayed boxes' too, bytes moved as the senders
        counted them)."""
        staging, moved = [], 0
        sent, relayed = records
        with_crcs: list[list] = []
        for rank, sock in enumerate(socks):
            ready = PUSH.decode(recv_frame(sock))
            if not isinstance(ready, PushReady):
                raise WeightSyncError(f"trainer rank {rank} sent {type(ready).__name__}")
            if len(ready.crcs) != len(sent[rank]):
                raise WeightSyncError(
                    f"trainer rank {rank} sent {len(ready.crcs)} checksums "
                    f"for {len(sent[rank])} boxes"
                )
            staging.append(ready.staging)
            moved += sum(ready.bytes_moved)
            pairs = zip(sent[rank], ready.crcs, strict=True)
            with_crcs.append([(dst, r.with_crc(crc)) for (dst, r), crc in pairs])
            with_crcs.append([(dst, r.with_crc(ready.crcs[i])) for i, dst, r in relayed[rank]])
        # the same order as `_interleaved`: every rank verifies its records as it received them
        if any(s is not None for s in staging):
            spec = dataclasses.replace(spec, staging=tuple(staging))
        return spec, self._by_receiver(with_crcs), moved

    @staticmethod
    def _by_receiver(records: list[list[tuple[int, Record]]]) -> dict[int, list[Record]]:
        """Records by engine rank, in the order given (each list's, lists in turn)."""
        by_receiver: dict[int, list[Record]] = defaultdict(list)
        for per_rank in records:
            for dst, record in per_rank:
                by_receiver[dst].append(record)
        return by_receiver

    def _coordinator(self, name: str) -> Coordinator:
        if name not in self._coordinators:
            host = self._listener.getsockname()[0]
            self._coordinators[name] = TRANSPORTS[name].coordinator(host, self.stage_timeout_s)
        return self._coordinators[name]

    def _retire_group(self) -> None:
        """A push failed: no transport reuses what it may have left half-done."""
        for coordinator in self._coordinators.values():
            coordinator.retire()

    def _plan(self, hellos: list[PushHello]) -> _Planned:
        """The push the trainer ranks asked for, planned: the spec every engine rank gets,
        each trainer rank's plan, its (engine rank, Record)s, the bytes the engine needs, and
        whether it may go as a delta (`_delta_refused`)."""
        world = {h.world for h in hellos}
        if world != {len(hellos)} or [h.rank for h in hellos] != list(range(len(hellos))):
            raise ValueError(f"trainer ranks {[h.rank for h in hellos]} of world {world}")
        for field in ("version", "settings", "rollback", "delta", "copy_of"):
            values = {repr(getattr(h, field)) for h in hellos}
            if len(values) != 1:
                raise ValueError(f"trainer ranks disagree on {field}: {sorted(values)}")
        settings = check(hellos[0].settings)
        refused = self.target.refuses(settings)
        if refused is not None:
            raise ValueError(refused)
        why_dense = self._delta_refused(hellos, settings)  # may narrow a fleet's replicas
        version = hellos[0].version
        adapter = None
        if settings.adapter is not None:  # a LoRA adapter into its slot (`AdapterTarget`)
            if not isinstance(self.target, AdapterTarget):
                raise ValueError(f"a {type(self.target).__name__} takes no LoRA adapter pushes")
            receivers, adapter, served = self.target.adapter_plan(settings.adapter)
        else:
            receivers, served = self.target.weight_layouts(), self.target.weight_version
        if version is None:
            version = 1 if served is None else served + 1
        elif served is not None and version <= served and not hellos[0].rollback:
            name = None if adapter is None else adapter.name
            raise StaleVersionError(version, served, name)
        senders = [h.layout for h in hellos]
        for h, layout in zip(hellos, senders, strict=True):
            layout.rank = h.rank
        ignore = frozenset(name for h in hellos for name in h.ignore)
        senders, quantized = scale_sources(senders, receivers)
        plan = self.plans.get(senders, receivers, ignore)
        dtype = self.target.weight_dtype
        transport = TRANSPORTS[settings.transport]
        per_stream, read_staging = transport.per_stream_offsets, transport.shared_staging
        key = (dtype, per_stream, read_staging)  # the same every push of this plan
        if key not in plan.derived:
            plan.derived[key] = push_items(plan, receivers, per_stream, read_staging)
        sizes, items, records, relayed, needed, per_replica = plan.derived[key]
        plans = [
            PushPlan(dtype, sizes[i], items[i], quantize=quantized) for i in range(len(hellos))
        ]
        rollback = hellos[0].rollback
        spec = UpdateSpec(
            version,
            settings,
            dtype,
            len(hellos),
            adapter=adapter,
            rollback=rollback,
            push_id=hellos[0].copy_of or secrets.token_hex(8),
        )
        planned = _Planned(spec, plans, (records, relayed), needed, per_replica, plan, receivers)
        planned.why_dense = why_dense
        return planned

    def _delta_refused(self, hellos: list[PushHello], settings) -> str | None:
        """Why a push the trainers asked to send as a delta goes dense ("" when they did not
        ask), decided before any byte moves. A fleet whose replicas do not all hold the
        trainers' base takes the delta on those that do (`ReplicatedTarget`)."""
        if hellos[0].delta == "off":
            return ""
        base = hellos[0].base
        if settings.adapter is not None:
            return "a LoRA adapter's push is dense"
        if settings.rolling and settings.in_place:
            return "a rolling push written in place is dense (its later waves copy a peer)"
        if any(h.base is None for h in hellos):
            return "no push of this sender has landed yet"
        if len({h.base for h in hellos}) != 1:
            return "the trainer ranks hold shadows of different pushes"
        held = self.target.weight_base
        if held != base and isinstance(self.target, ReplicatedTarget):
            if self.target.plan_over_base(base):  # the replicas off it catch up from a peer
                return None
        if held != base:
            where = "weights of another origin" if held is None else f"those of push {held}"
            return f"the target does not hold the weights of push {base} (it holds {where})"
        return None

    def _encode(self, planned: _Planned, socks: list) -> None:
        """A delta push's first round: every trainer rank encodes its boxes against its shadow
        (`PushPlan.encode`) and says how each payload applies (`PushEncoded`); the plans and
        records then carry the payloads. Any rank that cannot (or, "auto", should not) sends
        its reason and the whole push goes dense (``planned.why_dense``)."""
        for sock, plan in zip(socks, planned.plans, strict=True):
            sock.settimeout(self.stage_timeout_s)
            send_frame(sock, PUSH.encode(dataclasses.replace(plan, encode=True)))
        answers = []
        for rank, sock in enumerate(socks):
            answer = PUSH.decode(recv_frame(sock))
            if not isinstance(answer, PushEncoded):
                raise WeightSyncError(f"trainer rank {rank} sent {type(answer).__name__}")
            if answer.dense is None and len(answer.boxes) != len(planned.plans[rank].items):
                raise WeightSyncError(
                    f"trainer rank {rank} encoded {len(answer.boxes)} boxes "
                    f"of {len(planned.plans[rank].items)}"
                )
            answers.append(answer)
        refused = [f"trainer rank {r}: {a.dense}" for r, a in enumerate(answers) if a.dense]
        if refused:
            planned.why_dense = "; ".join(refused)
            return
        boxes = [iter(a.boxes) for a in answers]
        payloads = [next(boxes[t.src]) for t in planned.plan.transfers]
        spec = planned.spec
        transport = TRANSPORTS[spec.settings.transport]
        sizes, items, records, relayed, _, _ = push_items(
            planned.plan,
            planned.receivers,
            transport.per_stream_offsets,
            transport.shared_staging,
            payloads,
        )
        planned.plans = [
            dataclasses.replace(plan, size=sizes[i], items=items[i], delta=True)
            for i, plan in enumerate(planned.plans)
        ]
        planned.records = (records, relayed)
        # the payloads are staged by every transport, then applied by the receiving ranks
        settings = dataclasses.replace(spec.settings, mode="staged")
        planned.spec = dataclasses.replace(spec, settings=settings, delta=True)


@dataclass(slots=True)
class _Planned:
    """One push as planned: what `ExchangeServer._push` runs (``spec``, ``plans``,
    ``records``), what the answer reports (``needed``, ``per_replica``), and for a delta
    the plan and receiving layouts its payloads are laid out by; ``why_dense``: why the push
    goes dense though the trainers asked for a delta ("": they did not; None: it may not)."""

    spec: UpdateSpec
    plans: list[PushPlan]
    records: tuple
    needed: int
    per_replica: dict
    plan: object
    receivers: list
    why_dense: str | None = ""


def _interleaved(records: tuple) -> list[list[tuple[int, Record]]]:
    """`_plan`'s (sent, relayed) as (engine rank, `Record`) lists: per trainer rank its own
    boxes, then the ones relayed on from them (the order `_readies` gives them their CRCs)."""
    sent, relayed = records
    out: list[list[tuple[int, Record]]] = []
    for mine, onward in zip(sent, relayed, strict=True):
        out += [mine, [(dst, record) for _, dst, record in onward]]
    return out
