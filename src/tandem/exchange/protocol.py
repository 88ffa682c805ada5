"""Messages between trainer ranks (`WeightSender`) and an engine's exchange server.

One push: every trainer rank connects and says what it holds and how it wants to push
(`PushHello`); the engine plans and tells each rank which boxes to send where (`PushPlan`, one
`SendItem` each); each rank delivers them through its transport's sender half and reports the
CRC32 it read from its tensors and the bytes it moved (`PushReady`); the engine's ranks verify
what landed, commit, and the engine answers everyone (`PushDone`). msgpack only, every field
named here; tensor bytes never travel in these frames.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import msgpack

from tandem.exchange.items import SendItem
from tandem.exchange.settings import PushSettings


@dataclass(slots=True)
class PushHello:
    """A trainer rank's first message, after the exchange's token (`tandem.wire.send_token`)."""

    rank: int  # this trainer rank
    world: int  # trainer ranks taking part in the push
    version: int | None  # None: the engine's current version + 1
    layout: list  # RankLayout.to_wire()
    ignore: list[str]  # sender tensors the engine does not need (e.g. a value head)
    settings: PushSettings


@dataclass(slots=True)
class PushPlan:
    dtype: str  # send boxes in this dtype (the engine's)
    size: int  # bytes of this rank's staging memory (staged shm, cuda_ipc)
    items: list[SendItem]
    group: list | None = None  # dist: GroupInfo.to_wire(); this rank is its trainer rank
    trainers: int = 1  # dist: engine rank e is group rank trainers + e
    bucket_bytes: int = 0
    arenas: list | None = None  # shm in_place: `ParamArena.to_wire()` per engine rank


@dataclass(slots=True)
class PushReady:
    crcs: list[int | None]  # per item, in PushPlan order: CRC32 of the box as read
    bytes_moved: list[int]  # per engine rank, as this rank's transport counted them
    staging: list | None = None  # staged shm / cuda_ipc: the handle of this rank's staging


@dataclass(slots=True)
class PushDone:
    version: int
    error: str | None  # None: committed
    bytes_needed: int = 0
    bytes_moved: int = 0  # by all trainer ranks, as their transports counted


_KINDS = {"hello": PushHello, "plan": PushPlan, "ready": PushReady, "done": PushDone}
_NAMES = {cls: kind for kind, cls in _KINDS.items()}


def _to_wire(value):
    if isinstance(value, PushSettings | SendItem):
        return value.to_wire()
    if isinstance(value, list) and value and isinstance(value[0], SendItem):
        return [item.to_wire() for item in value]
    return value


def encode(msg) -> bytes:
    return msgpack.packb([_NAMES[type(msg)], *(_to_wire(getattr(msg, f.name))
                                               for f in fields(msg))])  # fmt: skip


def decode(data: bytes):
    """The message in ``data``; ValueError for anything else (the peer may be anyone)."""
    try:
        kind, *body = msgpack.unpackb(data)
        cls = _KINDS[kind]
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        raise ValueError(f"not an exchange message: {data[:40]!r}") from None
    try:
        msg = cls(*body)
        if cls is PushHello:
            msg.settings = PushSettings.from_wire(msg.settings)
        elif cls is PushPlan:
            msg.items = [SendItem.from_wire(w) for w in msg.items]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed {kind} message: {exc}") from None
    return msg
