"""``/admin/weights``: weight-sync negotiation, for the holder of ``--admin-key`` (the RL
controls, sleep / wake-up included, are in `tandem.server.rl_controls`).

Without an admin key the routes answer 403 (disabled). Weight sync: ``GET /admin/weights``
returns the version being served and the endpoint of the engine's exchange server, which a
`WeightSender(model, "http://host:port", admin_key=...)` then pushes to over a transport
(shared memory or torch.distributed); no tensor byte travels over HTTP.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from tandem.server.state import require_admin, state

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


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
