"""``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``: OpenAI's shapes, plus
``token_ids`` on every choice and ``weight_version(s)`` next to ``usage``. A ``model`` that
names a LoRA adapter (`tandem.server.served_adapters`) runs the call with it."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.engine.admission import RequestError
from tandem.engine.outputs import CompletionOutput
from tandem.engine.sequence import Sequence
from tandem.errors import LoRAError
from tandem.server.async_engine import (
    EngineUnavailable,
    RequestUpdate,
    Submission,
    prompt_request_id,
)
from tandem.server.errors import APIError, error_body
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.served_adapters import NoSlotNow, Pin, UnknownAdapter, release_soon
from tandem.server.state import (
    ServerState,
    check_key,
    model_not_found,
    read_json,
    state,
    until_done,
)


def _api_key(request: Request) -> None:
    check_key(request, state(request).config.api_key, "API key")


router = APIRouter(dependencies=[Depends(_api_key)])


@router.get("/v1/models")
async def models(request: Request):
    """The served model, then every LoRA adapter as a model of its own (vLLM's cards: ``root``
    the adapter's directory, ``parent`` the served model)."""
    s = state(request)
    base = s.config.model_name

    def card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": s.created,
            "owned_by": "tandem",
            "max_model_len": s.engine.max_model_len,
        }

    adapters = [card(name) | {"root": path, "parent": base} for name, path in s.lora.sources()]
    return {"object": "list", "data": [card(base), *adapters]}


async def _pin(s: ServerState, adapter: str | None) -> Pin | None:
    """LoRA adapter ``adapter`` (`ServerState.check_model`), pinned for the call; None: the
    served model. The caller releases it (`_Call` does, once the call is over)."""
    if adapter is None:
        return None
    try:
        return await s.lora.pin_async(adapter)
    except UnknownAdapter:  # unloaded since it was checked
        raise model_not_found(adapter, s.config.model_name, True) from None
    except NoSlotNow as exc:  # evicted, and every slot busy now
        raise APIError(
            429, str(exc), param="model", code="lora_slots_busy", headers={"Retry-After": "1"}
        ) from None
    except LoRAError as exc:  # evicted, and its directory no longer reads as an adapter
        raise APIError(400, str(exc), param="model", code="invalid_lora_adapter") from None


def _prepare(
    s: ServerState,
    request_id: str,
    ids: list[int],
    params,
    priority: int,
    pin: Pin | None,
    fields: dict[str, str],
    where: str | None = None,
) -> list[Sequence]:
    """One prompt's samples; a refusal is a 400 naming the request's field (`_checked`), led
    by ``where`` (which prompt of several)."""
    seqs = _checked(lambda: s.engine.prepare(request_id, ids, params, priority), fields, where)
    if pin is not None:
        pin.apply(seqs)
    return seqs


@router.post("/v1/completions")
async def completions(request: Request):
    s = state(request)
    req: CompletionRequest = await read_json(request, CompletionRequest, s.config.max_request_bytes)
    adapter = s.check_model(req.model)
    params = _checked(req.params)
    prompts = req.prompts()
    rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    pin = await _pin(s, adapter)
    try:
        prepared, prompt_ids = [], []
        fields = {"prompt": "prompt", "max_tokens": "max_tokens"}
        for i, p in enumerate(prompts):
            ids = s.engine.prompt_ids(p)
            request_id = prompt_request_id(rid, i)
            where = f"prompt {i}" if len(prompts) > 1 else None
            seqs = _prepare(s, request_id, ids, params, req.priority, pin, fields, where)
            prepared.append((request_id, seqs))
            prompt_ids.append(ids)
        texts = [p if isinstance(p, str) else s.tokenizer.decode(p) for p in prompts]
        call = _Call(
            s,
            request,
            rid,
            "text_completion",
            req.n,
            prepared,
            req.include_usage,
            req.model,
            pin,
            req.stream,
        )
    except BaseException:
        release_soon(pin)
        raise

    def choice(pi: int, d: CompletionOutput, first: bool) -> dict:
        echo = req.echo and first
        text = texts[pi] + d.text if echo and req.detokenize else d.text
        scores = _prompt_scores(prepared[pi][1]) if echo and req.logprobs is not None else None
        lp = None
        if d.logprobs is not None:
            lp = _completion_logprobs(s, d, scores, req.detokenize)
        body = {
            "index": pi * req.n + d.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
            "token_ids": d.token_ids,
            "weight_versions": _spans(d),
        }
        if req.return_token_ids and first:
            body["prompt_token_ids"] = prompt_ids[pi]
        if d.routed_experts is not None:
            body["routed_experts"] = d.routed_experts
        return body

    if req.stream:
        return call.stream(choice)
    return await call.complete(choice)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    s = state(request)
    req: ChatCompletionRequest = await read_json(
        request, ChatCompletionRequest, s.config.max_request_bytes
    )
    adapter = s.check_model(req.model)
    params = _checked(req.params)
    messages = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in req.messages]
    text = s.chat.render(messages, req.add_generation_prompt, **(req.chat_template_kwargs or {}))
    rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    ids = s.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    request_id = prompt_request_id(rid, 0)
    pin = await _pin(s, adapter)
    try:
        limit = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        fields = {"prompt": "messages", "max_tokens": limit}
        seqs = _prepare(s, request_id, ids, params, req.priority, pin, fields)
        call = _Call(
            s,
            request,
            rid,
            "chat.completion",
            req.n,
            [(request_id, seqs)],
            req.include_usage,
            req.model,
            pin,
            req.stream,
        )
    except BaseException:
        release_soon(pin)
        raise

    def logprobs(d: CompletionOutput):
        if d.logprobs is None:
            return None
        return {"content": _chat_logprobs(s, d, req.detokenize)}

    def extras(d: CompletionOutput, first: bool) -> dict:
        body = {
            "logprobs": logprobs(d),
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
            "token_ids": d.token_ids,
            "weight_versions": _spans(d),
        }
        if req.return_token_ids and first:
            body["prompt_token_ids"] = ids
        if d.routed_experts is not None:
            body["routed_experts"] = d.routed_experts
        return body

    def choice(pi: int, d: CompletionOutput, first: bool) -> dict:
        message = {"role": "assistant", "content": d.text}
        return {"index": d.index, "message": message} | extras(d, first)

    def chunk(pi: int, d: CompletionOutput, first: bool) -> dict:
        delta = {"role": "assistant", "content": d.text} if first else {"content": d.text}
        return {"index": d.index, "delta": delta} | extras(d, first)

    if req.stream:
        return call.stream(chunk)
    return await call.complete(choice)


class _Call:
    """One API call's requests: run them to the end (JSON) or stream their deltas (SSE)."""

    def __init__(
        self,
        s: ServerState,
        request: Request,
        rid: str,
        kind: str,
        n: int,
        prepared: list[tuple[str, list[Sequence]]],
        include_usage: bool,
        model: str,
        pin: Pin | None = None,
        streams: bool = True,
    ):
        self.s, self.request, self.rid, self.kind, self.n = s, request, rid, kind, n
        self.prepared = prepared
        self.include_usage = include_usage
        self.model = model  # the served model's name, or a LoRA adapter's
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        # a LoRA adapter stays pinned until every request of the call is over
        on_over = None if pin is None else s.lora.hold(pin, len(prepared))
        self.submission: Submission = s.submit(rid, prepared, on_over, streams)
        s.metrics.prompt_tokens.inc(sum(seqs[0].num_prompt_tokens for _, seqs in prepared))

    def _seen(self, update: RequestUpdate) -> None:
        if update.restarted is not None:  # its replica was lost: it runs again elsewhere
            request_id, _ = self.prepared[update.prompt_index]
            self.prepared[update.prompt_index] = (request_id, update.restarted)
        if self.first_token is None and any(d.token_ids for d in update.deltas):
            self.first_token = time.monotonic()
            self.s.metrics.ttft.observe(self.first_token - self.arrival)

    def _usage(self) -> dict:
        seqs = [seq for _, group in self.prepared for seq in group]
        prompt = sum(group[0].num_prompt_tokens for _, group in self.prepared)
        completion = sum(seq.num_output_tokens for seq in seqs)
        versions = sorted(set().union(*(seq.weight_versions for seq in seqs)))
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return {
            "usage": usage,
            "weight_version": versions[-1] if versions else self.s.engine.weight_version,
            "weight_versions": versions,
        }

    def _head(self, chunk: bool = False) -> dict:
        kind = self.kind + (".chunk" if chunk and self.kind.startswith("chat") else "")
        return {"id": self.rid, "object": kind, "created": int(time.time()), "model": self.model}

    async def complete(self, choice: Callable) -> JSONResponse:
        await until_done(self.submission, self.request, self._seen)
        self.s.metrics.latency.observe(time.monotonic() - self.arrival)
        choices = [
            choice(pi, _final(self.s, seq), True)
            for pi, (_, seqs) in enumerate(self.prepared)
            for seq in seqs
        ]
        return JSONResponse(self._head() | {"choices": choices} | self._usage())

    def stream(self, chunk: Callable) -> StreamingResponse:
        return StreamingResponse(self._events(chunk), media_type="text/event-stream")

    async def _events(self, chunk: Callable) -> AsyncIterator[str]:
        started: set[tuple[int, int]] = set()
        try:
            async for update in self.submission.updates():
                self._seen(update)
                if update.restarted is not None:
                    continue
                choices = []
                for d in update.deltas:
                    key = (update.prompt_index, d.index)
                    choices.append(chunk(update.prompt_index, d, key not in started))
                    started.add(key)
                body = self._head(chunk=True) | {"choices": choices}
                if update.finished:
                    body |= {k: v for k, v in self._usage().items() if k != "usage"}
                yield _sse(body)
            self.s.metrics.latency.observe(time.monotonic() - self.arrival)
            if self.include_usage:
                yield _sse(self._head(chunk=True) | {"choices": []} | self._usage())
        except EngineUnavailable as exc:
            yield _sse(error_body(503, str(exc), code="engine_unavailable"))
        finally:
            self.submission.abort()  # no-op unless the client left early
        yield "data: [DONE]\n\n"


def _final(s: ServerState, seq: Sequence) -> CompletionOutput:
    """A whole sample as one delta (for non-streamed answers)."""
    return seq.output(s.engine.text(seq))


def _spans(d: CompletionOutput) -> list[dict]:
    """Which weight version sampled which of the delta's tokens (output token indexes)."""
    return [span.to_json() for span in d.weight_versions]


def _prompt_scores(seqs: list[Sequence]) -> Sequence:
    """The sample that computed the request's prompt (its scores; the others share them)."""
    return max(seqs, key=lambda seq: len(seq.prompt_logprobs))


def _checked(call, fields: dict[str, str] | None = None, where: str | None = None):
    """Run a check that raises ValueError; turn it into a 400. A `RequestError` names the
    request's field (``fields`` maps the engine's names, "prompt" and "max_tokens", to the
    route's) and is led by ``where`` (which prompt of several)."""
    try:
        return call()
    except RequestError as exc:
        exc = exc if where is None else exc.at(where)
        param = (fields or {}).get(exc.field, exc.field)
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None


def _lp(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -inf


def _token_text(s: ServerState, token: int, detokenize: bool) -> str:
    return s.tokenizer.decode([token], False) if detokenize else f"token_id:{token}"


def _completion_logprobs(
    s: ServerState, d: CompletionOutput, prompt: Sequence | None, detokenize: bool
) -> dict:
    """OpenAI's completion log-probs of a delta's tokens; with ``prompt`` (echo) the scored
    prompt's tokens first (``null`` for its first token, which nothing predicts)."""
    ids, values, tops = list(d.token_ids), list(d.logprobs), d.top_logprobs
    if prompt is not None:
        n = prompt.num_prompt_tokens
        ids = prompt.token_ids[:n] + ids
        values = prompt.prompt_logprobs[:n] + values
        if tops is not None:
            tops = prompt.prompt_top_logprobs[:n] + tops
    tokens = [_token_text(s, t, detokenize) for t in ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = None
    if tops is not None:
        top = [
            None
            if alts is None
            else {_token_text(s, t, detokenize): _lp(v) for t, v in alts.items()}
            for alts in tops
        ]
    return {
        "tokens": tokens,
        "token_logprobs": [None if v is None else _lp(v) for v in values],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(s: ServerState, d: CompletionOutput, detokenize: bool) -> list[dict]:
    def entry(t: int, v: float) -> dict:
        text = _token_text(s, t, detokenize)
        return {"token": text, "logprob": _lp(v), "bytes": list(text.encode())}

    out = []
    for i, (t, v) in enumerate(zip(d.token_ids, d.logprobs, strict=True)):
        alts = d.top_logprobs[i] if d.top_logprobs is not None else {}
        out.append(entry(t, v) | {"top_logprobs": [entry(a, w) for a, w in alts.items()]})
    return out


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
