"""Typed settings of one push: what the trainer asks for (`PushSettings`), what every engine
rank is told when it takes part (`UpdateSpec`), and the phases it runs (`PushPhase`). They
cross processes inside typed messages (`tandem.wire.Codec`). Plain data: transports read it,
and the registry (`tandem.exchange.transports.check`) says which transport names and modes
exist."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PushPhase(Enum):
    """What an engine rank does in one step of a push (`tandem.exchange.receiver`); every rank
    finishes a phase before any starts the next."""

    RECEIVE = "receive"  # the transport delivers this rank's boxes (staged, or live in place)
    VERIFY = "verify"  # names, shapes and dtypes; then checksums of what landed
    COMMIT = "commit"  # staged boxes into the live parameters (checked again there)
    ABORT = "abort"  # drop whatever the push held


MODES = ("staged", "in_place")  # every transport supports some of these (`Transport.modes`)


@dataclass(frozen=True, slots=True)
class PushSettings:
    """How a push travels. ``transport``: a name in `tandem.exchange.transports.TRANSPORTS`;
    ``mode``: ``staged`` (the push lands beside the live weights and is committed only when
    complete and verified: a failure leaves the old version serving) or ``in_place`` (bytes
    land straight in the live parameters: no extra memory, but a failed push leaves the engine
    refusing requests until a complete push lands); ``verify``: CRC32 every box on both ends."""

    transport: str
    mode: str = "staged"
    verify: bool = True

    def __post_init__(self):
        if not isinstance(self.transport, str) or not self.transport:
            raise ValueError(f"transport must be a transport's name, got {self.transport!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be a bool, got {self.verify!r}")

    @property
    def in_place(self) -> bool:
        return self.mode == "in_place"


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """Where and how to join a push's process group (the dist transport: in the plan and the
    engine's spec)."""

    host: str
    port: int
    prefix: str  # one per group generation: a failed push retires its group
    world: int  # trainer ranks + engine ranks
    backend: str


@dataclass(frozen=True, slots=True)
class UpdateSpec:
    """One push as every engine rank sees it: its settings, the engine's dtype, how many trainer
    ranks send, and where to find their bytes (``staging``: per trainer rank, the handle of its
    staged memory, as its transport made it; ``group``: the dist transport's process group;
    ``first_rank``: the target-wide number of this engine's rank 0, where the target is a fleet
    of engines whose ranks are numbered one after another)."""

    version: int
    settings: PushSettings
    dtype: str
    trainers: int
    staging: tuple[list | None, ...] | None = None
    group: GroupInfo | None = None
    bucket_bytes: int = 0
    first_rank: int = 0
