"""``/admin/*``: weight-sync negotiation, sleep / wake and prefix-cache reset, for the holder
of ``--admin-key``.

Without an admin key the routes answer 403 (disabled). Weight sync: ``GET /admin/weights``
returns the version being served and the endpoint of the engine's exchange server, which a
`WeightSender(model, "http://host:port", admin_key=...)` then pushes to over a transport
(shared memory or torch.distributed); no tensor byte travels over HTTP.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from tandem.server.errors import APIError
from tandem.server.state import check_key, state


def _admin_key(request: Request) -> None:
    key = state(request).config.admin_key
    if key is None:
        raise APIError(403, "admin routes are disabled: start the server with --admin-key",
                       code="admin_disabled")  # fmt: skip
    check_key(request, key, "admin key")


router = APIRouter(prefix="/admin", dependencies=[Depends(_admin_key)])


@router.get("/weights")
async def weights(request: Request):
    engine = state(request).engine
    server = await asyncio.to_thread(engine.exchange_server)
    hostport, _, token = server.address.rpartition("/")
    host, _, port = hostport.rpartition(":")
    transports = ["shm", "dist"] + (["cuda_ipc"] if engine.config.torch_device.type == "cuda"
                                    else [])  # fmt: skip
    return {
        "version": engine.weight_version,
        "torn": engine.torn_reason,
        "exchange": {"host": host, "port": int(port), "token": token},
        "transports": transports,
        "modes": ["staged", "in_place"],
        "dtype": engine.config.dtype,
    }


@router.post("/sleep")
async def sleep(request: Request):
    """Release the KV cache (running requests are preempted and resume after wake)."""
    engine = state(request).engine
    await asyncio.to_thread(engine.sleep)
    return {"sleeping": True, "kv_blocks": engine.stats().kv_blocks_total}


@router.post("/wake")
async def wake(request: Request):
    engine = state(request).engine
    await asyncio.to_thread(engine.wake)
    return {"sleeping": False, "kv_blocks": engine.stats().kv_blocks_total}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    """Forget every cached prompt prefix (weight pushes do this themselves)."""
    await asyncio.to_thread(state(request).engine.reset_prefix_cache)
    return {"reset": True}
