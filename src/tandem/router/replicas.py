"""The `tandem serve` instances behind a `tandem router`, health-checked.

Each replica's ``GET /health`` is polled every ``interval_s``; a replica answering anything but
200 with ``status: ok`` within ``timeout_s`` (or not answering) takes no new requests until it
answers again. Which healthy replica takes a request is `tandem.fleet.policy.RoutingPolicy`'s choice
(least-loaded, preferring the replica that served the same prompt prefix), over the request's
token ids or, for text, its characters.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from tandem.fleet.policy import Routed, RoutingPolicy

TEXT_BLOCK = 64  # characters per prefix block when a prompt is text


@dataclass
class Replica:
    url: str
    healthy: bool = False
    reason: str | None = "not checked yet"
    health: dict = field(default_factory=dict)  # its last /health body
    checked_at: float = 0.0
    asked_at: float = 0.0  # when the check recorded last was sent (time.monotonic)


class ReplicaPool:
    def __init__(self, urls: list[str], interval_s: float = 1.0, timeout_s: float = 2.0,
                 cache_blocks: int = 4096):  # fmt: skip
        if not urls:
            raise ValueError("a router needs at least one --replica URL")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        if len({r.url for r in self.replicas}) != len(self.replicas):
            raise ValueError(f"a replica is listed twice: {urls}")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.router = RoutingPolicy(len(urls), TEXT_BLOCK, cache_blocks)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=timeout_s))
        self.routable = lambda i: True  # the fleet's say (quarantined, joining: no requests)
        self.after_check = None  # called (blocking, off the event loop) after each round

    def add(self, url: str) -> int:
        """One more replica (not yet checked); its number."""
        self.replicas.append(Replica(url.rstrip("/")))
        return self.router.add_replica()

    def check_one_blocking(self, i: int) -> None:
        """`_check` one replica from a thread that is not the event loop's."""
        replica, asked = self.replicas[i], time.monotonic()
        try:
            r = httpx.get(f"{replica.url}/health", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            _record(replica, asked, None, {}, f"no answer from {replica.url}/health "
                                              f"({type(exc).__name__})")  # fmt: skip
            return
        _record(replica, asked, r.status_code, _json(r), None)

    async def watch(self) -> None:
        """Check every replica's health, forever (cancel to stop)."""
        while True:
            await self.check_all()
            if self.after_check is not None:
                await asyncio.to_thread(self.after_check)
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, replica: Replica) -> None:
        asked = time.monotonic()
        try:
            r = await self.client.get(f"{replica.url}/health", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            _record(replica, asked, None, {}, f"no answer from {replica.url}/health "
                                              f"({type(exc).__name__})")  # fmt: skip
            return
        _record(replica, asked, r.status_code, _json(r), None)

    def route(self, units: list[int], samples: int, max_tokens: int) -> Routed | None:
        """The healthy replica for a request (None: none is healthy)."""
        allowed = [i for i, r in enumerate(self.replicas) if r.healthy and self.routable(i)]
        if not allowed:
            return None
        return self.router.route(units, samples, max_tokens, allowed=allowed)

    def finished(self, routed: Routed) -> None:
        self.router.finished(routed)

    def report(self) -> list[dict]:
        out = []
        for i, r in enumerate(list(self.replicas)):
            ok = r.healthy and self.routable(i)
            reason = r.reason if not r.healthy else None if ok else "held out by the fleet"
            out.append(
                {
                    "replica": i,
                    "url": r.url,
                    "status": "ok" if ok else "unavailable",
                    "reason": reason,
                    "weight_version": r.health.get("weight_version"),
                    "load": self.router.loads[i],
                    "requests": self.router.requests[i],
                }
            )
        return out

    async def close(self) -> None:
        await self.client.aclose()


def _json(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _record(replica: Replica, asked: float, status: int | None, body: dict,
            unreachable: str | None) -> None:  # fmt: skip
    """One health check's outcome (sent at ``asked``): healthy when it answered 200 with
    ``status: ok``. A check sent before the one recorded last is dropped: its answer may
    predate a push that the later one saw."""
    if asked < replica.asked_at:
        return
    replica.asked_at = asked
    replica.health = body
    replica.healthy = unreachable is None and status == 200 and body.get("status") == "ok"
    replica.reason = None if replica.healthy else (
        unreachable or body.get("reason") or f"/health answered {status}")  # fmt: skip
    replica.checked_at = time.time()
