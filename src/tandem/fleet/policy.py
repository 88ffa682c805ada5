"""Which replica of a fleet takes a request: least-loaded, preferring the replica that holds
the request's prompt prefix in its KV cache (cache-aware, as SGLang's gateway routes), within an
imbalance bound so one hot prefix cannot pile everything onto one replica.

A request is routed whole: its n samples share the prompt's KV, so they run on one replica.
Load is the tokens a replica still owes (each routed request's prompt plus n x max_tokens,
released when it finishes). What each replica caches is tracked here from what was routed to
it (an approximate prefix index, one chained hash per full KV block of a prompt, least recently
used first out), not read from the replicas: routing never waits on an engine.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


def request_load(prompt_tokens: int, samples: int, max_tokens: int) -> int:
    """The tokens a request may still cost a replica: its prompt and every sample's new
    tokens (a replica's load is the sum over the requests it holds)."""
    return prompt_tokens + samples * max_tokens


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a request went: its replica, the load it added, and the prompt blocks that
    replica was thought to hold already (0: a cold start)."""

    replica: int
    load: int
    cached_blocks: int


class RoutingPolicy:
    """Routes requests over ``replicas``; thread-safe only under the caller's lock.

    ``block_size``: the replicas' KV block size (prefixes are matched in whole blocks);
    ``cache_blocks``: how many prompt blocks each replica's index remembers (its KV blocks);
    ``cache_threshold``: the share of the prompt's full blocks a replica must hold to be
    preferred for it (a short common system prompt does not pin every request to one
    replica); ``imbalance_tokens`` / ``imbalance_ratio``: a replica holding the prefix is
    preferred only while its load exceeds the least-loaded replica's by at most
    ``max(imbalance_tokens, imbalance_ratio x that load)``."""

    def __init__(
        self,
        replicas: int,
        block_size: int,
        cache_blocks: int,
        cache_threshold: float = 0.5,
        imbalance_tokens: int = 1024,
        imbalance_ratio: float = 0.25,
    ):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if block_size < 1 or cache_blocks < 0:
            raise ValueError(
                f"block_size ({block_size}) must be >= 1 and cache_blocks ({cache_blocks}) >= 0"
            )
        self.block_size = block_size
        self.cache_blocks = cache_blocks
        self.cache_threshold = cache_threshold
        self.imbalance_tokens = imbalance_tokens
        self.imbalance_ratio = imbalance_ratio
        self.loads = [0] * replicas
        self.requests = [0] * replicas  # routed so far, per replica
        self._prefixes: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]

    @property
    def replicas(self) -> int:
        return len(self.loads)

    def add_replica(self) -> int:
        """One more replica (a fleet grown at run time); its number."""
        self.loads.append(0)
        self.requests.append(0)
        self._prefixes.append(OrderedDict())
        return len(self.loads) - 1

    def route(
        self, prompt_ids: list[int], samples: int, max_tokens: int, allowed: list[int] | None = None
    ) -> Routed:
        """Pick the replica for one request (among ``allowed``, default all) and count its
        load there until `finished`. A policy over one replica has nothing to choose: it
        counts the load and hashes nothing (a `tandem serve` behind `tandem router`, where
        the router made the one decision)."""
        candidates = list(range(self.replicas)) if allowed is None else list(allowed)
        if not candidates:
            raise ValueError("no replica may take requests")
        load = request_load(len(prompt_ids), samples, max_tokens)
        if self.replicas == 1:
            self.loads[0] += load
            self.requests[0] += 1
            return Routed(0, load, 0)
        hashes = self.block_hashes(prompt_ids)
        least = min(candidates, key=lambda r: (self.loads[r], self.requests[r]))
        matched = {r: self._matched(r, hashes) for r in candidates}
        best = max(candidates, key=lambda r: (matched[r], -self.loads[r], -self.requests[r]))
        bound = max(self.imbalance_tokens, self.imbalance_ratio * self.loads[least])
        warm = matched[best] and matched[best] >= self.cache_threshold * len(hashes)
        replica = best if warm and self.loads[best] - self.loads[least] <= bound else least
        self.loads[replica] += load
        self.requests[replica] += 1
        self._remember(replica, hashes)
        return Routed(replica, load, matched[replica])

    def finished(self, routed: Routed) -> None:
        """The request is done: its tokens are no longer owed."""
        self.loads[routed.replica] = max(0, self.loads[routed.replica] - routed.load)

    def forget(self, replica: int | None = None) -> None:
        """The replica's (None: every replica's) prefix cache was reset (a weight push, a
        reset_prefix_cache)."""
        for r in range(self.replicas) if replica is None else [replica]:
            self._prefixes[r].clear()

    def block_hashes(self, prompt_ids: list[int]) -> list[int]:
        """One hash per full block of the prompt, each covering every token before it."""
        out, h = [], 0
        full = len(prompt_ids) - len(prompt_ids) % self.block_size
        for start in range(0, full, self.block_size):
            h = hash((h, *prompt_ids[start : start + self.block_size]))
            out.append(h)
        return out

    def _matched(self, replica: int, hashes: list[int]) -> int:
        known = self._prefixes[replica]
        n = 0
        while n < len(hashes) and hashes[n] in known:
            n += 1
        return n

    def _remember(self, replica: int, hashes: list[int]) -> None:
        known = self._prefixes[replica]
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.cache_blocks:
            known.popitem(last=False)
