"""``/admin/weights``: weight-sync negotiation, for the holder of ``--admin-key`` (the RL
controls, sleep / wake-up included, are in `tandem.server.rl_controls`).

Without an admin key the routes answer 403 (disabled). Weight sync: ``GET /admin/weights``
returns the version being served, the endpoint of the engine's exchange server (the fields of
an `ExchangeAddress`) and the transports that reach its ranks (`TRANSPORTS`), which a
`WeightSender(model, "http://host:port", admin_key=...)` then pushes over; no tensor byte
travels over HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Literal

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import MODES
from tandem.fleet.peer import push_from_peer
from tandem.fleet.window_messages import (
    MEDIA_TYPE,
    WINDOW,
    CloseWindow,
    Expose,
    OpenWindow,
    Refuses,
    RunPhase,
)
from tandem.server import remote_window
from tandem.server.errors import APIError
from tandem.server.state import read_body, read_json, require_admin, state
from tandem.wire import MAX_FRAME

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


@router.get("/weights")
async def weights(request: Request):
    engine = state(request).engine
    server = await asyncio.to_thread(engine.exchange_server)
    return {
        "version": engine.weight_version,
        "torn": engine.torn_reason,
        "exchange": dataclasses.asdict(server.endpoint),  # {host, port, token}
        "transports": server.transports(),
        "modes": list(MODES),
        "dtype": server.target.weight_dtype,
    }


class PushTo(BaseModel):
    """``POST /admin/weights/push_to``: this server's weights into another `tandem serve`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(min_length=1, max_length=2048)  # the other server (same admin key)
    transport: Literal["shm", "dist"] = "shm"  # shm: the same host


@router.post("/weights/push_to")
async def push_to(request: Request):
    """A peer's part in healing or growing a fleet behind `tandem router`: push this server's
    weights, at its version, into the server at ``url`` (which serves nothing of the fleet's
    meanwhile), planned and CRC-checked like any push (`tandem.fleet.peer`)."""
    s = state(request)
    body = await read_json(request, PushTo, 1 << 16)
    if len(s.engine.fleet.engines) != 1:
        raise APIError(
            409,
            "this server runs a fleet of its own: push from one of its replicas is not offered",
            code="invalid_value",
        )
    engine = s.engine.fleet.lead
    try:
        stats = await asyncio.to_thread(
            push_from_peer,
            engine,
            body.url,
            engine.config.parallel.push_phase_timeout_s,
            body.transport,
            s.config.admin_key,
        )
    except (WeightSyncError, ValueError, OSError) as exc:
        raise APIError(502, f"the push into {body.url} failed: {exc}", code="push_failed") from None
    return {
        "version": stats.version,
        "bytes_moved": stats.bytes_moved,
        "seconds": round(stats.seconds, 4),
    }


# A front that runs the push itself (`tandem router`, `tandem.fleet.remote`) holds a
# window open here and drives its phases: what this server's target holds, then open, phases,
# close. msgpack bodies (`tandem.fleet.window_messages`), admin key as every /admin route.


@router.get("/weights/target")
async def target_info(request: Request):
    fleet = state(request).engine.fleet
    info = await asyncio.to_thread(remote_window.target_info, fleet.target, len(fleet.engines))
    return _msgpack(info)


@router.post("/weights/refuses")
async def refuses(request: Request):
    return await _answer(request, Refuses)


@router.post("/weights/window")
async def open_window(request: Request):
    return await _answer(request, OpenWindow)


@router.post("/weights/window/phase")
async def run_phase(request: Request):
    return await _answer(request, RunPhase)


@router.post("/weights/window/expose")
async def expose(request: Request):
    return await _answer(request, Expose)


@router.post("/weights/window/close")
async def close_window(request: Request):
    return await _answer(request, CloseWindow)


async def _answer(request: Request, kind: type) -> Response:
    message = await read_message(request, kind)
    reply = await asyncio.to_thread(remote_window.answer, state(request).windows, message)
    return _msgpack(reply, remote_window.status(reply))


async def read_message(request: Request, kind: type):
    """A front's push-window message of type ``kind``, at most one frame (`APIError`: 413
    past it, as it arrives; 400 when it is not one, or of another type)."""
    body = await read_body(request, MAX_FRAME)
    try:
        message = WINDOW.decode(body)
    except ValueError as exc:
        raise APIError(400, f"not a push-window message: {exc}", code="invalid_value") from None
    if not isinstance(message, kind):
        raise APIError(
            400, f"expected {kind.__name__}, got {type(message).__name__}", code="invalid_value"
        )
    return message


def _msgpack(message, status: int = 200) -> Response:
    return Response(WINDOW.encode(message), status_code=status, media_type=MEDIA_TYPE)
