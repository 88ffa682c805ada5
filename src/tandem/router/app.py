"""`tandem router`'s HTTP front: `tandem serve`'s routes over replicas started separately.

The replicas (`tandem serve`s, or ``vllm serve``s made with tandem's worker extension and
middleware: `tandem.fleet.remote`) are one `Fleet`, health-checked every
``health_interval_s`` (``GET /health``: a replica answering anything but 200 with ``status:
ok`` takes no requests until it answers again). Completions, chat, embeddings and classify
calls go whole to the replica the fleet routes them to (its one decision: a replica serving
alone does not route again) and stream back as the replica streams them; a replica that
cannot be reached before it answered is marked down and the request goes to another. The RL
controls go to every replica (with the router's admin key, which the replicas must share),
and so does a push (`/admin/weights`: one push through the router updates every replica).
Errors have OpenAI's shape (`tandem.server.errors`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tandem.exchange.receiver import WeightSyncError
from tandem.fleet.board import NoReplicaError
from tandem.fleet.fleet import Fleet, FleetSettings
from tandem.fleet.remote import RemoteReplica, server_replica
from tandem.server import errors
from tandem.server.errors import APIError
from tandem.server.state import check_key, read_body

CONTROLS = {  # route -> method: fanned out to every replica
    "/pause": "POST",
    "/resume": "POST",
    "/is_paused": "GET",
    "/abort_requests": "POST",
    "/sleep": "POST",
    "/wake_up": "POST",
    "/is_sleeping": "GET",
    "/reload_weights": "POST",
    "/reset_prefix_cache": "POST",
}


@dataclass(frozen=True)
class RouterSettings:
    api_key: str | None = None  # required on /v1 routes; forwarded to the replicas
    admin_key: str | None = None  # required on the controls; sent to the replicas
    exchange_host: str = "127.0.0.1"  # where the router's exchange server listens (trainers)
    max_request_bytes: int = 4 << 20
    # how long a push's transport waits (trainers staging, forming the dist group, each
    # transfer) before it fails the push; a replica silent in a phase min(30 s, this) twice
    # past it is quarantined and the push goes on without it (`tandem serve`'s option)
    push_phase_timeout_s: float = 300.0
    health_interval_s: float = 1.0  # how often every replica's /health is asked
    health_timeout_s: float = 2.0  # a replica silent this long is down until it answers
    # how many versions behind the newest a replica may take requests (None: any); a request
    # none may take waits while one will (a rolling wave, a replica joining), up to
    # ``route_wait_s``
    max_staleness: int | None = None
    route_wait_s: float = 300.0

    def fleet(self, urls: list[str]) -> Fleet:
        """The replicas at ``urls`` as one fleet (not yet checked)."""
        return Fleet.remote(
            urls,
            FleetSettings(
                stage_timeout_s=self.push_phase_timeout_s,
                exchange_host=self.exchange_host,
                max_staleness=self.max_staleness,
            ),
            self.admin_key,
            self.health_timeout_s,
        )

    def replica(self, url: str, fleet: Fleet) -> RemoteReplica:
        return server_replica(
            url, self.admin_key, fleet.settings.phase_timeout_s, self.health_timeout_s
        )


def build_app(fleet: Fleet, settings: RouterSettings) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=settings.health_timeout_s))

    async def check_all() -> None:
        await asyncio.gather(*(asyncio.to_thread(r.refresh) for r in list(fleet.replicas)))
        await asyncio.to_thread(fleet.check)  # quarantined replicas that answer again heal

    async def watch() -> None:
        while True:
            await asyncio.sleep(settings.health_interval_s)
            await check_all()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await check_all()
        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()
            await client.aclose()
            fleet.shutdown()

    app = FastAPI(
        title="tandem router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    errors.install(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, "/v1/completions", _completion_units)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(request, "/v1/chat/completions", _chat_units)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await _generate(request, "/v1/embeddings", _no_units)

    @app.post("/v1/classify")
    async def classify(request: Request):
        return await _generate(request, "/v1/classify", _no_units)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request, settings.api_key, "API key")
        for replica in [r for r in list(fleet.replicas) if r.health().ok]:
            try:
                r = await client.get(f"{replica.url}/v1/models", headers=_auth(request))
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type="application/json")
        raise _none_healthy(fleet)

    @app.get("/fleet_state")
    async def fleet_state():
        """Each replica: {replica, url, state (serving, updating, quarantined, joining),
        version, load}."""
        return JSONResponse(await asyncio.to_thread(fleet.fleet_state))

    @app.post("/admin/replicas")
    async def add_replica(request: Request):
        """Grow the fleet: ``{"url": ...}`` (a `tandem serve` of the same model with the
        router's admin key) joins, takes the fleet's weights from a live peer, then serves."""
        _require_admin(request, settings)
        try:
            body = json.loads(await read_body(request, 1 << 16) or b"{}")
        except ValueError as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", code="bad_json") from None
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise APIError(
                400,
                "`url` must be the http(s) URL of a tandem serve",
                param="url",
                code="invalid_value",
            )
        try:
            return await asyncio.to_thread(fleet.add, settings.replica(url, fleet))
        except ValueError as exc:
            raise APIError(400, str(exc), param="url", code="invalid_value") from None
        except Exception as exc:
            raise APIError(502, f"{url} could not join: {exc}", code="join_failed") from None

    @app.get("/health")
    async def health():
        report = await asyncio.to_thread(fleet.report)
        up = [r for r in report if r["status"] == "ok"]
        down = [
            f"replica {r['replica']} ({r['url']}): {r['reason']}"
            for r in report
            if r["status"] != "ok"
        ]
        status = "ok" if not down else "degraded" if up else "unavailable"
        body = {"status": status, "reason": "; ".join(down) or None, "replicas": report}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics():
        registry = CollectorRegistry()
        registry.register(_Figures(fleet))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/weights")
    async def weights(request: Request):
        """Where trainers push: the router's exchange server, whose target is every replica
        (`RemoteReplica` each, one `FleetTarget`): one push updates them all."""
        _require_admin(request, settings)

        def negotiate() -> dict:
            target = fleet.target
            server = target.exchange_server()
            return {
                "version": target.weight_version,
                "torn": target.unavailable(),
                "exchange": dataclasses.asdict(server.endpoint),
                "transports": server.transports(),
                "modes": ["staged"],
                "dtype": target.weight_dtype,
            }

        try:
            return await asyncio.to_thread(negotiate)
        except WeightSyncError as exc:
            raise APIError(
                503, f"cannot reach every replica: {exc}", code="replica_unreachable"
            ) from None

    for path, method in CONTROLS.items():
        app.add_api_route(path, _control(fleet, client, settings, path, method), methods=[method])

    async def _waiting(route, units, samples: int, max_tokens: int):
        """``route`` (`Fleet.route`) now, or, where no replica may take the
        request but one will (a rolling wave committing, ``max_staleness``, a replica
        joining), once one may: waited for off the event loop, up to ``route_wait_s``."""
        try:
            return route(units, samples, max_tokens, wait_s=0)
        except NoReplicaError:
            return await asyncio.to_thread(
                partial(route, wait_s=settings.route_wait_s), units, samples, max_tokens
            )

    async def _generate(request: Request, path: str, units_of) -> Response:
        check_key(request, settings.api_key, "API key")
        raw = await read_body(request, settings.max_request_bytes)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", code="bad_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_value")
        units = units_of(body)
        samples = body.get("n") if isinstance(body.get("n"), int) else 1
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        max_tokens = max_tokens if isinstance(max_tokens, int) else 16
        tried: set[int] = set()
        try:
            routed = await _waiting(fleet.route, units, samples, max_tokens)
            while True:
                replica = fleet.replicas[routed.replica]
                upstream = client.build_request(
                    "POST",
                    f"{replica.url}{path}",
                    content=raw,
                    headers={"content-type": "application/json", **_auth(request)},
                )
                try:
                    answer = await client.send(upstream, stream=True)
                except httpx.HTTPError as exc:  # nothing was generated: another may take it
                    lost = routed.replica
                    tried.add(lost)
                    reason = f"unreachable ({type(exc).__name__})"
                    try:
                        routed = fleet.rerun(routed, reason, units, samples, max_tokens, wait_s=0)
                    except NoReplicaError:  # held out; the others may take it once allowed
                        if len(fleet.replicas) == 1:
                            raise
                        routed = await _waiting(
                            partial(fleet.route, avoid=lost), units, samples, max_tokens
                        )
                    if routed.replica in tried:
                        fleet.finished(routed)
                        raise _none_healthy(fleet) from None
                    continue
                return _relay(answer, lambda routed=routed: fleet.finished(routed))
        except NoReplicaError:
            raise _none_healthy(fleet) from None

    return app


def _relay(answer: httpx.Response, done) -> Response:
    """The replica's answer as it comes (a stream stays a stream), with its ``x-tandem-*``
    headers (a vLLM replica's weight versions); ``done`` once it ended."""
    media = answer.headers.get("content-type", "application/json")
    own = {k: v for k, v in answer.headers.items() if k.lower().startswith("x-tandem-")}

    async def chunks():
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        finally:
            await answer.aclose()
            done()

    return StreamingResponse(
        chunks(), status_code=answer.status_code, media_type=media, headers=own
    )


def _control(
    fleet: Fleet, client: httpx.AsyncClient, settings: RouterSettings, path: str, method: str
):
    async def control(request: Request):
        _require_admin(request, settings)
        raw = await read_body(request, settings.max_request_bytes)
        headers = {"authorization": f"Bearer {settings.admin_key}"}
        if raw:
            headers["content-type"] = "application/json"

        async def one(url: str):
            try:
                r = await client.request(
                    method,
                    f"{url}{path}",
                    params=request.query_params,
                    content=raw or None,
                    headers=headers,
                )
                return r.status_code, _json(r)
            except httpx.HTTPError as exc:
                return 502, {"error": {"message": f"{url} unreachable ({type(exc).__name__})"}}

        answers = await asyncio.gather(*(one(r.url) for r in list(fleet.replicas)))
        per_replica = [
            {"replica": i, "status_code": code, "body": body}
            for i, (code, body) in enumerate(answers)
        ]
        failed = [a for a in per_replica if not 200 <= a["status_code"] < 300]
        if failed:
            first = failed[0]
            message = "; ".join(f"replica {a['replica']}: {_message(a['body'])}" for a in failed)
            raise APIError(
                first["status_code"] if first["status_code"] < 500 else 502,
                f"{path} failed on {len(failed)} of {len(answers)} replicas: {message}",
                code="replica_failed",
            )
        first = per_replica[0]["body"]
        body = (
            {**first, "replicas": per_replica}
            if isinstance(first, dict)
            else {"replicas": per_replica}
        )
        return JSONResponse(body)

    control.__name__ = f"control_{path.strip('/')}"
    return control


def _require_admin(request: Request, settings: RouterSettings) -> None:
    if settings.admin_key is None:
        raise APIError(
            403,
            "admin routes are disabled: start the router with --admin-key",
            code="admin_disabled",
        )
    check_key(request, settings.admin_key, "admin key")


def _auth(request: Request) -> dict[str, str]:
    header = request.headers.get("authorization")
    return {} if header is None else {"authorization": header}


def _json(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return {"text": r.text[:500]}


def _message(body) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)[:200]


def _none_healthy(fleet: Fleet) -> APIError:
    return APIError(
        503,
        f"no replica can take requests now ({fleet.why_none()})",
        code="no_replica",
        headers={"Retry-After": "1"},
    )


def _completion_units(body: dict) -> list[int]:
    """What a completion's routing matches on: its (first) prompt's token ids, or its
    characters."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return [ord(c) for c in prompt]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return []


def _no_units(body: dict) -> list[int]:
    """Embed and classify calls hold no KV: routed by load alone."""
    return []


def _chat_units(body: dict) -> list[int]:
    """A chat's messages, in order, as characters (role and content)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    text = "".join(
        f"{m.get('role')}:{json.dumps(m.get('content'))}\n" for m in messages if isinstance(m, dict)
    )
    return [ord(c) for c in text]


class _Figures:
    """Per replica: up, load (tokens owed to routed requests), requests routed."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def collect(self):
        up = GaugeMetricFamily(
            "tandem_router_replica_up", "1 while the replica is healthy", labels=["replica", "url"]
        )
        load = GaugeMetricFamily(
            "tandem_router_replica_load",
            "tokens owed by the requests routed to the replica",
            labels=["replica", "url"],
        )
        routed = CounterMetricFamily(
            "tandem_router_requests", "requests routed to the replica", labels=["replica", "url"]
        )
        for r in self.fleet.report():
            labels = [str(r["replica"]), r["url"]]
            up.add_metric(labels, int(r["status"] == "ok"))
            load.add_metric(labels, r["load"])
            routed.add_metric(labels, r["requests"])
        yield from (up, load, routed)
