"""The engine's door for weight pushes from trainer processes (`llm.exchange_address`).

A background thread accepts trainer ranks, plans (cached while layouts are unchanged), learns where
each rank staged its boxes, then applies the update between engine steps (the engine lock): every
rank verifies, then every rank commits. A trainer rank that disconnects before the commit aborts the
push; the old weights keep serving. In shm ``in_place`` mode the trainers get their plans only once
the engine is paused, and write straight into its shared parameters; a push that breaks then leaves
the engine refusing requests until a complete push lands.
"""

from __future__ import annotations

import queue
import secrets
import socket
import threading
import time
from collections import defaultdict
from datetime import timedelta

import torch.distributed as dist

from tandem.dtypes import DTYPES
from tandem.exchange.layout import LayoutMismatch, RankLayout
from tandem.exchange.plan import PlanCache, local_slices, numel
from tandem.exchange.protocol import PushDone, PushHello, PushPlan, PushReady, decode, encode
from tandem.exchange.receiver import Record, WeightSyncError
from tandem.exchange.transports.dist import DEFAULT_BUCKET_BYTES, GroupInfo
from tandem.wire import PeerGone, recv_frame, same_token, send_frame

HANDSHAKE_TIMEOUT_S = 30.0
MAX_HANDSHAKES = 64  # connections saying hello at once; more are dropped


class ExchangeServer:
    def __init__(self, engine, host: str = "127.0.0.1", stage_timeout_s: float = 600.0):
        self.engine = engine
        self.token = secrets.token_hex(16)
        self.stage_timeout_s = stage_timeout_s
        self.plans = PlanCache()
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self._store = None  # c10d store for the dist transport's groups, made on first use
        self._generation = 0
        self._group_trainers = None
        self._listener = socket.create_server((host, 0))
        self.address = "{}:{}/{}".format(*self._listener.getsockname()[:2], self.token)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="tandem-exchange", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def _serve(self) -> None:
        """Accept; each connection says hello on a thread of its own (a silent peer cannot hold
        up the others), and pushes run one at a time on the session thread."""
        hellos: queue.Queue = queue.Queue()
        threading.Thread(target=self._sessions, args=(hellos,), name="tandem-exchange-push",
                         daemon=True).start()  # fmt: skip
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
            threading.Thread(target=self._greet, args=(sock, hellos, greeting),
                             daemon=True).start()  # fmt: skip

    def _greet(self, sock: socket.socket, hellos: queue.Queue, greeting) -> None:
        try:
            hello = self._handshake(sock)
        finally:
            greeting.release()
        if hello is not None:
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

    def _handshake(self, sock: socket.socket) -> PushHello | None:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            hello = decode(recv_frame(sock))
        except (OSError, ValueError, PeerGone):
            sock.close()
            return None
        if not (isinstance(hello, PushHello) and same_token(hello.token, self.token)):
            sock.close()  # not a trainer of ours
            return None
        if not (isinstance(hello.rank, int) and isinstance(hello.world, int)
                and 0 <= hello.rank < hello.world):  # fmt: skip
            sock.close()
            return None
        return hello

    def _run(self, conns: list[tuple[socket.socket, PushHello]]) -> None:
        socks = [s for s, _ in conns]
        hellos = [h for _, h in conns]
        version = None
        start = time.perf_counter()
        try:
            version, plans, records, needed = self._plan(hellos)
            update = {"version": version, "transport": hellos[0].transport,
                      "dtype": self.engine.config.dtype, "mode": hellos[0].mode,
                      "verify": hellos[0].verify, "trainers": len(hellos)}  # fmt: skip
            # shm in_place: trainers write into the live parameters, so they get their plans
            # only once the engine is paused (inside update_weights, via checksums())
            direct = update["transport"] == "shm" and update["mode"] == "in_place"
            if update["transport"] in ("shm", "cuda_ipc") and not direct:
                update["segments"] = [None] * len(plans)  # each arrives with its PushReady
            elif update["transport"] == "dist":
                update.update(group=self._group(len(hellos)).to_wire(),
                              bucket_bytes=self.bucket_bytes)  # fmt: skip
                for plan in plans:
                    plan.group, plan.trainers = update["group"], len(hellos)
                    plan.bucket_bytes = self.bucket_bytes

            def send_plans() -> None:
                for sock, plan in zip(socks, plans, strict=True):
                    sock.settimeout(self.stage_timeout_s)
                    send_frame(sock, encode(plan))

            def checksums() -> dict[int, list]:
                if direct:
                    send_plans()
                by_receiver: dict[int, list] = defaultdict(list)
                for rank, sock in enumerate(socks):
                    ready = decode(recv_frame(sock))
                    if not isinstance(ready, PushReady):
                        raise WeightSyncError(f"trainer rank {rank} sent {type(ready).__name__}")
                    if "segments" in update:
                        update["segments"][rank] = ready.staging
                    for (dst, wire), crc in zip(records[rank], ready.crcs, strict=True):
                        wire[-1] = crc
                        by_receiver[dst].append(wire)
                return by_receiver

            if not direct:
                send_plans()
            if update["transport"] in ("shm", "cuda_ipc") and not direct:
                self.engine.update_weights(update, checksums())
            else:
                by_receiver: dict[int, list] = defaultdict(list)
                for rank in range(len(socks)):
                    for dst, wire in records[rank]:
                        by_receiver[dst].append(wire)
                self.engine.update_weights(update, by_receiver, checksums)
            moved = sum(wire[2] for per_rank in records for _, wire in per_rank)
            done = PushDone(version, None, needed, moved)
        except (PeerGone, OSError) as exc:
            self._retire_group()
            done = PushDone(version or -1, f"a trainer rank disconnected mid-push ({exc}); "
                            f"version {self.engine.weight_version} keeps serving")  # fmt: skip
        except (WeightSyncError, LayoutMismatch, ValueError) as exc:
            self._retire_group()
            done = PushDone(version or -1, str(exc))
        except Exception as exc:  # report any other failure to the trainers, never hang them
            self._retire_group()
            done = PushDone(version or -1, f"{type(exc).__name__}: {exc}")
        for listener in self.engine.update_listeners:
            listener(done.version, time.perf_counter() - start, done.error)
        for sock in socks:
            try:
                send_frame(sock, encode(done))
            except OSError:
                pass
            sock.close()

    def _group(self, trainers: int) -> GroupInfo:
        """The process group of trainer ranks and engine ranks (made once per generation)."""
        host = self._listener.getsockname()[0]
        if self._store is None:
            timeout = timedelta(seconds=self.stage_timeout_s)
            self._store = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=timeout
            )
        if self._group_trainers != trainers:
            self._retire_group()
            self._group_trainers = trainers
        world = trainers + len(self.engine.weight_layouts())
        backend = "nccl" if self.engine.config.torch_device.type == "cuda" else "gloo"
        return GroupInfo(host, self._store.port, f"exchange/{self._generation}", world, backend)

    def _retire_group(self) -> None:
        """After a failure the group may hold half-done operations: the next push makes anew."""
        self._generation += 1

    def _plan(self, hellos: list[PushHello]):
        world = {h.world for h in hellos}
        if world != {len(hellos)} or [h.rank for h in hellos] != list(range(len(hellos))):
            raise ValueError(f"trainer ranks {[h.rank for h in hellos]} of world {world}")
        for field in ("version", "transport", "mode", "verify"):
            values = {getattr(h, field) for h in hellos}
            if len(values) != 1:
                raise ValueError(f"trainer ranks disagree on {field}: {sorted(values, key=str)}")
        version = hellos[0].version
        if version is None:
            version = self.engine.weight_version + 1
        senders = [RankLayout.from_wire(h.layout) for h in hellos]
        for h, layout in zip(hellos, senders, strict=True):
            layout.rank = h.rank
        receivers = self.engine.weight_layouts()
        ignore = frozenset(name for h in hellos for name in h.ignore)
        plan = self.plans.get(senders, receivers, ignore)
        dtype = self.engine.config.dtype
        per_stream = hellos[0].transport == "dist"  # offsets per (sender, receiver) stream
        key = (dtype, per_stream)  # what follows is the same every push of this plan
        if key not in plan.derived:
            plan.derived[key] = _push_items(plan, receivers, DTYPES[dtype].itemsize, per_stream)
        sizes, items, wires, needed = plan.derived[key]
        # (receiver rank, Record wire) per sender; each push fills in its own CRC32s
        records = [[(dst, list(wire)) for dst, wire in per] for per in wires]
        plans = [PushPlan(dtype, sizes[i], items[i]) for i in range(len(hellos))]
        if hellos[0].transport == "shm" and hellos[0].mode == "in_place":
            self._direct(plans, receivers, records)
        return version, plans, records, needed

    @staticmethod
    def _direct(plans: list[PushPlan], receivers: list[RankLayout], records: list) -> None:
        """shm in_place: where each item goes in its engine rank's shared parameters."""
        missing = [lay.rank for lay in receivers if lay.arena is None]
        if missing:
            raise ValueError(
                "mode='in_place' over shm needs every engine rank's parameters in shared "
                f"memory (an engine on CPU); ranks {missing} have none"
            )
        for plan, per_rank in zip(plans, records, strict=True):
            plan.arenas = [lay.arena for lay in receivers]
            plan.dests = [[w[3], [list(s) for s in w[4]], w[6]] for _, w in per_rank]


def _push_items(plan, receivers: list[RankLayout], itemsize: int, per_stream: bool):
    """(bytes, items, Record wires, bytes needed) per sender rank: where each of its boxes
    sits (``per_stream``: offsets count per (sender, receiver) stream, else per sender) and
    where it lands."""
    items: list[list] = [[] for _ in range(plan.num_senders)]
    records: list[list] = [[] for _ in range(plan.num_senders)]
    offsets: dict[tuple[int, int], int] = defaultdict(int)
    for t in plan.transfers:
        nbytes = t.numel * itemsize
        box_shape = [b - a for a, b in t.box]
        stream = (t.src, t.dst if per_stream else -1)
        offset = offsets[stream]
        src = [[s.start, s.stop] for s in local_slices(t.src_piece, t.box)]
        items[t.src].append([t.src_key, src, t.src_piece.transposed, box_shape, offset, nbytes,
                             t.dst])  # fmt: skip
        dst = tuple((s.start, s.stop) for s in local_slices(t.dst_piece, t.box))
        rec = Record(t.src, offset, nbytes, t.dst_key, dst, tuple(box_shape),
                     t.dst_piece.transposed, None)  # fmt: skip
        records[t.src].append((t.dst, rec.to_wire()))
        offsets[stream] += nbytes
    sizes = [offsets[(i, -1)] for i in range(plan.num_senders)]
    needed = sum(numel(r.piece.box) for lay in receivers for r in lay.regions) * itemsize
    return sizes, items, records, needed
