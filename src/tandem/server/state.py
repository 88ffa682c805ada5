"""What every route of one server shares, and the request plumbing they have in common."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tandem.server.async_engine import EngineUnavailable, QueueFull, Submission
from tandem.server.async_fleet import AsyncFleet
from tandem.server.chat import ServedChat
from tandem.server.config import ServeConfig
from tandem.server.errors import APIError, ClientDisconnected, from_validation
from tandem.server.metrics import Metrics
from tandem.server.remote_window import WindowHost
from tandem.server.served_adapters import ServedAdapters
from tandem.server.weight_transfer import WeightTransfer


@dataclass
class ServerState:
    config: ServeConfig
    engine: AsyncFleet
    metrics: Metrics
    chat: ServedChat
    created: int = field(default_factory=lambda: int(time.time()))
    _windows: WindowHost | None = None
    _transfer: WeightTransfer | None = None
    _lora: ServedAdapters | None = None

    @property
    def windows(self) -> WindowHost:
        """Push windows held open across calls (`tandem router`'s, vLLM's weight transfer):
        one at a time on this server's target (made on first use). One left without a call
        for twice ``--push-phase-timeout`` (600 s by default) is closed as failed."""
        if self._windows is None:
            idle = 2 * self.engine.fleet.lead.config.parallel.push_phase_timeout_s
            self._windows = WindowHost(self.engine.fleet.target, idle_timeout_s=idle)
        return self._windows

    @property
    def transfer(self) -> WeightTransfer:
        """vLLM's weight-transfer protocol on this server (made on first use)."""
        if self._transfer is None:
            timeout = self.engine.fleet.lead.config.parallel.push_phase_timeout_s
            self._transfer = WeightTransfer(self.engine.fleet, self.windows, timeout)
        return self._transfer

    @property
    def lora(self) -> ServedAdapters:
        """The LoRA adapters served (``--enable-lora``; made on first use)."""
        if self._lora is None:
            self._lora = ServedAdapters(self.engine, self.config.model_name)
        return self._lora

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, name: str) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None for the served model; 404 if
        it names neither."""
        if name == self.config.model_name:
            return None
        if name in self.lora.names():
            return name
        raise model_not_found(name, self.config.model_name, self.lora.enabled)

    def submit(self, call_id: str, requests, on_over=None, streams: bool = True) -> Submission:
        try:
            return self.engine.submit(call_id, requests, on_over, streams)
        except QueueFull as exc:
            raise APIError(
                429, f"server busy: {exc}", code="queue_full", headers={"Retry-After": "1"}
            ) from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        except ValueError as exc:  # a request id already in use
            raise APIError(400, str(exc), param="request_id", code="invalid_value") from None


def model_not_found(name: str, served: str, lora: bool) -> APIError:
    adapters = " and the LoRA adapters GET /v1/models lists" if lora else ""
    return APIError(
        404,
        f"model `{name}` does not exist; this server serves `{served}`{adapters}",
        param="model",
        code="model_not_found",
    )


def state(request: Request) -> ServerState:
    return request.app.state.tandem


def check_key(request: Request, expected: str | None, what: str) -> None:
    """Bearer-token check in constant time; ``expected`` None means no key is required."""
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), expected.encode()
    ):
        raise APIError(
            401,
            f"missing or wrong {what} (send `Authorization: Bearer <key>`)",
            code="invalid_api_key",
        )


def require_admin(request: Request) -> None:
    """Admin routes (weight sync, RL controls) need ``--admin-key``; without one: 403."""
    key = state(request).config.admin_key
    if key is None:
        raise APIError(
            403,
            "admin routes are disabled: start the server with --admin-key",
            code="admin_disabled",
        )
    check_key(request, key, "admin key")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes (413 past it: by its declared length when it has
    one, else as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body over {limit} bytes (max_request_bytes)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body over {limit} bytes (max_request_bytes)")
    return bytes(body)


async def read_json(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """The body, at most ``limit`` bytes, validated strictly against ``model``."""
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def until_done(submission: Submission, request: Request, on_update=None) -> None:
    """Consume a submission's updates; if the client goes away first, abort it and raise
    `ClientDisconnected` (answered 499)."""

    async def consume():
        async for update in submission.updates():
            if on_update is not None:
                on_update(update)

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                try:
                    return task.result()
                except EngineUnavailable as exc:
                    raise APIError(503, str(exc), code="engine_unavailable") from None
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        task.cancel()
        submission.abort()
