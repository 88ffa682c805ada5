"""Transport over torch.distributed point-to-point: trainer ranks and engine ranks in one
process group of their own (gloo on CPU, NCCL on CUDA), on one host or across hosts.

The group is separate from the trainer's and the engine's own groups: it rendezvouses through
a c10d store the engine's exchange server hosts. Boxes travel in buckets of bounded size; the
sender packs bucket k+1 while bucket k is on the wire. Every sender walks its destinations in
rank order and every receiver its sources in rank order, so blocking point-to-point operations
can never wait in a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.exchange.checksum import crc32

DEFAULT_BUCKET_BYTES = 64 << 20

_groups: dict[tuple, dist.ProcessGroup] = {}


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """Where and how to join a push's process group (sent in the plan, as a list)."""

    host: str
    port: int
    prefix: str  # one per group generation: a failed push retires its group
    world: int  # trainer ranks + engine ranks
    backend: str

    def to_wire(self) -> list:
        return [self.host, self.port, self.prefix, self.world, self.backend]

    @classmethod
    def from_wire(cls, w: list) -> GroupInfo:
        return cls(*w)


def join(info: GroupInfo, rank: int, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """This process's handle on the group (created once per generation, then reused)."""
    key = (info.host, info.port, info.prefix, rank)
    if key not in _groups:
        for old in [k for k in _groups if k[:2] == key[:2] and k[2] != info.prefix]:
            del _groups[old]  # an older generation, retired after a failure
        store = dist.TCPStore(info.host, info.port, is_master=False,
                              timeout=timedelta(seconds=timeout_s))  # fmt: skip
        prefixed = dist.PrefixStore(info.prefix, store)
        if info.backend == "nccl":
            group = dist.ProcessGroupNCCL(prefixed, rank, info.world)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, info.world, timedelta(seconds=timeout_s))
        _groups[key] = group
    return _groups[key]


def buckets(nbytes: list[int], limit: int) -> list[list[int]]:
    """Consecutive items (by index) in buckets of at most ``limit`` bytes (an item larger than
    the limit travels alone). Both ends compute the same buckets from the same list."""
    out: list[list[int]] = []
    size = 0
    for i, n in enumerate(nbytes):
        if not out or (size + n > limit and out[-1]):
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def send_boxes(group, dst: int, boxes: list[torch.Tensor], dtype: torch.dtype,
               limit: int, checksum: bool = True) -> list[int | None]:  # fmt: skip
    """Send ``boxes`` (packed in ``dtype``) to ``dst`` in buckets; returns each box's CRC32.
    Two buffers alternate so packing the next bucket overlaps sending this one."""
    sizes = [b.numel() * dtype.itemsize for b in boxes]
    crcs: list[int | None] = [None] * len(boxes)
    in_flight: list[tuple[dist.Work, torch.Tensor]] = []
    for bucket in buckets(sizes, limit):
        total = sum(sizes[i] for i in bucket)
        buf = torch.empty(total, dtype=torch.uint8, device=boxes[bucket[0]].device)
        offset = 0
        for i in bucket:
            view = buf[offset : offset + sizes[i]].view(dtype).view(boxes[i].shape)
            view.copy_(boxes[i])
            crcs[i] = crc32(buf[offset : offset + sizes[i]]) if checksum else None
            offset += sizes[i]
        if len(in_flight) == 2:
            in_flight.pop(0)[0].wait()
        in_flight.append((group.send([buf], dst, 0), buf))
    for work, _ in in_flight:
        work.wait()
    return crcs


def recv_boxes(group, src: int, sizes: list[int], limit: int, device, *, staging=None,
               place=None, checksum: bool = True) -> list[int | None]:  # fmt: skip
    """Receive the boxes ``src`` sends (same order and bucketing as `send_boxes`) into
    ``staging`` (a uint8 tensor of all their bytes, in order), or bucket by bucket handing each
    box to ``place(index, uint8 tensor)``. Returns each box's CRC32 as received."""
    crcs: list[int | None] = [None] * len(sizes)
    start = 0
    for bucket in buckets(sizes, limit):
        total = sum(sizes[i] for i in bucket)
        if staging is not None:
            buf = staging[start : start + total]
        else:
            buf = torch.empty(total, dtype=torch.uint8, device=device)
        group.recv([buf], src, 0).wait()
        offset = 0
        for i in bucket:
            part = buf[offset : offset + sizes[i]]
            crcs[i] = crc32(part) if checksum else None
            if place is not None:
                place(i, part)
            offset += sizes[i]
        start += total
    return crcs
