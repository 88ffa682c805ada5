"""vLLM's RL weight-transfer routes (its dev-mode ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, and around them
``/get_world_size``, ``/update_weight_version``, ``/weight_info``,
``/shutdown_weight_transfer_engine``), over `tandem.server.weight_transfer`. All need
``--admin-key`` (vLLM's client sends no credentials: `tandem.integrations.vllm.rl_client`
adds the bearer token). Bodies are checked strictly: an unknown field is a 400 naming it.

Versions: vLLM's are strings, tandem's integers; a ``weight_version`` must be one written in
decimal digits. They only go forward: one not greater than the served version is a 409
(``code: stale_version``, naming the field) unless the body says ``"rollback": true``
(`tandem.server.weight_transfer`). tandem's client names the version at start as well, where
a refusal moves nothing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.dtypes import DTYPES
from tandem.exchange.settings import BroadcastTensor
from tandem.server.errors import APIError, from_validation
from tandem.server.remote_window import WindowError
from tandem.server.state import read_body, require_admin, state
from tandem.server.weight_transfer import TransferError, TransferInit

router = APIRouter(dependencies=[Depends(require_admin)])
MAX_BODY_BYTES = 64 << 20  # an update's metadata: names, dtypes and shapes of many tensors


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitInfo(_Body):
    """vLLM's `NCCLWeightTransferInitInfo` (on CPU the group is gloo's), and tandem's
    ``mode``: ``staged`` (the default: a failed transfer leaves the old version serving) or
    ``in_place`` (no second copy of the weights; a failed transfer leaves the engine refusing
    requests until a complete push lands)."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(ge=2)
    nccl_unique_id_b64: None = None  # NCCL's rendezvous (pickled on vLLM's side): not taken
    packed: bool = False
    packed_buffer_size_bytes: int = Field(1 << 30, gt=0)
    packed_num_buffers: int = Field(2, ge=1)
    mode: Literal["staged", "in_place"] = "staged"


class InitBody(_Body):
    init_info: InitInfo


class StartBody(_Body):
    is_checkpoint_format: bool | None = None  # older vLLM clients send it; nothing changes
    # tandem's: the version finish will publish, refused here if stale (nothing moved yet)
    weight_version: str | int | None = None
    rollback: bool = False  # a version not greater than the served one is meant


class UpdateInfo(_Body):
    names: list[str] = Field(max_length=1 << 20)
    dtype_names: list[str]
    shapes: list[list[int]]
    crc32s: list[int | None] | None = None  # tandem's senders: CRC32 of each tensor's bytes


class UpdateBody(_Body):
    update_info: UpdateInfo | list[UpdateInfo]


class FinishBody(_Body):
    weight_version: str | int | None = None
    rollback: bool = False


class VersionBody(_Body):
    new_version: str | int
    rollback: bool = False


async def _body(request: Request, model: type[_Body]) -> _Body:
    raw = await read_body(request, MAX_BODY_BYTES)
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise APIError(400, "the body is not valid JSON", code="bad_json") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="bad_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc) from None


def _version(value: str | int | None, param: str) -> int | None:
    if value is None or isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise APIError(
        400,
        f"{param} must be a version number (decimal digits): tandem numbers its "
        f"weight versions, got {value!r}",
        param=param,
    )


def _tensors(info: UpdateInfo) -> list[BroadcastTensor]:
    n = len(info.names)
    for field in ("dtype_names", "shapes") + (("crc32s",) if info.crc32s is not None else ()):
        if len(getattr(info, field)) != n:
            raise APIError(
                400,
                f"update_info.{field} has {len(getattr(info, field))} entries, names {n}",
                param=f"update_info.{field}",
            )
    out = []
    rows = zip(info.names, info.dtype_names, info.shapes, strict=True)
    for i, (name, dtype, shape) in enumerate(rows):
        dtype = dtype.removeprefix("torch.")
        if dtype not in DTYPES:
            raise APIError(
                400,
                f"update_info.dtype_names[{i}] must be one of {sorted(DTYPES)}, got {dtype!r}",
                param="update_info.dtype_names",
            )
        if any(d < 0 for d in shape):
            raise APIError(
                400, f"update_info.shapes[{i}] has a negative size", param="update_info.shapes"
            )
        crc = None if info.crc32s is None else info.crc32s[i]
        out.append(BroadcastTensor(name, dtype, tuple(shape), crc))
    return out


async def _run(call, *args):
    try:
        return await asyncio.to_thread(call, *args)
    except TransferError as exc:
        code = exc.code or {400: "invalid_value", 409: "conflict"}.get(
            exc.status, "transfer_failed"
        )
        raise APIError(exc.status, str(exc), param=exc.param, code=code) from None
    except WindowError as exc:  # another push holds the target's window
        raise APIError(409, str(exc), code="conflict") from None


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request):
    """Every receiving rank joins the trainer's group (answers once it formed)."""
    info = (await _body(request, InitBody)).init_info
    packed = info.packed_buffer_size_bytes if info.packed else 0
    init = TransferInit(
        info.master_address, info.master_port, info.rank_offset, info.world_size, packed, info.mode
    )
    await _run(state(request).transfer.init, init)
    return {"message": "Weight transfer initialized"}


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(request: Request):
    await _body(request, _Body)
    await _run(state(request).transfer.shutdown)
    return {"message": "Weight transfer shut down"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request):
    """Open the transfer: no step runs until it finishes (pause generation first)."""
    body = await _body(request, StartBody)
    version = _version(body.weight_version, "weight_version")
    version = await _run(state(request).transfer.start, version, body.rollback)
    return {"message": "Weight update started", "weight_version": version}


@router.post("/update_weights")
async def update_weights(request: Request):
    """Receive one call's tensors (answers once every broadcast has arrived)."""
    info = (await _body(request, UpdateBody)).update_info
    if isinstance(info, list):  # per worker rank: a broadcast gives every rank the same
        if not info or any(i != info[0] for i in info):
            raise APIError(
                400,
                "update_info as a list must give every rank the same tensors",
                param="update_info",
            )
        info = info[0]
    stats = await _run(state(request).transfer.update, _tensors(info))
    return {"message": "Weights updated"} | stats


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request):
    """Check and commit what the transfer landed; publish the version (given, or + 1)."""
    body = await _body(request, FinishBody)
    version = _version(body.weight_version, "weight_version")
    stats = await _run(state(request).transfer.finish, version, body.rollback)
    return {"message": "Weight update finished"} | stats


@router.post("/update_weight_version")
async def update_weight_version(request: Request):
    body = await _body(request, VersionBody)
    version = _version(body.new_version, "new_version")
    await _run(state(request).transfer.relabel, version, body.rollback)
    return {"success": True, "new_version": str(version)}


@router.get("/weight_info")
async def weight_info(request: Request):
    return {"weight_version": str(state(request).engine.weight_version)}


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = True):
    """The receiving ranks: TP x PP, times the replicas (vLLM's DP) with ``include_dp``."""
    s = state(request)
    ranks = await asyncio.to_thread(s.transfer.world_size)
    replicas = max(1, len(s.engine.fleet.engines))
    return {"world_size": ranks if include_dp else ranks // replicas}
