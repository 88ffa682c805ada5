"""Messages between trainer ranks (`WeightSender`) and an engine's exchange server.

One push: every trainer rank connects and says what it holds and how it wants to push
(`PushHello`); the engine plans and tells each rank which boxes to send where (`PushPlan`, one
`SendItem` each); each rank delivers them through its transport's sender half and reports the
CRC32 it read from its tensors and the bytes it moved (`PushReady`); the engine's ranks verify
what landed, commit, and the engine answers everyone (`PushDone`). Every message is typed and
registered with the `PUSH` codec (`tandem.wire.Codec`: msgpack); tensor bytes never travel in
these frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.exchange.items import DeltaBox, SendItem
from tandem.exchange.layout import RankLayout
from tandem.exchange.quantize import Quantized
from tandem.exchange.settings import GroupInfo, PushSettings
from tandem.wire import Codec

PUSH = Codec("exchange")


@PUSH.register("hello")
@dataclass(slots=True)
class PushHello:
    """A trainer rank's first message, after the exchange's token (`tandem.wire.send_token`)."""

    rank: int  # this trainer rank
    world: int  # trainer ranks taking part in the push
    version: int | None  # None: the engine's current version + 1
    layout: RankLayout
    ignore: list[str]  # sender tensors the engine does not need (e.g. a value head)
    settings: PushSettings
    rollback: bool = False  # a version not above the served one is meant (else refused)
    # `WeightSender.push`'s ``delta``: "auto" | "on" | "off"; ``base``: the id of the push
    # this rank's shadow holds (None: none; `tandem.exchange.delta`)
    delta: str = "off"
    base: str | None = None
    # a copy, untouched, of the weights push ``copy_of`` landed (a live replica in the
    # trainer's role, `tandem.fleet.peer`): once it lands the target holds that push's
    # weights, its base for deltas (the whole-box checks of a delta catch a false claim)
    copy_of: str | None = None


@PUSH.register("plan")
@dataclass(slots=True)
class PushPlan:
    dtype: str  # the engine's compute dtype (each item says the dtype it travels in)
    size: int  # bytes of this rank's staging memory (staged shm, cuda_ipc)
    items: list[SendItem]
    # block-FP8 weights whose scales the trainer ranks agree on, then quantize their boxes
    # with (the same list on every rank: `tandem.exchange.quantize`)
    quantize: list[Quantized] = field(default_factory=list)
    group: GroupInfo | None = None  # dist: this rank is its trainer rank
    trainers: int = 1  # dist: engine rank e is group rank trainers + e
    bucket_bytes: int = 0
    arenas: list[list] | None = None  # shm in_place: `ParamArena.handle()` per engine rank
    # a delta push: encode every item against the shadow and answer `PushEncoded` first (the
    # plan to deliver follows: each item then a payload read from `delta.PAYLOAD_KEY`)
    encode: bool = False
    delta: bool = False  # the items carry payloads (the answer to `PushEncoded`)


@PUSH.register("encoded")
@dataclass(slots=True)
class PushEncoded:
    """A trainer rank's answer to a plan that asks to encode: per item how its payload applies,
    or ``dense``: why this rank cannot send a delta (the whole push then goes dense)."""

    boxes: list[DeltaBox] = field(default_factory=list)
    dense: str | None = None


@PUSH.register("ready")
@dataclass(slots=True)
class PushReady:
    crcs: list[int | None]  # per item, in PushPlan order: CRC32 of the box as read
    bytes_moved: list[int]  # per engine rank, as this rank's transport counted them
    staging: list | None = None  # staged shm / cuda_ipc: the handle of this rank's staging


@dataclass(frozen=True, slots=True)
class ReplicaPush:
    """One replica's part of a push (a single engine is replica 0)."""

    replica: int
    bytes_needed: int  # what its ranks hold, in the engine's dtype
    bytes_in: int  # arrived at its ranks (received, or copied from the senders' staging)
    bytes_relayed: int  # passed on to other replicas
    seconds: float  # its phases, from opening its window to its commit
    # "committed"; "rolling" (the answer to a rolling push's senders, before every wave has
    # committed: it holds the version or gets it in its wave); "failed" (it left the push and
    # is quarantined: ``error`` says why)
    state: str = "committed"
    error: str | None = None


@PUSH.register("done")
@dataclass(slots=True)
class PushDone:
    version: int
    error: str | None  # None: committed (or, rolling, held by every replica in the push)
    bytes_needed: int = 0  # one copy of what the target holds (each distinct replica layout)
    bytes_moved: int = 0  # by all trainer ranks, as their transports counted
    replicas: list[ReplicaPush] = field(default_factory=list)
    # refused before any byte moved: ``version`` is not above this served one
    # (`tandem.errors.StaleVersionError`)
    stale_served: int | None = None
    delta: bool = False  # the push sent changed elements only
    why_dense: str | None = None  # a push that could have gone as a delta: why it did not
    # the push's id, what a trainer's shadow is the base of from now on ("": the target does
    # not keep it, `WeightTarget.weight_base`: no shadow is kept)
    push_id: str = ""


@PUSH.register("rollout_progress")
@dataclass(slots=True)
class RolloutProgress:
    """A rolling push still rolling out (sent every few seconds after its `PushDone`, so a
    trainer waiting on it tells a slow rollout from a lost engine): the replicas so far."""

    version: int
    replicas: list[ReplicaPush] = field(default_factory=list)


@PUSH.register("rollout_done")
@dataclass(slots=True)
class RolloutDone:
    """A rolling push's end: how each replica came out (``committed``, or ``failed`` saying
    why: lost before its wave, or its commit failed); ``error``: it committed nowhere."""

    version: int
    replicas: list[ReplicaPush] = field(default_factory=list)
    error: str | None = None
