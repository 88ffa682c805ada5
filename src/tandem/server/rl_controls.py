"""The RL controls an RL framework drives a rollout server with, under vLLM's names (and
docs/serving.md maps SGLang's): pause / resume generation, abort requests, sleep / wake up,
reset the prefix cache. All need ``--admin-key``.

Parameters come as a query string (``POST /pause?mode=keep``, as vLLM's clients send them) or
as a JSON body (``{"mode": "keep"}``), checked strictly either way: an unknown name or a bad
value is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.engine.state import EngineState
from tandem.errors import ModelLoadError
from tandem.server.errors import APIError, from_validation
from tandem.server.state import require_admin, state

router = APIRouter(dependencies=[Depends(require_admin)])
MAX_BODY_BYTES = 1 << 20
_LIST_FIELDS = {"request_ids", "tags"}  # may repeat in a query string


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PauseParams(_Params):
    mode: Literal["abort", "wait", "keep"] = "abort"
    timeout: float | None = Field(None, gt=0)  # mode=wait: give up waiting after this long
    clear_cache: bool = False  # also forget the cached prompt prefixes


class AbortParams(_Params):
    request_ids: list[str] | None = Field(None, min_length=1, max_length=4096)
    abort_all: bool = False


class SleepParams(_Params):
    level: int = Field(1, ge=1, le=2)


class WakeParams(_Params):
    tags: list[Literal["kv_cache", "weights"]] | None = Field(None, min_length=1)


async def _params(request: Request, model: type[_Params]) -> _Params:
    """The call's parameters from its query string and/or JSON body (not the same name in
    both)."""
    values: dict = {}
    for name in request.query_params:
        many = request.query_params.getlist(name)
        values[name] = many if name in _LIST_FIELDS else many[-1]
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
    if body.strip():
        try:
            data = json.loads(body)
        except ValueError:
            raise APIError(400, "the body is not valid JSON", code="bad_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object", code="bad_json")
        if both := set(data) & set(values):
            raise APIError(
                400, f"`{sorted(both)[0]}` given twice (query and body)", param=sorted(both)[0]
            )
        values |= data
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise from_validation(exc) from None


@router.post("/pause")
async def pause(request: Request):
    """Stop generating: ``abort`` ends running requests now (their callers get what was
    generated, finish_reason ``abort``), ``wait`` lets them finish (answers once they have),
    ``keep`` freezes them with their KV cache. New requests queue; weight pushes land."""
    p: PauseParams = await _params(request, PauseParams)
    engine = state(request).engine
    try:
        aborted = await asyncio.to_thread(engine.pause, p.mode, p.timeout)
    except TimeoutError as exc:
        raise APIError(504, f"paused, but {exc}", code="timeout") from None
    if p.clear_cache:
        await asyncio.to_thread(engine.reset_prefix_cache)
    return {"paused": True, "mode": p.mode, "aborted": aborted}


@router.post("/resume")
async def resume(request: Request):
    await _params(request, _Params)
    await asyncio.to_thread(state(request).engine.resume)
    return {"paused": False}


@router.get("/is_paused")
async def is_paused(request: Request):
    mode = state(request).engine.paused
    return {"is_paused": mode is not None, "mode": mode}


@router.post("/abort_requests")
async def abort_requests(request: Request):
    """End API calls now, by id (the response ``id``: every prompt of the call) or all; their
    callers get the tokens and log-probs generated so far, finish_reason ``abort``."""
    p: AbortParams = await _params(request, AbortParams)
    if (p.request_ids is None) == (not p.abort_all):
        raise APIError(
            400, "give exactly one of `request_ids` and `abort_all: true`", param="request_ids"
        )
    aborted = await asyncio.to_thread(state(request).engine.abort_requests, p.request_ids)
    return {"aborted": aborted}


def _sleep_state(engine) -> dict:
    released = engine.memory_released
    return {
        "is_sleeping": engine.state is EngineState.SLEEPING,
        "weights_released": released["weights"],
        "kv_cache_released": released["kv_cache"],
    }


@router.post("/sleep")
async def sleep(request: Request):
    """Free the KV cache (running requests are preempted and recomputed after wake-up;
    nothing is lost). Level 2 frees the weights too, as vLLM's: after wake-up, requests are
    refused (503) until a push lands or ``/reload_weights``."""
    p: SleepParams = await _params(request, SleepParams)
    engine = state(request).engine
    try:
        await asyncio.to_thread(engine.sleep, p.level)
    except RuntimeError as exc:  # a push is in progress
        raise APIError(409, str(exc), code="conflict") from None
    return _sleep_state(engine) | {"level": p.level}


@router.post("/wake_up")
async def wake_up(request: Request):
    """Re-allocate what `sleep` freed: ``tags`` picks ``kv_cache`` and/or ``weights`` (all by
    default). Weights released at level 2 get their memory back, not their values: push or
    ``/reload_weights`` before serving."""
    p: WakeParams = await _params(request, WakeParams)
    engine = state(request).engine
    tags = p.tags or ["kv_cache", "weights"]
    await asyncio.to_thread(engine.wake, "kv_cache" in tags, "weights" in tags)
    return _sleep_state(engine) | {"kv_blocks": engine.stats().kv_blocks_total}


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    """Whether the engine sleeps, and which memory is released (after a level-2 sleep and
    wake-up, ``weights_released`` stays true until a push or a reload)."""
    return _sleep_state(state(request).engine)


@router.post("/reload_weights")
async def reload_weights(request: Request):
    """Read the weights from the model directory again: the engine serves version 0."""
    await _params(request, _Params)
    engine = state(request).engine
    try:
        await asyncio.to_thread(engine.reload_weights)
    except RuntimeError as exc:  # a push is in progress
        raise APIError(409, str(exc), code="conflict") from None
    except ModelLoadError as exc:  # the checkpoint is gone or broken: requests are refused
        raise APIError(500, str(exc), code="reload_failed") from None
    return {"weight_version": engine.weight_version} | _sleep_state(engine)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    """Forget every cached prompt prefix (weight pushes do this themselves)."""
    await _params(request, _Params)
    await asyncio.to_thread(state(request).engine.reset_prefix_cache)
    return {"reset": True}
