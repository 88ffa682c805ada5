"""Messages of a push window held open on a `tandem serve` for a front that runs the push
(`tandem router`): what the server's target holds (`TargetInfo`), whether it takes a push
travelling so (`Refuses`, answered by `Refusal`), open a window (`OpenWindow`), run a phase in
it (`RunPhase`), expose it (`Expose`), close it (`CloseWindow`), and every other answer
(`WindowReply`). Typed, msgpack over HTTP bodies
(``application/msgpack``) on the admin routes; tensor bytes never travel here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.exchange.items import Record
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import PushPhase, PushSettings, UpdateSpec
from tandem.wire import Codec

WINDOW = Codec("push-window")
MEDIA_TYPE = "application/msgpack"


@WINDOW.register("target")
@dataclass(slots=True)
class TargetInfo:
    version: int
    dtype: str
    device_type: str
    layouts: list[RankLayout]
    replicas: int  # a server with --data-parallel-size R > 1 is a fleet of its own
    unavailable: str | None
    base: str | None = None  # `WeightTarget.weight_base`: the push its weights came from


@WINDOW.register("refuses")
@dataclass(slots=True)
class Refuses:
    settings: PushSettings


@WINDOW.register("refusal")
@dataclass(slots=True)
class Refusal:
    reason: str | None  # `WeightTarget.refuses`: None where the target takes the push


@WINDOW.register("open")
@dataclass(slots=True)
class OpenWindow:
    spec: UpdateSpec


@WINDOW.register("phase")
@dataclass(slots=True)
class RunPhase:
    token: str
    phase: PushPhase
    spec: UpdateSpec  # the spec as it stands (the senders' staging added after delivery)
    records: list[list[Record]]  # per rank of the server's target (msgpack maps key by str)


@WINDOW.register("expose")
@dataclass(slots=True)
class Expose:
    token: str


@WINDOW.register("close")
@dataclass(slots=True)
class CloseWindow:
    token: str
    ok: bool  # False: the push failed; every rank drops what it holds


@WINDOW.register("reply")
@dataclass(slots=True)
class WindowReply:
    error: str | None = None
    token: str = ""  # of the window opened
    nbytes: int = 0  # moved by the phase
    ingress: list[tuple[int, int, float]] | None = None  # `UpdateWindow.ingress` so far:
    # (replica, bytes, seconds) each
