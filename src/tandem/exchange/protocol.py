"""Messages between trainer ranks (`WeightSender`) and an engine's exchange server.

One push: every trainer rank connects and says what it holds (`PushHello`); the engine plans and
tells each rank which boxes to stage where (`PushPlan`); each rank stages them in its own shared
memory (kept for its later pushes), or (shm ``in_place``) writes them straight into the engine
ranks' shared parameters while the engine is paused, or sends them (dist) (`PushReady`, with
CRC32s); the engine verifies on every rank, commits, and answers everyone (`PushDone`). msgpack
only; tensor bytes never travel in these frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack


@dataclass(slots=True)
class PushHello:
    token: str
    rank: int  # this trainer rank
    world: int  # trainer ranks taking part in the push
    version: int | None  # None: the engine's current version + 1
    layout: list  # RankLayout.to_wire()
    ignore: list[str]  # sender tensors the engine does not need (e.g. a value head)
    transport: str  # shm | dist | cuda_ipc
    mode: str  # staged | in_place (dist): where the engine receives
    verify: bool  # CRC32 per box


@dataclass(slots=True)
class PushPlan:
    dtype: str  # stage boxes in this dtype (the engine's)
    size: int  # bytes of this rank's staging buffer (shm, cuda_ipc staged)
    items: list  # [src_key, src_slices, src_transposed, box_shape, offset, nbytes, dst]
    group: list | None = None  # dist: GroupInfo.to_wire(); this rank is its trainer rank
    trainers: int = 1  # dist: engine rank e is group rank trainers + e
    bucket_bytes: int = 0
    arenas: list | None = None  # shm in_place: `ParamArena.to_wire()` per engine rank
    dests: list | None = None  # shm in_place, per item: [key, slices, transposed] there


@dataclass(slots=True)
class PushReady:
    crcs: list[int | None]  # per item, in PushPlan order
    staging: list | None = None  # shm: `SharedMemory.to_wire()`; cuda_ipc: the IPC handle


@dataclass(slots=True)
class PushDone:
    version: int
    error: str | None  # None: committed
    bytes_needed: int = 0
    bytes_moved: int = 0


_KINDS = {"hello": PushHello, "plan": PushPlan, "ready": PushReady, "done": PushDone}
_NAMES = {cls: kind for kind, cls in _KINDS.items()}


def encode(msg) -> bytes:
    return msgpack.packb([_NAMES[type(msg)], *(getattr(msg, f) for f in msg.__slots__)])


def decode(data: bytes):
    """The message in ``data``; ValueError for anything else (the peer may be anyone)."""
    try:
        kind, *body = msgpack.unpackb(data)
        cls = _KINDS[kind]
    except (ValueError, TypeError, KeyError, msgpack.UnpackException):
        raise ValueError(f"not an exchange message: {data[:40]!r}") from None
    try:
        return cls(*body)
    except TypeError as exc:
        raise ValueError(f"malformed {kind} message: {exc}") from None
