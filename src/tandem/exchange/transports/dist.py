"""Transport over torch.distributed point-to-point (`p2p`): trainer ranks send each engine rank
its boxes in bounded messages; the engine ranks receive them into a staging buffer of their
own (``staged``: committed only once complete and verified) or straight into their live
parameters (``in_place``). Works across hosts; gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.dtypes import WIRE_DTYPES
from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.protocol import PushPlan
from tandem.exchange.settings import GroupInfo, UpdateSpec
from tandem.exchange.transports import p2p
from tandem.exchange.transports.base import (
    Coordinator,
    Delivery,
    ReceiverHalf,
    SenderHalf,
    Transport,
)


class DistSender(SenderHalf):
    def deliver(self, plan, tensors: dict[str, torch.Tensor]) -> Delivery:
        """Send each engine rank its boxes, engine ranks in `p2p.stream_order`."""
        info = plan.group
        group = p2p.join(info, self.rank, info.timeout_s)
        by_dst: dict[int, list[int]] = {}
        for i, item in enumerate(plan.items):
            by_dst.setdefault(item.dst, []).append(i)
        crcs: list[int | None] = [None] * len(plan.items)
        moved = [0] * (info.world - plan.trainers)
        order = p2p.stream_order(
            self.rank, by_dst, plan.trainers, info.world - plan.trainers, sending=True
        )
        with torch.no_grad():
            for dst in order:
                boxes = [self.source(tensors, plan.items[i]) for i in by_dst[dst]]
                dtypes = [WIRE_DTYPES[plan.items[i].dtype] for i in by_dst[dst]]
                try:
                    sent, moved[dst] = p2p.send_boxes(
                        group,
                        plan.trainers + dst,
                        boxes,
                        dtypes,
                        plan.bucket_bytes,
                        self.settings.verify,
                    )
                except RuntimeError as exc:  # gloo / NCCL: a peer died or left the group
                    p2p.abandon(info)  # so engine ranks waiting on this one fail too
                    raise p2p.GroupBroken(str(exc)) from None
                for i, crc in zip(by_dst[dst], sent, strict=True):
                    crcs[i] = crc
        return Delivery(crcs, moved)


class DistReceiver(ReceiverHalf):
    def __init__(self, model, rank, device):
        super().__init__(model, rank, device)
        self._staging: torch.Tensor | None = None  # staged: reused by every push
        self._received: dict[int, tuple[list, list]] = {}  # version -> boxes, CRC32s

    def receive(self, spec: UpdateSpec, records: list[Record]) -> int:
        """Take every stream's boxes — each trainer rank's, in `p2p.stream_order`, then a
        relay's from the receiving rank before this one (`Record.via`) — into this rank's
        staging buffer (kept for later pushes, so they touch no new memory), or straight into
        the live parameters (in_place), checksumming each box as it lands: in place, read
        back through each record's own region (`live`), not the receive's target, so a
        misplaced write cannot pass. Boxes this rank relays on (`Record.forward`) leave for
        the next rank as they land (`p2p.Forwarder`)."""
        info = spec.group
        me = spec.first_rank + self.rank  # this rank's number across the target
        group = p2p.join(info, spec.trainers + me, info.timeout_s)
        relayed = sorted({r.via for r in records if r.via >= 0})
        streams = [
            (src, [i for i, r in enumerate(records) if r.source == src and r.via < 0])
            for src in range(spec.trainers)
        ]
        streams += [
            (spec.trainers + via, [i for i, r in enumerate(records) if r.via == via])
            for via in relayed
        ]
        readback = None
        if spec.settings.in_place:
            if relayed or any(r.forward for r in records):
                raise ValueError("relays carry staged pushes only")
            boxes, readback = self.targets(records), self.live(records)
        else:
            total = sum(r.nbytes for r in records)
            if self._staging is None or self._staging.numel() < total:
                self._staging = None
                self._staging = torch.zeros(total, dtype=torch.uint8, device=self.device)
            boxes, start = [None] * len(records), 0
            starts = {}  # each stream's boxes back to back, in its order
            for src, mine in streams:
                starts[src] = start
                for i in mine:
                    r = records[i]
                    boxes[i] = (
                        self._staging[start : start + r.nbytes]
                        .view(WIRE_DTYPES[r.dtype])
                        .view(r.box_shape)
                    )
                    start += r.nbytes
        forwarders = self._forwarders(group, spec, records, boxes)
        crcs: list = [None] * len(records)
        order = p2p.stream_order(
            me, range(spec.trainers), spec.trainers, info.world - spec.trainers, sending=False
        )
        order += [spec.trainers + via for via in relayed]
        mine_of = dict(streams)
        moved = 0
        for src in order:  # the order every rank agrees on: no cyclic waits
            mine = mine_of[src]
            if not mine:
                continue
            sizes = [records[i].nbytes for i in mine]
            rows = [_rows(records[i]) for i in mine]
            if spec.settings.in_place:
                into = {
                    "targets": [boxes[i] for i in mine],
                    "readback": [readback[i] for i in mine],
                }
            else:
                into = {"staging": self._staging[starts[src] : starts[src] + sum(sizes)]}

            def landed(k: int, mine=mine) -> None:
                for forwarder, index in forwarders.get(mine[k], ()):
                    forwarder.landed(index)

            with torch.no_grad():
                got = p2p.recv_boxes(
                    group,
                    src,
                    sizes,
                    rows,
                    spec.bucket_bytes,
                    checksum=spec.settings.verify,
                    on_landed=landed,
                    **into,
                )
            for i, crc in zip(mine, got, strict=True):
                crcs[i] = crc
            moved += sum(sizes)
        for forwarder in {id(f): f for fs in forwarders.values() for f, _ in fs}.values():
            forwarder.finish()
        self._received = {spec.version: (readback or boxes, crcs)}
        return moved

    def _forwarders(self, group, spec: UpdateSpec, records: list[Record], boxes: list):
        """Record index -> (the `p2p.Forwarder` that passes its box on, the box's index in
        that forwarder's stream), one per next rank."""
        out: dict[int, list[tuple[p2p.Forwarder, int]]] = {}
        for dst in sorted({d for r in records for d in r.forward}):
            mine = [i for i, r in enumerate(records) if dst in r.forward]
            data = [boxes[i].reshape(-1).view(torch.uint8) for i in mine]
            forwarder = p2p.Forwarder(
                group,
                spec.trainers + dst,
                data,
                [_rows(records[i]) for i in mine],
                spec.bucket_bytes,
            )
            for k, i in enumerate(mine):
                out.setdefault(i, []).append((forwarder, k))
        return out

    def targets(self, records: list[Record]) -> list[torch.Tensor]:
        """in_place: where the receive writes each box (its live region)."""
        return self.live(records)

    def landed(self, spec: UpdateSpec, records: list[Record]) -> list[torch.Tensor]:
        if spec.settings.in_place:
            return self.live(records)
        return self._received[spec.version][0]

    def landed_crcs(self, spec: UpdateSpec, records: list[Record]) -> list[int]:
        """What was taken as each box landed (no second pass)."""
        return self._received[spec.version][1]

    def commit(self, spec: UpdateSpec, records: list[Record]) -> int:
        try:
            return super().commit(spec, records)
        finally:
            self.release(spec)

    def release(self, spec: UpdateSpec) -> None:
        self._received = {}

    def abort(self, spec: UpdateSpec) -> None:
        self._received = {}
        if spec.group is not None:
            p2p.abandon(spec.group)


def _rows(record: Record) -> int:
    return record.box_shape[0] if record.box_shape else 1


class DistCoordinator(Coordinator):
    """The process group of trainer ranks and receiving ranks: it rendezvouses through a c10d
    store hosted by the exchange server (made on first use); a group lasts while the numbers of
    trainer and receiving ranks stay the same and no push fails (then the next push makes a
    new one). Joining it and every operation in it time out after ``timeout_s``."""

    def __init__(self, host: str, timeout_s: float):
        super().__init__(host, timeout_s)
        self.bucket_bytes = p2p.DEFAULT_BUCKET_BYTES
        self._store: dist.TCPStore | None = None
        self._generation = 0
        self._world: tuple[int, int] | None = None  # (trainer ranks, receiving ranks)

    def prepare(
        self, spec: UpdateSpec, plans: list[PushPlan], receivers: list[RankLayout], device_type: str
    ) -> UpdateSpec:
        group = self._group(spec.trainers, len(receivers), device_type)
        spec = dataclasses.replace(spec, group=group, bucket_bytes=self.bucket_bytes)
        for plan in plans:
            plan.group, plan.trainers, plan.bucket_bytes = (
                group,
                spec.trainers,
                spec.bucket_bytes,
            )
        return spec

    def _group(self, trainers: int, receivers: int, device_type: str) -> GroupInfo:
        if self._store is None:
            self._store = dist.TCPStore(
                self.host,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=self.timeout_s),
            )
        if self._world != (trainers, receivers):  # a replica left or joined a fleet, say
            self.retire()
            self._world = (trainers, receivers)
        backend = "nccl" if device_type == "cuda" else "gloo"
        return GroupInfo(
            self.host,
            self._store.port,
            f"exchange/{self._generation}",
            trainers + receivers,
            backend,
            self.timeout_s,
        )

    def retire(self) -> None:
        """After a failure the group may hold half-done operations: the next push makes anew."""
        self._generation += 1


class DistTransport(Transport):
    name = "dist"
    modes = ("staged", "in_place")
    delta_pays = True
    sender = DistSender
    receiver = DistReceiver
    coordinator = DistCoordinator
    engine_receives = True
    per_stream_offsets = True
