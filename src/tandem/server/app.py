"""The FastAPI application of one `tandem serve`: routes, error shapes, request metrics."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.engine.state import EngineState
from tandem.server import (
    admin,
    encode_routes,
    errors,
    lora_routes,
    openai_routes,
    rl_controls,
    weight_transfer_routes,
)
from tandem.server.metrics import CONTENT_TYPE
from tandem.server.state import ServerState, state

_ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/classify",
    "/v1/models",
    "/health",
    "/fleet_state",
    "/metrics",
)
_CONTROLS = {
    route.path
    for r in (rl_controls.router, weight_transfer_routes.router, lora_routes.router)
    for route in r.routes
}


def build_app(server: ServerState) -> FastAPI:
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tandem = server
    errors.install(app)
    app.include_router(openai_routes.router)
    app.include_router(encode_routes.router)
    app.include_router(admin.router)
    app.include_router(lora_routes.router)
    app.include_router(rl_controls.router)
    app.include_router(weight_transfer_routes.router)
    app.add_middleware(_CountRequests, server=server)

    @app.get("/health")
    async def health(request: Request):
        s = state(request)
        why = s.engine.unavailable()
        body = {
            "status": "ok" if why is None else "unavailable",
            "reason": why,
            "weight_version": s.engine.weight_version,
            "sleeping": s.engine.state is EngineState.SLEEPING,
            "replicas": s.engine.replica_health(),
        }
        return JSONResponse(body, status_code=200 if why is None else 503)

    @app.get("/fleet_state")
    async def fleet_state(request: Request):
        """Each replica: {replica, state (serving, updating, quarantined, joining), version,
        load}, as `LLM.fleet_state` gives it."""
        return JSONResponse(state(request).engine.fleet_state())

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(state(request).metrics.render(), media_type=CONTENT_TYPE)

    return app


class _CountRequests:
    """Counts every answered request by endpoint and status (pure ASGI: streams pass through)."""

    def __init__(self, app, server: ServerState):
        self.app = app
        self.counter = server.metrics.requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope.get("path", "")
        endpoint = (
            path
            if path in _ENDPOINTS
            else "admin"
            if path.startswith("/admin") or path in _CONTROLS
            else "other"
        )
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.counter.labels(endpoint=endpoint, status=str(status)).inc()
