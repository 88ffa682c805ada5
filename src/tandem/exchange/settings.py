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
    # a rolling push: what landed copied into the rank's own memory and checked there, so the
    # senders are free and the rank commits later, in its wave, while it serves meanwhile
    HOLD = "hold"
    COMMIT = "commit"  # staged (or held) boxes into the live parameters (checked again there)
    ABORT = "abort"  # drop whatever the push held


MODES = ("staged", "in_place")  # every transport supports some of these (`Transport.modes`)
POLICIES = ("all", "rolling")  # how a fleet's replicas commit a push
WAVES = ("wait", "keep")  # a rolling wave's requests: drained first, or kept across the commit


@dataclass(frozen=True, slots=True)
class AdapterPush:
    """A push of a LoRA adapter (not the base weights) into the engine's slot(s) for adapter
    ``name``: rank ``rank`` (PEFT ``r``), scale ``scale`` (PEFT's alpha / r, or alpha /
    sqrt(r) with rslora), the module names it adapts; ``keep_versions``: how many of the
    adapter's latest versions stay loaded (a push beyond replaces the oldest)."""

    name: str
    rank: int
    scale: float
    targets: tuple[str, ...]
    keep_versions: int = 1

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.name!r}")
        if (
            isinstance(self.keep_versions, bool)
            or not isinstance(self.keep_versions, int)
            or self.keep_versions < 1
        ):
            raise ValueError(f"keep_versions must be an int >= 1, got {self.keep_versions!r}")


@dataclass(frozen=True, slots=True)
class PushSettings:
    """How a push travels. ``transport``: a name in `tandem.exchange.transports.TRANSPORTS`;
    ``mode``: ``staged`` (the push lands beside the live weights and is committed only when
    complete and verified: a failure leaves the old version serving) or ``in_place`` (bytes
    land straight in the live parameters: no extra memory, but a failed push leaves the engine
    refusing requests until a complete push lands); ``verify``: CRC32 every box on both ends.

    How a fleet commits it: ``policy="all"`` (every replica stages and verifies, then all
    commit together: the on-policy case) or ``"rolling"`` (every replica stages, verifies and
    holds the new version while serving the old one; the senders are then free; replicas
    commit in waves of at most ``max_unavailable``, the others serving). ``wave``: ``wait``
    drains a wave's requests before its commit (none straddles versions), ``keep`` commits
    between two steps of its running requests (their per-token versions say so).
    ``adapter``: the push carries a LoRA adapter into its slot, not the base weights."""

    transport: str
    mode: str = "staged"
    verify: bool = True
    policy: str = "all"
    max_unavailable: int = 1
    wave: str = "wait"
    adapter: AdapterPush | None = None  # a LoRA adapter's push (`AdapterPush`)

    def __post_init__(self):
        if not isinstance(self.transport, str) or not self.transport:
            raise ValueError(f"transport must be a transport's name, got {self.transport!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be a bool, got {self.verify!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if (
            isinstance(self.max_unavailable, bool)
            or not isinstance(self.max_unavailable, int)
            or self.max_unavailable < 1
        ):
            raise ValueError(f"max_unavailable must be an int >= 1, got {self.max_unavailable!r}")
        if self.wave not in WAVES:
            raise ValueError(f"wave must be one of {WAVES}, got {self.wave!r}")

    @property
    def in_place(self) -> bool:
        return self.mode == "in_place"

    @property
    def rolling(self) -> bool:
        return self.policy == "rolling"


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """Where and how to join a push's process group (the dist transport: in the plan and the
    engine's spec)."""

    host: str
    port: int
    prefix: str  # one per group generation: a failed push retires its group
    world: int  # trainer ranks + engine ranks
    backend: str
    timeout_s: float = 300.0  # joining, and each operation in the group


@dataclass(frozen=True, slots=True)
class BroadcastTensor:
    """One tensor a trainer broadcasts in vLLM's weight-transfer protocol (the broadcast
    transport), as its sender describes it."""

    name: str
    dtype: str  # a name in `tandem.dtypes.DTYPES`
    shape: tuple[int, ...]
    crc: int | None = None  # CRC32 of its bytes as the sender read them (tandem's senders)


@dataclass(frozen=True, slots=True)
class BroadcastCall:
    """One ``/update_weights`` call as every receiving rank sees it: its tensors in broadcast
    order, vLLM's packing (``packed_bytes``; 0: one broadcast per tensor), and ``join``: the
    trainer's init, each rank (re)joins its group first."""

    tensors: tuple[BroadcastTensor, ...] = ()
    packed_bytes: int = 0
    join: bool = False


@dataclass(frozen=True, slots=True)
class UpdateSpec:
    """One push as every engine rank sees it: its settings, the engine's dtype, how many trainer
    ranks send, and where to find their bytes (``staging``: per trainer rank, the handle of its
    staged memory, as its transport made it; ``group``: the dist transport's process group;
    ``first_rank``: the target-wide number of this engine's rank 0, where the target is a fleet
    of engines whose ranks are numbered one after another; ``broadcast``: the call of vLLM's
    protocol the broadcast transport receives; ``adapter``: the LoRA slot an adapter push
    lands in; ``rollback``: the trainers push a version not above the served one on purpose,
    for a target whose receivers check versions themselves; ``delta``: every record carries a
    payload of changed elements (`tandem.exchange.delta`); ``push_id``: the push's id, what the
    target's weights come from once it lands)."""

    version: int
    settings: PushSettings
    dtype: str
    trainers: int
    staging: tuple[list | None, ...] | None = None
    group: GroupInfo | None = None
    bucket_bytes: int = 0
    first_rank: int = 0
    broadcast: BroadcastCall | None = None
    adapter: AdapterSlot | None = None
    rollback: bool = False
    delta: bool = False  # the records carry payloads to apply (`tandem.exchange.delta`)
    push_id: str = ""  # what the target's `weight_base` becomes once this push lands


@dataclass(frozen=True, slots=True)
class AdapterSlot:
    """Where an adapter push lands on every engine rank: LoRA slot ``slot``, zeroed and given
    ``scale`` at the commit, just before the adapter's tensors (of rank ``rank``) are copied
    in."""

    name: str
    slot: int
    scale: float
    rank: int
