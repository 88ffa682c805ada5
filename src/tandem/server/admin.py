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

from fastapi import APIRouter, Depends, Request

from tandem.exchange.settings import MODES
from tandem.server.state import require_admin, state

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
