"""The load generator of `tandem bench serve`: streamed completions sent on a schedule.

Every request is one streamed ``/v1/completions`` call (token-id prompt, greedy, ``ignore_eos``),
sent at its scheduled offset from the start of the run whether or not earlier ones have been
answered (open loop). TTFT is the time from sending a request to its first streamed token;
latency is the time to its last token. A request counts as completed only when it streamed
exactly ``max_tokens`` tokens and finished for ``length``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class LoadRequest:
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    tokens: int = 0  # streamed tokens
    send_lag_s: float = 0.0  # how late the client sent it (a busy client shows here)
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None


def poisson_offsets(n: int, rate: float | None, seed: int) -> list[float]:
    """Send offsets (seconds) of ``n`` requests: the first at 0, then exponential gaps of mean
    ``1 / rate``; ``rate=None`` sends all at 0 (a burst). The same seed gives the same gaps
    up to scale at every rate."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(1.0) / rate
    return offsets


async def run_load(
    url: str, model: str, requests: list[LoadRequest], offsets: list[float]
) -> tuple[list[RequestResult], float]:
    """Send every request at its offset; returns their results and the run's wall seconds
    (first send to last answer)."""
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        tasks = [
            _send_at(client, model, req, start + offset)
            for req, offset in zip(requests, offsets, strict=True)
        ]
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    return list(results), seconds


async def _send_at(
    client: httpx.AsyncClient, model: str, req: LoadRequest, at: float
) -> RequestResult:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    sent = time.perf_counter()
    result = RequestResult(send_lag_s=sent - at)
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    finish = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return result
                for choice in chunk["choices"]:
                    if choice["token_ids"] and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - sent
                    result.tokens += len(choice["token_ids"])
                    finish = choice["finish_reason"] or finish
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - sent
    if result.tokens != req.max_tokens or finish != "length":
        result.error = (
            f"streamed {result.tokens} tokens (finish_reason {finish!r}), asked {req.max_tokens}"
        )
    return result


def summarize(results: list[RequestResult], seconds: float) -> dict[str, Any]:
    """Throughput and latency figures of one run."""
    done = [r for r in results if r.completed]
    tokens = sum(r.tokens for r in done)
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    latency = [r.latency_s for r in done if r.latency_s is not None]
    errors = sorted({r.error for r in results if r.error is not None})
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "seconds": round(seconds, 4),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 2),
        "requests_per_s": round(len(done) / seconds, 3),
        "ttft_p50_s": _percentile(ttft, 0.50),
        "ttft_p99_s": _percentile(ttft, 0.99),
        "latency_p50_s": _percentile(latency, 0.50),
        "latency_p99_s": _percentile(latency, 0.99),
        "send_lag_max_s": round(max(r.send_lag_s for r in results), 4),
        "errors": errors[:5],
    }


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None without values)."""
    if not values:
        return None
    ranked = sorted(values)
    return round(ranked[max(0, math.ceil(q * len(ranked)) - 1)], 4)
