"""The trainer side: `WeightSender(model, target).push(version)`, on every trainer rank.

Each rank tells the engine which canonical boxes it holds; the engine plans (once, cached) and
answers with the boxes this rank must stage; the rank packs exactly those — converted to the
engine's dtype, so fewer bytes travel — with a CRC32 each: into its own shared staging memory
(kept for its later pushes), straight into the engine's shared parameters (shm ``in_place``),
or over torch.distributed; the engine verifies everything on every rank before committing.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tandem.dtypes import DTYPES
from tandem.exchange.adapters.dtensor import dtensor_layout
from tandem.exchange.adapters.hf import local_tensor, named_tensors
from tandem.exchange.checksum import copy_with_crc32
from tandem.exchange.discovery import exchange_address
from tandem.exchange.protocol import PushDone, PushHello, PushPlan, PushReady, decode, encode
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.transports import dist as p2p
from tandem.exchange.transports.shm import SharedMemory
from tandem.exchange.transports.shm_arena import MappedArena
from tandem.wire import PeerGone, recv_frame, send_frame


@dataclass(frozen=True, slots=True)
class PushStats:
    version: int
    bytes_sent: int  # by this rank
    bytes_needed: int  # what all engine ranks hold, in the engine's dtype
    bytes_moved: int  # by all trainer ranks together
    seconds: float
    transport: str


class WeightSender:
    """Push a trainer model's weights into a tandem engine, in place.

    ``model``: an ``nn.Module`` (or state dict) whose names are the Hugging Face names, plain or
    FSDP2/DTensor-sharded. ``target``: an `LLM`, its ``llm.exchange_address``, or the URL of a
    `tandem serve` (``http://host:port`` or ``host:port``, with ``admin_key`` or
    ``$TANDEM_ADMIN_KEY``). With a
    multi-rank trainer every rank calls `push` (rank and world default to the torch.distributed
    default group's). ``verify`` sends a CRC32 of every box; the engine rejects the update on
    any mismatch. ``ignore`` names trainer tensors the engine does not have (a value head).

    ``transport``: ``shm`` (same host: each rank stages its boxes in shared memory the engine ranks
    map — a memfd, kept for later pushes until `close`) or ``dist`` (torch.distributed
    point-to-point in a group of trainer and engine ranks; works across hosts) or ``cuda_ipc`` (same
    node, CUDA: the engine maps each rank's CUDA staging buffer); ``auto`` picks ``cuda_ipc`` for a
    model on a GPU, else ``shm``. ``mode`` (shm, dist): ``staged`` stages the push (shm: in the
    trainer's shared memory; dist: in engine memory) and commits only a complete, verified push (the
    old version serves on failure); ``in_place`` writes straight into the live parameters (shm: the
    trainer rank copies each box into the engine's shared parameters, one copy; dist: the engine
    receives into them), with no extra memory, and a broken push makes the engine refuse requests
    until a complete push lands."""

    TRANSPORTS = ("shm", "dist", "cuda_ipc")

    def __init__(
        self,
        model: nn.Module,
        target,
        *,
        transport: str = "auto",
        mode: str = "staged",
        verify: bool = True,
        ignore: tuple[str, ...] = (),
        rank: int | None = None,
        world_size: int | None = None,
        timeout_s: float = 600.0,
        admin_key: str | None = None,
    ):
        if transport not in ("auto", *self.TRANSPORTS):
            raise ValueError(f"transport must be one of {('auto', *self.TRANSPORTS)}")
        if mode not in ("staged", "in_place"):
            raise ValueError(f"mode must be 'staged' or 'in_place', got {mode!r}")
        if isinstance(target, str):
            address = exchange_address(target, admin_key)
        else:
            address = target.exchange_address
        hostport, _, self._token = address.rpartition("/")
        host, _, port = hostport.rpartition(":")
        if not (host and port.isdigit() and self._token):
            raise ValueError(f"not an exchange address (host:port/token): {address!r}")
        self._endpoint = (host, int(port))
        self.model = model
        if transport == "auto":
            on_gpu = any(local_tensor(t).is_cuda for _, t in named_tensors(model))
            # CUDA IPC cannot map a buffer in the process that made it
            local_engine = not isinstance(target, str) and target.engine.config.world_size == 1
            transport = "cuda_ipc" if on_gpu and not local_engine else "shm"
        self.transport = transport
        self.mode = mode
        self.verify = verify
        self.ignore = list(ignore)
        default = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if default else 0)
        self.world_size = world_size or (dist.get_world_size() if default else 1)
        self.timeout_s = timeout_s
        self._arenas: dict[tuple, MappedArena] = {}  # engine ranks' parameters (shm in_place)
        self._staging: SharedMemory | None = None  # shm staged: kept for the next push

    def push(self, version: int | None = None) -> PushStats:
        """Send this rank's boxes and wait until the engine committed (or rejected) them."""
        start = time.perf_counter()
        layout = dtensor_layout(self.model, self.rank)
        hello = PushHello(self._token, self.rank, self.world_size, version, layout.to_wire(),
                          self.ignore, self.transport, self.mode, self.verify)  # fmt: skip
        staged = None  # cuda_ipc: the staging buffer, alive until the engine has answered
        sent = 0
        with socket.create_connection(self._endpoint, timeout=self.timeout_s) as sock:
            try:
                send_frame(sock, encode(hello))
                reply = decode(recv_frame(sock))
                if isinstance(reply, PushPlan):
                    sent = sum(item[5] for item in reply.items)
                    try:
                        ready, staged = self._deliver(reply)
                    except p2p.GroupBroken as exc:  # a peer died or left the push's group
                        raise WeightSyncError(self._why_broken(sock, exc)) from None
                    send_frame(sock, encode(ready))
                    reply = decode(recv_frame(sock))
            except (PeerGone, OSError) as exc:
                # the engine may still be reading the staging memory: never write it again
                self._staging = None
                raise WeightSyncError(f"lost the engine during the push ({exc})") from None
        if not isinstance(reply, PushDone):
            raise WeightSyncError(f"unexpected reply {type(reply).__name__} from the engine")
        if reply.error is not None:
            raise WeightSyncError(reply.error)
        return PushStats(reply.version, sent, reply.bytes_needed, reply.bytes_moved,
                         time.perf_counter() - start, self.transport)  # fmt: skip

    def close(self) -> None:
        """Release this sender's shared staging memory and its mappings of engine memory
        (also released when the sender is garbage-collected)."""
        self._staging = None
        self._arenas = {}

    def _why_broken(self, sock: socket.socket, exc: Exception) -> str:
        """The engine's account of a push whose transport broke under this rank (it answers
        once every engine rank has stopped receiving), else the transport's error."""
        try:
            reply = decode(recv_frame(sock))
        except (PeerGone, OSError, ValueError):
            reply = None
        if isinstance(reply, PushDone) and reply.error is not None:
            return reply.error
        return f"the transport broke mid-push ({type(exc).__name__}: {exc})"

    def _deliver(self, plan: PushPlan) -> tuple[PushReady, object]:
        """Carry out this rank's part of the plan; (the ready message, what must stay alive)."""
        if self.transport == "dist":
            return PushReady(self._send(plan)), None
        if plan.arenas is not None:
            return PushReady(self._write_in_place(plan)), None
        if self.transport == "cuda_ipc":
            from tandem.exchange.transports.cuda_ipc import export_handle

            device = next(local_tensor(t).device for _, t in named_tensors(self.model))
            buf = torch.empty(plan.size, dtype=torch.uint8, device=device)
            crcs = self._stage(buf, plan)
            torch.cuda.synchronize(device)
            return PushReady(crcs, export_handle(buf)), buf
        if self._staging is None or self._staging.size != plan.size:
            self._staging = None  # the old buffer goes before the new one is made
            self._staging = SharedMemory(plan.size, "tandem-staging")
        return PushReady(self._stage(self._staging.data, plan), self._staging.to_wire()), None

    def _stage(self, buf: torch.Tensor, plan: PushPlan) -> list[int | None]:
        """Pack every planned box at its offset of ``buf`` (uint8), in the engine's dtype."""
        dtype = DTYPES[plan.dtype]
        local = {name: local_tensor(t) for name, t in named_tensors(self.model)}
        crcs = []
        with torch.no_grad():
            for key, slices, transposed, box_shape, offset, nbytes, _ in plan.items:
                src = local[key][tuple(slice(a, b) for a, b in slices)]
                out = buf[offset : offset + nbytes].view(dtype).view(box_shape)
                crcs.append(copy_with_crc32(src.t() if transposed else src, out, self.verify))
        self._before_ready(buf)
        return crcs

    def _write_in_place(self, plan: PushPlan) -> list[int | None]:
        """shm in_place: write every planned box straight into its engine rank's live
        parameter (the engine is paused meanwhile); one copy, CRC32s taken on the way."""
        dtype = DTYPES[plan.dtype]
        mapped = {}  # mapped once, kept for later pushes; an engine that is gone is dropped
        for wire in plan.arenas:
            key = tuple(wire[:3])
            mapped[key] = self._arenas.get(key) or MappedArena(wire)
        self._arenas = mapped
        arenas = [mapped[tuple(wire[:3])] for wire in plan.arenas]
        local = {name: local_tensor(t) for name, t in named_tensors(self.model)}
        crcs = []
        with torch.no_grad():
            for item, (key, slices, transposed) in zip(plan.items, plan.dests, strict=True):
                src_key, src_slices, src_transposed, _, _, _, dst = item
                src = local[src_key][tuple(slice(a, b) for a, b in src_slices)]
                region = arenas[dst].param(key, dtype)[tuple(slice(a, b) for a, b in slices)]
                box = src.t() if src_transposed else src
                crcs.append(copy_with_crc32(box, region.t() if transposed else region,
                                            self.verify))  # fmt: skip
        self._before_ready(None)
        return crcs

    def _send(self, plan: PushPlan) -> list[int | None]:
        """dist: send each engine rank its boxes, engine ranks in `stream_order`, in buckets."""
        info = p2p.GroupInfo.from_wire(plan.group)
        group = p2p.join(info, self.rank)
        dtype = DTYPES[plan.dtype]
        local = {name: local_tensor(t) for name, t in named_tensors(self.model)}
        by_dst: dict[int, list[int]] = {}
        for i, item in enumerate(plan.items):
            by_dst.setdefault(item[6], []).append(i)
        crcs: list[int | None] = [None] * len(plan.items)
        with torch.no_grad():
            order = p2p.stream_order(self.rank, by_dst, plan.trainers,
                                     info.world - plan.trainers, sending=True)  # fmt: skip
            for dst in order:
                boxes = []
                for i in by_dst[dst]:
                    key, slices, transposed, _, _, _, _ = plan.items[i]
                    src = local[key][tuple(slice(a, b) for a, b in slices)]
                    boxes.append(src.t() if transposed else src)
                try:
                    sent = p2p.send_boxes(group, plan.trainers + dst, boxes, dtype,
                                                plan.bucket_bytes, self.verify)  # fmt: skip
                except RuntimeError as exc:  # gloo / NCCL: a peer died or left the group
                    p2p.abandon(info)  # so engine ranks waiting on this one fail too
                    raise p2p.GroupBroken(str(exc)) from None
                for i, crc in zip(by_dst[dst], sent, strict=True):
                    crcs[i] = crc
        self._before_ready(None)
        return crcs

    def _before_ready(self, staged: torch.Tensor | None) -> None:
        """Test hook: runs after staging (``staged``: the bytes, None for dist), before the
        engine reads them."""
