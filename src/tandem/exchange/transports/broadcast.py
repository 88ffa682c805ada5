"""The engine's end of vLLM's RL weight transfer (`tandem.server.weight_transfer` drives it): one
trainer rank broadcasts named full tensors to a process group of itself and every receiving
rank, and each rank keeps the pieces its parameters hold.

The group is the one vLLM's trainer-side client makes (`NCCLWeightTransferInitInfo`): the
trainer is rank 0 and hosts the c10d store at ``master_address:master_port``, receiving rank
``i`` of the target is rank ``rank_offset + i``. On CPU the broadcasts run over gloo in the
prefix `GROUP_PREFIX` of that store (vLLM's client speaks NCCL only; `tandem.integrations.vllm.
rl_client` gives it this gloo group). Tensors travel in the order the call lists them, one
broadcast each, or packed: uint8 buffers cut by vLLM's rule (`chunks`). Nothing but the
tensors' bytes is on the wire; names, dtypes and shapes come in the HTTP call.

Every rank receives every byte (a broadcast), lands its records' boxes (staged beside the live
parameters, or in place), and checks: a tensor whose sender gave its CRC32 (tandem's own
client does, vLLM's does not) is compared with what arrived, and every landed box is read back
after the call against the CRC32 taken as it was copied out of the received tensor (a box
written over by another lands wrong and fails). A record's ``offset`` is the index of its
tensor in the call; its region is a whole piece of its parameter.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.dtypes import DTYPES
from tandem.exchange.checksum import checked_copy, crc32, tensor_crc32
from tandem.exchange.items import Record
from tandem.exchange.settings import BroadcastTensor, GroupInfo, UpdateSpec
from tandem.exchange.transports.base import ReceiverHalf, Transport

GROUP_PREFIX = "weight_transfer_gloo"


def nbytes(t: BroadcastTensor) -> int:
    return math.prod(t.shape) * DTYPES[t.dtype].itemsize


def chunks(sizes: list[int], packed_bytes: int) -> list[list[int]]:
    """The broadcasts of one call, as lists of tensor indices: one tensor each when
    ``packed_bytes`` is 0; else vLLM's packing, tensors added in order until the running total
    exceeds ``packed_bytes`` (the tensor that crosses it included), the rest last."""
    if packed_bytes <= 0:
        return [[i] for i in range(len(sizes))]
    out, open_, total = [], [], 0
    for i, n in enumerate(sizes):
        open_.append(i)
        total += n
        if total > packed_bytes:
            out.append(open_)
            open_, total = [], 0
    if open_:
        out.append(open_)
    return out


_groups: dict[tuple, tuple[dist.Store, dist.ProcessGroup]] = {}


def join(info: GroupInfo, rank: int) -> dist.ProcessGroup:
    """This process's handle on the trainer's group (made once per address, then reused)."""
    key = (info.host, info.port, rank)
    if key not in _groups:
        try:  # the store's client retries once: half the timeout each, so the join ends
            # within the push phase's deadline; it returns once every rank is connected
            store = dist.TCPStore(
                info.host,
                info.port,
                info.world,
                is_master=False,
                timeout=timedelta(seconds=info.timeout_s / 2),
                use_libuv=False,
            )
            group = gloo_group(store, rank, info.world, info.timeout_s, info.prefix)
        except RuntimeError as exc:
            raise RuntimeError(
                f"the trainer's group at {info.host}:{info.port} did not form "
                f"within {info.timeout_s:g} s: {exc}"
            ) from None
        _groups[key] = (store, group)
    return _groups[key][1]


def gloo_group(
    store: dist.Store, rank: int, world: int, timeout_s: float, prefix: str = GROUP_PREFIX
) -> dist.ProcessGroup:
    """The group's gloo handle at ``rank``, over the trainer's store (both ends make it so)."""
    return dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store), rank, world, timedelta(seconds=timeout_s)
    )


def leave(info: GroupInfo) -> None:
    """Drop this process's handles on the group at ``info``'s address."""
    for key in [k for k in _groups if k[:2] == (info.host, info.port)]:
        _, group = _groups.pop(key)
        try:
            group.abort()
        except Exception:  # already broken
            pass


def broadcast(group: dist.ProcessGroup, buf: torch.Tensor) -> None:
    """``buf`` from rank 0 to every rank of ``group`` (in place)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


class BroadcastReceiver(ReceiverHalf):
    def __init__(self, model, rank, device):
        super().__init__(model, rank, device)
        self._staged: dict[tuple, torch.Tensor] = {}  # (key, slices) -> staged box
        self._pieces: dict[tuple, object] | None = None

    def receive(self, spec: UpdateSpec, records: list[Record]) -> int:
        """Take part in every broadcast of the call; land this rank's records' boxes."""
        call = spec.broadcast
        tensors = call.tensors
        if call.join:  # a handle on an earlier group at this address: a restarted trainer
            leave(spec.group)
        group = join(spec.group, spec.trainers + spec.first_rank + self.rank)
        mine: dict[int, list[Record]] = {}
        for r in records:
            mine.setdefault(r.offset, []).append(r)
        landed: list[tuple[Record, torch.Tensor, int]] = []
        problems: list[str] = []  # the rest of the call is still received: no rank may
        received = 0  # leave a broadcast the trainer has begun
        try:
            for chunk in chunks([nbytes(t) for t in tensors], call.packed_bytes):
                buf = torch.empty(sum(nbytes(tensors[i]) for i in chunk), dtype=torch.uint8)
                broadcast(group, buf)
                received += buf.numel()
                at = 0
                for i in chunk:
                    t = tensors[i]
                    raw = buf[at : at + nbytes(t)]
                    at += nbytes(t)
                    if t.crc is not None and crc32(raw) != t.crc:
                        problems.append(f"checksum mismatch for {t.name} as received")
                    elif mine.get(i) and not problems:
                        landed += self._land(spec, t, raw, mine[i])
        except RuntimeError:  # the group broke (the trainer died, a timeout): leave it
            leave(spec.group)
            raise
        problems += [
            f"checksum mismatch for {r.where} as landed"
            for r, box, crc in landed
            if tensor_crc32(box) != crc
        ]
        if problems:
            raise ValueError("; ".join(problems[:10]))
        return received

    def _land(self, spec: UpdateSpec, t: BroadcastTensor, raw: torch.Tensor, records: list[Record]):
        dtype = DTYPES[t.dtype]
        if raw.storage_offset() % dtype.itemsize:  # packed after an odd-sized tensor
            raw = raw.clone()
        full = raw.view(dtype).view(t.shape)
        pieces = self._piece_index()
        out = []
        with torch.no_grad():
            for r in records:
                piece = pieces[(r.key, r.region)]
                if piece.name != t.name:  # a plan that disagrees with the model: a bug
                    raise RuntimeError(f"{r.where} holds {piece.name}, not {t.name}")
                src = full[piece.box_slices()]
                dst = self._target(spec, r)
                out.append((r, dst, checked_copy(src, dst, True)))
        return out

    def _target(self, spec: UpdateSpec, r: Record) -> torch.Tensor:
        if spec.settings.in_place:
            return self.live([r])[0]
        key = (r.key, r.region.slices)
        if key not in self._staged:
            self._staged[key] = torch.empty(r.box_shape, dtype=DTYPES[r.dtype], device=self.device)
        return self._staged[key]

    def _piece_index(self) -> dict:
        if self._pieces is None:
            self._pieces = {
                (name, piece.region()): piece
                for name, p in self.model.named_parameters()
                for piece in getattr(p, "pieces", ())
            }
        return self._pieces

    def landed(self, spec: UpdateSpec, records: list[Record]) -> list[torch.Tensor]:
        if spec.settings.in_place:
            return self.live(records)
        missing = [r.where for r in records if (r.key, r.region.slices) not in self._staged]
        if missing:
            raise ValueError(f"{len(missing)} box(es) never arrived, {missing[:3]} first")
        return [self._staged[(r.key, r.region.slices)] for r in records]

    def commit(self, spec: UpdateSpec, records: list[Record]) -> int:
        try:
            return super().commit(spec, records)
        finally:
            self.release(spec)

    def landed_crcs(self, spec: UpdateSpec, records: list[Record]) -> list[int | None]:
        return [None] * len(records)  # checked as they landed (no sender CRC32 per record)

    def release(self, spec: UpdateSpec) -> None:
        self._staged = {}

    def abort(self, spec: UpdateSpec) -> None:
        self.release(spec)


class BroadcastTransport(Transport):
    name = "broadcast"
    modes = ("staged", "in_place")
    sender = None  # the trainer's broadcasts: `tandem.server.weight_transfer` drives it
    receiver = BroadcastReceiver
    engine_receives = True
    device_types = ("cpu",)


def group_info(host: str, port: int, world: int, timeout_s: float) -> GroupInfo:
    return GroupInfo(host, port, GROUP_PREFIX, world, "gloo", timeout_s)
