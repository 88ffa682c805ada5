"""Load: 100 concurrent streaming clients for 60 s against `tandem serve` on the tiny model, with
a waiting queue small enough that overload happens. No 5xx, every accepted stream ends with a
finish_reason and [DONE], overload is 429 + Retry-After, and memory stays bounded."""

import asyncio
import json
import random
import time
from collections import Counter

import httpx
import pytest

from support.serving import Server, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CLIENTS = 100
DURATION_S = 60.0
PEAK_RSS_LIMIT = 6 << 30  # server and workers together; generous for a tiny model on CPU


def peak_rss(pid: int) -> int:
    """VmHWM (peak resident set) of ``pid`` and the processes under it, in bytes."""
    total = 0
    for p in [pid, *descendants(pid)]:
        for line in open(f"/proc/{p}/status"):
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total


async def client(url: str, model: str, deadline: float, seed: int, stats: Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < deadline:
            body = {
                "model": model,
                "prompt": f"client {seed} says",
                "stream": True,
                "max_tokens": rng.randint(4, 32),
                "temperature": 1.0,
            }
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 429:
                    assert r.headers["retry-after"] == "1"
                    assert json.loads(await r.aread())["error"]["type"] == "rate_limit_error"
                    stats["429"] += 1
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                    continue
                if r.status_code != 200:
                    stats[f"status {r.status_code}"] += 1
                    continue
                finish, done = None, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        for choice in chunk["choices"]:
                            stats["tokens"] += len(choice["token_ids"])
                            finish = choice["finish_reason"] or finish
                stats["ok" if done and finish in ("length", "stop") else "incomplete"] += 1


def test_100_streaming_clients_for_60_seconds(model_factory):
    model = model_factory("llama", max_position_embeddings=128)
    args = [
        "--max-num-seqs",
        "16",
        "--max-waiting-requests",
        "16",
        "--kv-cache-memory",
        str(32 << 20),
    ]
    with Server(model, *args) as server:
        stats: Counter = Counter()
        start = time.monotonic()

        async def run():
            deadline = start + DURATION_S
            await asyncio.gather(
                *(client(server.url, server.model, deadline, i, stats) for i in range(CLIENTS))
            )

        asyncio.run(run())
        elapsed = time.monotonic() - start
        rss = peak_rss(server.proc.pid)
        five_xx = sum(
            server.metric("tandem_requests_total", endpoint="/v1/completions", status=str(code))
            for code in (500, 502, 503, 504)
        )
        assert server.get("/health").status_code == 200
    print(
        f"\nload: {CLIENTS} clients {elapsed:.0f} s: ok {stats['ok']} / 429 {stats['429']} / "
        f"other {sum(v for k, v in stats.items() if k.startswith('status'))} / incomplete "
        f"{stats['incomplete']}; {stats['tokens'] / elapsed:.0f} tokens/s; "
        f"peak RSS {rss / 2**20:.0f} MiB (server + workers)"
    )
    assert stats["ok"] > 0 and stats["429"] > 0, stats
    assert stats["incomplete"] == 0 and five_xx == 0, stats
    assert not [k for k in stats if k.startswith("status")], stats
    assert rss < PEAK_RSS_LIMIT
