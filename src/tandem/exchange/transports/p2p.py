"""Point-to-point primitives of the dist transport: trainer ranks and engine ranks in one
process group of their own (gloo on CPU, NCCL on CUDA), on one host or across hosts.

The group is separate from the trainer's and the engine's own groups: it rendezvouses through
a c10d store the engine's exchange server hosts. Boxes travel in messages of bounded size
(`frames`): a large box straight from the sender's memory into the receiver's where both are
contiguous, small ones packed into one of two reusable buffers while the other is on the wire.
Messages are a few MiB, so a box's CRC32 is taken while its bytes are in cache on both ends
(the sender's from its source, as it reads it to send; the receiver's from the bytes in their
final place, as each message lands there) rather than in a pass of its own over memory.
Senders and receivers walk their streams in one agreed order
(`stream_order`), and within one stream each side waits only for its own earlier messages, so
the point-to-point operations can never wait in a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.exchange.checksum import checked_copy, tensor_crc32
from tandem.exchange.settings import GroupInfo

DEFAULT_BUCKET_BYTES = 4 << 20

_groups: dict[tuple, dist.ProcessGroup] = {}


def join(info: GroupInfo, rank: int, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """This process's handle on the group (created once per generation, then reused)."""
    key = (info.host, info.port, info.prefix, rank)
    if key not in _groups:
        for old in [k for k in _groups if k[:2] == key[:2] and k[2] != info.prefix]:
            del _groups[old]  # an older generation, retired after a failure
        try:
            store = dist.TCPStore(
                info.host, info.port, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
            prefixed = dist.PrefixStore(info.prefix, store)
            if info.backend == "nccl":
                group = dist.ProcessGroupNCCL(prefixed, rank, info.world)
            else:
                group = dist.ProcessGroupGloo(
                    prefixed, rank, info.world, timedelta(seconds=timeout_s)
                )
        except RuntimeError as exc:  # a rank never came (dead before joining): give up
            raise GroupBroken(
                f"the push's group did not form within {timeout_s:g} s: {exc}"
            ) from None
        _groups[key] = group
    return _groups[key]


class GroupBroken(RuntimeError):
    """A point-to-point operation failed: a peer died or left the push's group."""


def abandon(info: GroupInfo) -> None:
    """Leave a push's group after a failure: abort this process's handles on it, so a peer
    blocked sending to (or receiving from) this process fails at once instead of waiting out
    the timeout. The engine retires the generation; the next push joins a new one."""
    for key in [k for k in _groups if k[:3] == (info.host, info.port, info.prefix)]:
        group = _groups.pop(key)
        try:
            group.abort()
        except Exception:  # already broken: nothing left to release
            pass


def stream_order(rank: int, peers, senders: int, receivers: int, sending: bool) -> list[int]:
    """The order in which ``rank`` (a sender's index among the senders, or a receiver's among
    the receivers) walks its streams with ``peers``. Round k pairs sender s with receiver
    (s + k) mod max(senders, receivers), so each round is a matching whose streams run side by
    side; both ends walk their streams by (round, sender), one total order, so the
    stream first in it can always progress and no set of ranks can wait in a cycle."""
    span = max(senders, receivers)

    def key(peer: int) -> tuple[int, int]:
        s, d = (rank, peer) if sending else (peer, rank)
        return (d - s) % span, s

    return sorted(peers, key=key)


SMALL_BYTES = 1 << 20  # boxes below this are packed together; larger ones travel as they are


def frames(sizes: list[int], rows: list[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """How a stream of boxes travels: messages of at most ``limit`` bytes, each a list of
    (box index, first row, end row). A box of ``SMALL_BYTES`` or more is cut by whole rows
    into messages of its own (sent from, and received into, its memory where that is
    contiguous); smaller boxes are packed together. Both ends compute the same frames."""
    out: list[list[tuple[int, int, int]]] = []
    packed = 0  # bytes in the open packed frame (out[-1]); 0: none open
    for i, (n, r) in enumerate(zip(sizes, rows, strict=True)):
        if n >= min(SMALL_BYTES, limit):
            per = max(1, limit // max(1, n // r))
            out.extend([(i, a, min(a + per, r))] for a in range(0, r, per))
            packed = 0
        elif packed and packed + n <= limit:
            out[-1].append((i, 0, r))
            packed += n
        else:
            out.append([(i, 0, r)])
            packed = n
    return out


def _rows(box: torch.Tensor) -> torch.Tensor:
    return box.view(1) if box.dim() == 0 else box


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class Slots:
    """Two reusable message buffers (allocated and touched once per process, side and device),
    so packing the next message overlaps sending this one and no push page-faults new memory.
    The sending and the receiving side have their own (an engine in the trainer's process)."""

    _cache: dict[tuple[str, str, int], list[torch.Tensor]] = {}

    def __init__(self, side: str, device, limit: int):
        key = (side, str(device), limit)
        if key not in self._cache:
            self._cache[key] = [
                torch.zeros(limit, dtype=torch.uint8, device=device) for _ in range(2)
            ]
        self.buffers = self._cache[key]
        self.works: list[dist.Work | None] = [None, None]
        self.turn = 0

    def take(self):
        """(index, buffer) of the next buffer, once its previous message is done."""
        k = self.turn
        self.turn ^= 1
        if self.works[k] is not None:
            self.works[k].wait()
            self.works[k] = None
        return k, self.buffers[k]


def send_boxes(
    group,
    dst: int,
    boxes: list[torch.Tensor],
    dtypes: list[torch.dtype],
    limit: int,
    checksum: bool = True,
) -> tuple[list[int | None], int]:
    """Send ``boxes`` (each converted to its entry of ``dtypes``) to ``dst`` as `frames`;
    returns each box's CRC32 as read from the box (`checked_copy`: never from a packed copy).
    A contiguous box already in its dtype is sent from its own memory (no copy); the rest are
    packed into two alternating buffers, so packing the next message overlaps this one's
    send. Also returns the bytes sent."""
    boxes = [_rows(b) for b in boxes]
    sizes = [b.numel() * dtype.itemsize for b, dtype in zip(boxes, dtypes, strict=True)]
    crcs: list[int | None] = [0 if checksum else None for _ in boxes]
    slots = Slots("send", boxes[0].device, limit) if boxes else None
    direct_works = []
    for frame in frames(sizes, [b.shape[0] for b in boxes], limit):
        parts = [boxes[i][a:b] for i, a, b in frame]
        if len(parts) == 1 and parts[0].dtype == dtypes[frame[0][0]] and parts[0].is_contiguous():
            data = _bytes(parts[0])
            if checksum:
                crcs[frame[0][0]] = tensor_crc32(data, crcs[frame[0][0]])
            direct_works.append(group.send([data], dst, 0))
            continue
        k, buf = slots.take()
        offset = 0
        for (i, _, _), part in zip(frame, parts, strict=True):
            dtype = dtypes[i]
            n = part.numel() * dtype.itemsize
            # the CRC32 as read from the source, the copy through the cache (gloo reads it next)
            out = buf[offset : offset + n].view(dtype).view(part.shape)
            crcs[i] = checked_copy(part, out, checksum, stream=False, value=crcs[i] or 0)
            offset += n
        slots.works[k] = group.send([buf[:offset]], dst, 0)
    for work in [*direct_works, *(w for w in (slots.works if slots else []) if w is not None)]:
        work.wait()
    return crcs, sum(sizes)


def recv_boxes(
    group,
    src: int,
    sizes: list[int],
    rows: list[int],
    limit: int,
    *,
    staging: torch.Tensor | None = None,
    targets: list[torch.Tensor] | None = None,
    checksum: bool = False,
    readback: list[torch.Tensor] | None = None,
    on_landed: Callable[[int], None] | None = None,
) -> list[int | None]:
    """Receive what ``src`` sends with `send_boxes` (same sizes, rows and limit), either all
    into ``staging`` (a uint8 tensor of the boxes' bytes, back to back; every message straight
    into its place), or into ``targets`` (each box's destination, in the box's orientation):
    straight into it where that is contiguous, else through two alternating buffers, copied
    into place as each message completes. Receives are posted ahead of the data (a buffer is
    posted again only once its previous message is in place). With ``checksum``, returns each
    box's CRC32 as it stands in its final place, taken message by message as each lands —
    while its bytes are still in cache and later messages are still arriving — never in a
    second pass over the whole stream: read from ``readback`` (each box's final place, found
    independently of ``targets``, so a receive into the wrong place cannot pass), else from
    ``staging`` or the target after the copy out of a message buffer (never the buffer).
    ``on_landed(i)`` is called as soon as box i is wholly in place (and checksummed)."""
    plan = frames(sizes, rows, limit)
    crcs: list[int | None] = [0 if checksum else None for _ in sizes]
    slots = None
    if targets is not None:
        targets = [_rows(t) for t in targets]
        if targets:
            slots = Slots("recv", targets[0].device, limit)
    starts = [0] * len(sizes)
    for i in range(1, len(sizes)):
        starts[i] = starts[i - 1] + sizes[i - 1]
    if readback is not None:
        readback = [_rows(t) for t in readback]
    # per message: [work, [(box, its bytes as they land)], slot or None, parts to copy into,
    # its frame]
    posted: list[list] = []
    in_slot = [-1, -1]  # the message each buffer holds
    done = 0  # messages landed (and checksummed) so far, in order

    def land_through(last: int) -> None:
        nonlocal done
        while done <= last:
            work, landed, k, parts, frame = posted[done]
            work.wait()
            for (_, data), part in zip(landed, parts, strict=True) if k is not None else ():
                # through the cache: its CRC32 reads it back next
                checked_copy(data.view(part.dtype).view(part.shape), part, False, stream=False)
            if checksum:  # where the bytes now are
                if readback is not None:
                    final = [readback[i][a:b] for i, a, b in frame]
                else:
                    final = parts if k is not None else [data for _, data in landed]
                for (i, _), data in zip(landed, final, strict=True):
                    crcs[i] = tensor_crc32(data, crcs[i])
            if on_landed is not None:
                for i, _, end in frame:
                    if end == rows[i]:
                        on_landed(i)
            posted[done] = None
            done += 1

    for frame in plan:
        if staging is not None:  # a message's boxes are consecutive there
            landed, bounds = [], []
            for i, a, b in frame:
                row = sizes[i] // rows[i]
                bounds += [starts[i] + row * a, starts[i] + row * b]
                landed.append((i, staging[bounds[-2] : bounds[-1]]))
            data = staging[bounds[0] : bounds[-1]]
            posted.append([group.recv([data], src, 0), landed, None, [], frame])
            continue
        parts = [targets[i][a:b] for i, a, b in frame]
        if len(parts) == 1 and parts[0].is_contiguous():
            data = _bytes(parts[0])
            posted.append([group.recv([data], src, 0), [(frame[0][0], data)], None, [], frame])
            continue
        k = slots.turn
        slots.turn ^= 1
        land_through(in_slot[k])  # the buffer's previous message is in place first
        landed, offset = [], 0
        for (i, _, _), part in zip(frame, parts, strict=True):
            n = part.numel() * part.element_size()
            landed.append((i, slots.buffers[k][offset : offset + n]))
            offset += n
        posted.append([group.recv([slots.buffers[k][:offset]], src, 0), landed, k, parts, frame])
        in_slot[k] = len(posted) - 1
    land_through(len(posted) - 1)
    return crcs


class Forwarder:
    """Passes boxes on to the next receiving rank of a relay as they land here, so a replica
    forwards while it receives: the stream to ``dst`` is ``boxes`` (uint8 slices of this
    rank's staging, consecutive there) framed as `frames` frames them, each message sent once
    every box it holds has landed, in order. The receiving end takes it with `recv_boxes`
    (same sizes, rows and limit)."""

    def __init__(self, group, dst: int, boxes: list[torch.Tensor], rows: list[int], limit: int):
        self.group = group
        self.dst = dst
        self._messages = []  # (bytes to send, the boxes it needs landed)
        for frame in frames([b.numel() for b in boxes], rows, limit):
            parts = []
            for i, a, b in frame:
                row = boxes[i].numel() // rows[i]
                parts.append(boxes[i][row * a : row * b])
            first, last = parts[0], parts[-1]
            span = last.data_ptr() + last.numel() - first.data_ptr()
            if span != sum(p.numel() for p in parts):
                raise RuntimeError(
                    f"relay to rank {dst}: a message's boxes are not consecutive in staging"
                )
            data = boxes[frame[0][0]].as_strided((span,), (1,), first.storage_offset())
            self._messages.append((data, {i for i, _, _ in frame}))
        self._landed: set[int] = set()
        self._next = 0
        self._works: list[dist.Work] = []
        self.bytes_sent = 0

    def landed(self, box: int) -> None:
        """Box ``box`` (an index into ``boxes``) is in place here: send what is ready."""
        self._landed.add(box)
        while self._next < len(self._messages) and self._messages[self._next][1] <= self._landed:
            data = self._messages[self._next][0]
            self._works.append(self.send(data))
            self.bytes_sent += data.numel()
            self._next += 1

    def send(self, data: torch.Tensor) -> dist.Work:
        return self.group.send([data], self.dst, 0)

    def finish(self) -> int:
        """Wait until everything was sent; the bytes sent."""
        if self._next != len(self._messages):
            raise RuntimeError(
                f"relay to rank {self.dst}: {len(self._messages) - self._next} "
                "messages never became ready"
            )
        for work in self._works:
            work.wait()
        return self.bytes_sent
