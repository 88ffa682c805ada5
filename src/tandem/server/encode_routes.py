"""``/v1/embeddings`` (OpenAI's shape) and ``/v1/classify`` (vLLM's), for a server started with
``--task embed`` or ``--task classify``. Concurrent calls are batched together, unpadded."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
import torch
from fastapi import APIRouter, Depends, Request

from tandem.engine.admission import RequestError
from tandem.engine.encode import unit_norm
from tandem.server.async_engine import EngineUnavailable
from tandem.server.errors import APIError
from tandem.server.openai_routes import _api_key
from tandem.server.protocol import ClassifyRequest, EmbeddingRequest
from tandem.server.state import ServerState, read_json, state

router = APIRouter(dependencies=[Depends(_api_key)])


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    s, req = await _read(request, EmbeddingRequest, "embed", "/v1/embeddings")
    if req.dimensions is not None:
        raise APIError(400, "`dimensions` is not supported", param="dimensions")
    rows, tokens = await _encode(s, req.inputs(), req.pooling)
    data = []
    for i, row in enumerate(rows):
        vector = torch.tensor(unit_norm(row) if req.normalize else row)
        if req.encoding_format == "base64":  # float32 little-endian, as OpenAI sends it
            value = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
        else:
            value = vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": s.config.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


@router.post("/v1/classify")
async def classify(request: Request):
    s, req = await _read(request, ClassifyRequest, "classify", "/v1/classify")
    rows, tokens = await _encode(s, req.inputs(), None)
    labels = s.engine.model_config.id2label
    data = []
    for i, row in enumerate(rows):
        probs = torch.softmax(torch.tensor(row, dtype=torch.float64), dim=-1).tolist()
        best = int(np.argmax(row))
        data.append(
            {
                "index": i,
                "label": labels.get(str(best), str(best)),
                "probs": probs,
                "logits": row,
                "num_classes": len(row),
            }
        )
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": s.config.model_name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def _read(request: Request, schema, task: str, route: str):
    """The server state and the validated body; 400 for a bad body, an unknown model, or a
    server started for another task."""
    s = state(request)
    req = await read_json(request, schema, s.config.max_request_bytes)
    s.check_model(req.model)
    if s.engine.config.task != task:
        raise APIError(
            400,
            f"{route} needs a server started with --task {task}; this one "
            f"serves --task {s.engine.config.task}",
            param="model",
            code="wrong_task",
        )
    return s, req


async def _encode(s: ServerState, items, pooling) -> tuple[list[list[float]], int]:
    if s.engine.model_class.inputs != "tokens":
        raise APIError(
            400,
            "this model takes images: classify them offline (LLM.classify or "
            "`tandem classify --image`); HTTP inputs are text or token ids",
            param="input",
            code="unsupported_input",
        )
    inputs, types = s.engine.tokenize_inputs(items)
    try:
        rows = await s.engine.encode(inputs, types, pooling)
    except RequestError as exc:  # an input empty, too long, or with ids outside the vocabulary
        raise APIError(400, str(exc), param=exc.field, code="invalid_value") from None
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), code="engine_unavailable") from None
    s.metrics.prompt_tokens.inc(sum(map(len, inputs)))
    return rows, sum(map(len, inputs))
