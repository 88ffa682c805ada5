"""What tandem's vLLM target and its worker extension say to each other through vLLM's
``collective_rpc``: typed messages (`tandem.wire.Codec`, msgpack) carried as bytes, so their
shape is checked on arrival like every other tandem channel."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.wire import Codec

VLLM = Codec("vllm")

# how the error of a commit that tore vLLM's weights begins (its workers say it; trainers read it)
TORN_COMMIT = "vLLM's weights are now mixed"
# how a worker's refusal of a version that does not go forward begins (trainers read it)
STALE_VERSION = "tandem: stale version"


@VLLM.register("worker")
@dataclass(slots=True)
class WorkerInfo:
    """One vLLM worker as a receiving rank."""

    pid: int
    model_class: str
    layout: RankLayout


@VLLM.register("phase")
@dataclass(slots=True)
class PhaseRequest:
    """Run ``phase`` of a push; ``records[rank]``: the boxes of worker ``rank``."""

    phase: PushPhase
    spec: UpdateSpec
    records: list[list[Record]]


@VLLM.register("version-check")
@dataclass(slots=True)
class VersionCheck:
    """Asked of every worker of the ``tandem`` backend before a push's bytes move: refuse
    ``version`` unless it is above the one the worker serves, or ``rollback``."""

    version: int
    rollback: bool


@VLLM.register("phase-done")
@dataclass(slots=True)
class PhaseReply:
    error: str | None  # None: this worker finished the phase
    nbytes: int  # moved (receive) or loaded into vLLM (commit)
    torn: bool = False  # the commit failed after vLLM began loading: its weights are mixed


@VLLM.register("backend-hello")
@dataclass(slots=True)
class BackendHello:
    """A vLLM worker of the ``tandem`` weight-transfer backend reporting to its trainer at
    ``init_weight_transfer_engine`` (vLLM's protocol answers nothing back): what it holds and
    what it serves. ``rank``: its index in vLLM's list payloads (DP index × world + rank)."""

    rank: int
    workers: int  # how many report to the trainer
    info: WorkerInfo
    version: int  # the last version it committed (0: the weights vLLM loaded)
    torn: str | None  # why its weights are mixed, or None
    in_update: bool  # vLLM holds an update open on it (its trainer left before finishing)


@VLLM.register("push-to")
@dataclass(slots=True)
class SendWeights:
    """Push this worker's weights, at ``version``, into the server at ``url`` (another replica
    of the fleet, started with ``admin_key``), as rank ``rank`` of ``workers`` trainer ranks."""

    url: str
    transport: str
    version: int
    admin_key: str
    timeout_s: float
    workers: int


@VLLM.register("pushed-to")
@dataclass(slots=True)
class WeightsSent:
    error: str | None  # None: the push landed
    version: int
    bytes_moved: int
    seconds: float
