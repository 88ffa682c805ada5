"""The trainer side: `WeightSender(model, target).push(version)`, on every trainer rank.

Each rank tells the engine which canonical boxes it holds; the engine plans (once, cached) and
answers with the boxes this rank must stage; the rank packs exactly those — converted to the
engine's dtype, so fewer bytes travel — into its own shared-memory segment with a CRC32 each,
and the engine verifies everything on every rank before writing anything in place.
"""

from __future__ import annotations

import socket
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tandem.exchange.adapters.dtensor import dtensor_layout
from tandem.exchange.protocol import PushDone, PushHello, PushPlan, PushReady, decode, encode
from tandem.exchange.receiver import _DTYPES, WeightSyncError
from tandem.exchange.transports.shm import ShmSegment
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
    FSDP2/DTensor-sharded. ``target``: an `LLM`, or its ``llm.exchange_address``. With a
    multi-rank trainer every rank calls `push` (rank and world default to the torch.distributed
    default group's). ``verify`` sends a CRC32 of every box; the engine rejects the update on
    any mismatch. ``ignore`` names trainer tensors the engine does not have (a value head).

    ``transport``: ``shm`` (same host: each rank stages its boxes in a shared-memory segment
    the engine ranks read) or ``dist`` (torch.distributed point-to-point in a group of trainer
    and engine ranks; works across hosts); ``auto`` picks ``shm``. ``mode`` (dist): ``staged``
    receives into engine memory and commits only a complete, verified push (the old version
    serves on failure); ``in_place`` receives straight into the live parameters (no extra
    memory; a broken push makes the engine refuse requests until a complete push lands)."""

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
    ):
        if transport not in ("auto", "shm", "dist"):
            raise ValueError(f"transport must be 'auto', 'shm' or 'dist', got {transport!r}")
        if mode not in ("staged", "in_place"):
            raise ValueError(f"mode must be 'staged' or 'in_place', got {mode!r}")
        address = target if isinstance(target, str) else target.exchange_address
        hostport, _, self._token = address.rpartition("/")
        host, _, port = hostport.rpartition(":")
        if not (host and port.isdigit() and self._token):
            raise ValueError(f"not an exchange address (host:port/token): {address!r}")
        self._endpoint = (host, int(port))
        self.model = model
        self.transport = "shm" if transport == "auto" else transport
        self.mode = mode
        self.verify = verify
        self.ignore = list(ignore)
        default = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if default else 0)
        self.world_size = world_size or (dist.get_world_size() if default else 1)
        self.timeout_s = timeout_s

    def push(self, version: int | None = None) -> PushStats:
        """Stage this rank's boxes and wait until the engine committed (or rejected) them."""
        start = time.perf_counter()
        layout = dtensor_layout(self.model, self.rank)
        hello = PushHello(self._token, self.rank, self.world_size, version, layout.to_wire(),
                          self.ignore, self.transport, self.mode, self.verify)  # fmt: skip
        segment = None
        sent = 0
        with socket.create_connection(self._endpoint, timeout=self.timeout_s) as sock:
            try:
                send_frame(sock, encode(hello))
                reply = decode(recv_frame(sock))
                if isinstance(reply, PushPlan) and self.transport == "shm":
                    segment = ShmSegment.create(reply.size, reply.segment)
                    crcs = self._stage(segment, reply)
                    send_frame(sock, encode(PushReady(str(segment.path), reply.size, crcs)))
                    reply = decode(recv_frame(sock))
                elif isinstance(reply, PushPlan):
                    crcs = self._send(reply)
                    sent = sum(item[5] for item in reply.items)
                    send_frame(sock, encode(PushReady("", 0, crcs)))
                    reply = decode(recv_frame(sock))
            except (PeerGone, OSError) as exc:
                raise WeightSyncError(f"lost the engine during the push ({exc})") from None
            finally:
                if segment is not None:
                    segment.close()
                    segment.unlink()
        if not isinstance(reply, PushDone):
            raise WeightSyncError(f"unexpected reply {type(reply).__name__} from the engine")
        if reply.error is not None:
            raise WeightSyncError(reply.error)
        sent = segment.size if segment is not None else sent
        return PushStats(reply.version, sent, reply.bytes_needed, reply.bytes_moved,
                         time.perf_counter() - start, self.transport)  # fmt: skip

    def _stage(self, segment: ShmSegment, plan: PushPlan) -> list[int | None]:
        dtype = _DTYPES[plan.dtype]
        local = {name: _local(t) for name, t in _named_tensors(self.model)}
        crcs = []
        with torch.no_grad():
            for key, slices, transposed, box_shape, offset, nbytes, _ in plan.items:
                src = local[key][tuple(slice(a, b) for a, b in slices)]
                out = segment.tensor(offset, nbytes, dtype).view(box_shape)
                out.copy_(src.t() if transposed else src)
                crcs.append(zlib.crc32(segment.view(offset, nbytes)) if self.verify else None)
        self._before_ready(segment)
        return crcs

    def _send(self, plan: PushPlan) -> list[int | None]:
        """dist: send each engine rank its boxes, engine ranks in order, in buckets."""
        from tandem.exchange.transports import dist as transport

        group = transport.join(transport.GroupInfo.from_wire(plan.group), self.rank)
        dtype = _DTYPES[plan.dtype]
        local = {name: _local(t) for name, t in _named_tensors(self.model)}
        by_dst: dict[int, list[int]] = {}
        for i, item in enumerate(plan.items):
            by_dst.setdefault(item[6], []).append(i)
        crcs: list[int | None] = [None] * len(plan.items)
        with torch.no_grad():
            for dst in sorted(by_dst):
                boxes = []
                for i in by_dst[dst]:
                    key, slices, transposed, _, _, _, _ = plan.items[i]
                    src = local[key][tuple(slice(a, b) for a, b in slices)]
                    boxes.append(src.t() if transposed else src)
                sent = transport.send_boxes(group, plan.trainers + dst, boxes, dtype,
                                            plan.bucket_bytes, checksum=self.verify)  # fmt: skip
                for i, crc in zip(by_dst[dst], sent, strict=True):
                    crcs[i] = crc
        self._before_ready(None)
        return crcs

    def _before_ready(self, segment: ShmSegment | None) -> None:
        """Test hook: runs after staging, before the engine reads the segment."""


def _named_tensors(model):
    if isinstance(model, nn.Module):
        return list(model.named_parameters())
    return list(model.items())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
