"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes and bodies), for
the holder of ``--admin-key``: loading reads files on the server's disk, an admin's action
(vLLM opens these routes with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; tandem with the admin key,
as every route that changes what the server serves). The adapters themselves:
`tandem.server.served_adapters`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from tandem.errors import LoRAError
from tandem.server.errors import APIError
from tandem.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tandem.server.served_adapters import (
    AdapterInUse,
    AdapterNotFound,
    LoRADisabled,
    UnknownAdapter,
)
from tandem.server.state import read_json, require_admin, state

router = APIRouter(prefix="/v1", dependencies=[Depends(require_admin)])
MAX_BODY_BYTES = 1 << 16


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request):
    """Load an adapter from a PEFT directory (``adapter_config.json`` +
    ``adapter_model.safetensors``); a loaded name gets a new version."""
    s = state(request)
    body: LoadLoRAAdapterRequest = await read_json(request, LoadLoRAAdapterRequest, MAX_BODY_BYTES)
    try:
        adapter = await asyncio.to_thread(s.lora.load, body.lora_name, body.lora_path)
    except LoRAError as exc:
        raise _refused(exc) from None
    return {
        "lora_name": adapter.name,
        "lora_path": body.lora_path,
        "version": adapter.version,
        "rank": adapter.rank,
    }


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    s = state(request)
    body: UnloadLoRAAdapterRequest = await read_json(
        request, UnloadLoRAAdapterRequest, MAX_BODY_BYTES
    )
    try:
        await asyncio.to_thread(s.lora.unload, body.lora_name)
    except LoRAError as exc:
        raise _refused(exc) from None
    return {"lora_name": body.lora_name, "unloaded": True}


def _refused(exc: LoRAError) -> APIError:
    """A LoRA error in OpenAI's shape: 404 for an adapter or directory that is not there, 409
    for an adapter requests run with, else 400 (LoRA not enabled, a malformed adapter, a rank
    above max_lora_rank, no free slot)."""
    if isinstance(exc, UnknownAdapter):
        return APIError(404, str(exc), param="lora_name", code="lora_not_found")
    if isinstance(exc, AdapterNotFound):
        return APIError(404, str(exc), param="lora_path", code="lora_not_found")
    if isinstance(exc, AdapterInUse):
        return APIError(409, str(exc), param="lora_name", code="lora_in_use")
    if isinstance(exc, LoRADisabled):
        return APIError(400, str(exc), code="lora_not_enabled")
    return APIError(400, str(exc), code="invalid_lora_adapter")
