"""The interface every transport implements: a sender half (in each trainer rank) and a
receiver half (in each engine rank). Transports carry out plans; they never decide what goes
where, and they never judge a push: the receiver checks what landed against the CRC32s the
senders read from their tensors (`tandem.exchange.receiver`).

A push, per transport (`UpdateSpec` tells every engine rank which):

- sender ``deliver``: stage or write or send this rank's `SendItem`s, returning the CRC32 of
  each box as read from the trainer's tensor and the bytes moved per engine rank, counted;
- receiver ``receive`` (transports that move bytes into the engine themselves: dist while
  the senders send, mooncake once they are ready);
- receiver ``landed``: every record's bytes where they are now (staging, or the live
  parameter), which the receiver checksums;
- receiver ``commit``: staged transports copy staging into the live parameters (then the
  parameters are checksummed again); ``abort`` drops whatever the push held.

- the exchange server's `Coordinator` (one per server): what the halves need beyond the plan,
  added to every push's spec and plans (dist: the process group; shm in place: the arenas).

What sets a transport apart is said by its `Transport` entry (its attributes and its
coordinator), never by testing its name. A new transport (RDMA, say) is one module with the
two halves, a `Transport` subclass and an entry in `TRANSPORTS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.dtypes import WIRE_DTYPES
from tandem.exchange.checksum import checked_copy, tensor_crc32
from tandem.exchange.items import Record, SendItem
from tandem.exchange.layout import RankLayout
from tandem.exchange.protocol import PushPlan
from tandem.exchange.settings import PushSettings, UpdateSpec


@dataclass(slots=True)
class Delivery:
    """What a sender half did: per item the CRC32 read from the trainer's tensor (None when
    unverified), bytes moved per engine rank (counted as they were written or sent), the
    handle of its staging memory (staged transports), and what must stay alive until the
    engine has answered."""

    crcs: list[int | None]
    bytes_moved: list[int]
    staging: list | None = None
    keep: object = field(default=None, repr=False)
    bytes_staged: int | None = None  # copied into staging where others are read in place


class SenderHalf:
    """A trainer rank's end of a transport. One per `WeightSender` and transport; it may keep
    memory (staging, mappings) between pushes until `close`."""

    def __init__(self, settings: PushSettings, device: torch.device, rank: int):
        self.settings = settings
        self.device = device
        self.rank = rank  # this trainer rank

    def deliver(self, plan, tensors: dict[str, torch.Tensor]) -> Delivery:
        """Carry out this rank's part of ``plan`` (a `PushPlan`) from its local ``tensors``."""
        raise NotImplementedError

    def write_box(self, src: torch.Tensor, dst: torch.Tensor) -> int | None:
        """The writer: copy one box (canonical orientation) to where it goes; returns the CRC32
        of ``src`` as it must land (never of ``dst``: the receiver checks that)."""
        return checked_copy(src, dst, self.settings.verify)

    def close(self) -> None:
        """Release what this half keeps between pushes."""

    def write_items(self, plan, tensors: dict[str, torch.Tensor], targets: list[torch.Tensor]):
        """Write every item of ``plan`` into its target (`write_box`): (the CRC32 of each as
        read, the bytes written per engine rank, counted as they were written)."""
        crcs = []
        moved = [0] * (1 + max((item.dst for item in plan.items), default=-1))
        with torch.no_grad():
            for item, dst in zip(plan.items, targets, strict=True):
                crcs.append(self.write_box(self.source(tensors, item), dst))
                moved[item.dst] += dst.numel() * dst.element_size()
        return crcs, moved

    @staticmethod
    def staged(plan, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each item's place in a uint8 staging buffer, in its dtype and box shape."""
        return [
            buf[item.offset : item.offset + item.nbytes]
            .view(WIRE_DTYPES[item.dtype])
            .view(item.box_shape)
            for item in plan.items
        ]

    @staticmethod
    def source(tensors: dict[str, torch.Tensor], item: SendItem) -> torch.Tensor:
        """The box ``item`` reads, in canonical orientation (a view of the trainer's tensor)."""
        return item.src.view(tensors[item.key])


class ReceiverHalf:
    """An engine rank's end of a transport; kept by the rank across pushes (its mappings and
    buffers with it)."""

    def __init__(self, model: nn.Module, rank: int, device: torch.device):
        self.model = model
        self.rank = rank
        self.device = device

    def live(self, records: list[Record]) -> list[torch.Tensor]:
        """Each record's box in its live parameter (a view, canonical orientation)."""
        params = dict(self.model.named_parameters())
        return [r.region.view(params[r.key]) for r in records]

    def receive(self, spec: UpdateSpec, records: list[Record]) -> int:
        """Move this rank's boxes into the engine (transports whose senders cannot write into
        it themselves); the bytes received. Others: nothing to do."""
        return 0

    def landed(self, spec: UpdateSpec, records: list[Record]) -> list[torch.Tensor]:
        """Each record's box where its bytes are now, in canonical orientation and its
        dtype: the staging memory (staged), or the live parameter (in place)."""
        raise NotImplementedError

    def landed_crcs(self, spec: UpdateSpec, records: list[Record]) -> list[int]:
        """The CRC32 of each landed box (transports that checksum as bytes arrive override
        this to report what they took then)."""
        return [tensor_crc32(box) for box in self.landed(spec, records)]

    def commit(self, spec: UpdateSpec, records: list[Record]) -> int:
        """Staged transports: copy every landed box into its live parameter; the bytes
        written. In place: nothing left to do."""
        if spec.settings.in_place:
            return 0
        with torch.no_grad():
            for box, dst in zip(self.landed(spec, records), self.live(records), strict=True):
                self.write_box(box, dst)
        return sum(r.nbytes for r in records)

    def write_box(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The commit's writer: one staged box into its place in a live parameter."""
        checked_copy(src, dst, verify=False)

    def release(self, spec: UpdateSpec) -> None:
        """The push is committed: forget what it landed (kept memory stays for the next)."""

    def abort(self, spec: UpdateSpec) -> None:
        """The push failed: forget whatever it holds."""


class Coordinator:
    """The exchange server's part of a transport (one per server, kept across pushes): what
    the two halves need beyond the plan. ``host``: the server's; ``timeout_s``: how long a
    push may take to stage."""

    def __init__(self, host: str, timeout_s: float):
        self.host = host
        self.timeout_s = timeout_s

    def prepare(
        self, spec: UpdateSpec, plans: list[PushPlan], receivers: list[RankLayout], device_type: str
    ) -> UpdateSpec:
        """Fill in each trainer rank's plan (in place) for a push to ``receivers`` (held on
        ``device_type``); the spec every receiving rank gets. ValueError if this transport
        cannot carry it."""
        return spec

    def retire(self) -> None:
        """A push failed: nothing it may have left half-done is used again."""


class Transport:
    """A registry entry (`TRANSPORTS`): the transport's name, the modes it supports, its two
    halves and its coordinator, and the facts the exchange server plans by."""

    name: str
    modes: tuple[str, ...]  # of `tandem.exchange.settings.MODES`
    sender: type[SenderHalf] | None  # None: no WeightSender pushes over it (broadcast)
    receiver: type[ReceiverHalf]
    coordinator: type[Coordinator] = Coordinator
    # the receiving ranks take part in moving the bytes (`ReceiverHalf.receive`): the target
    # pauses before the senders deliver
    engine_receives: bool = False
    # a box's offset counts within its (sender, receiving rank) stream, not within the
    # sender's staging memory
    per_stream_offsets: bool = False
    # where the receiving ranks may hold their weights (`WeightTarget.weight_device_type`)
    device_types: tuple[str, ...] = ("cpu", "cuda")
    # staged: any receiving rank on the host can read what a sender staged, so a fleet's
    # relayed replicas read the one staging too (`tandem.exchange.plan.Relay`) instead of
    # being passed the bytes by a replica holding them
    shared_staging: bool = False
    # the receiving ranks pull what the senders staged, once they have (one-sided reads): a
    # RECEIVE phase runs after the senders are ready, before VERIFY
    pulls: bool = False
    # bytes cross a link slower than memory, so sending fewer pays for encoding them
    # (`tandem.exchange.delta`): ``delta="auto"`` sends deltas over it; over a transport that
    # moves bytes at memory speed (shm, CUDA IPC) encoding costs what it saves, and "auto"
    # stays dense (``delta=True`` still sends them)
    delta_pays: bool = False

    def pauses_to_deliver(self, settings: PushSettings) -> bool:
        """Whether the target must stop stepping before the senders deliver (bytes land in
        the live weights, or the receiving ranks take part), not only to verify and commit."""
        return settings.in_place or self.engine_receives

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, modes={self.modes})"
