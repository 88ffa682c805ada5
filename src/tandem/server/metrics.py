"""Prometheus metrics of one server (its own registry, served at ``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tandem.server.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, engine: AsyncEngine):
        self.registry = r = CollectorRegistry()
        core = engine.engine
        g = Gauge("tandem_queue_depth", "requests waiting to be scheduled", registry=r)
        g.set_function(lambda: engine.num_waiting)
        g = Gauge("tandem_running_sequences", "sequences holding KV blocks", registry=r)
        g.set_function(lambda: engine.num_running)
        g = Gauge("tandem_kv_blocks_used", "KV cache blocks in use", registry=r)
        g.set_function(lambda: core.blocks.num_blocks - core.blocks.num_free)
        g = Gauge("tandem_kv_blocks_total", "KV cache blocks", registry=r)
        g.set_function(lambda: core.blocks.num_blocks)
        g = Gauge("tandem_weight_version", "version of the weights being served", registry=r)
        g.set_function(lambda: core.weight_version)
        g = Gauge("tandem_engine_sleeping", "1 while the KV cache is released", registry=r)
        g.set_function(lambda: int(core.sleeping))
        r.register(_TokenCounter(engine))
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "prompt tokens of admitted requests", registry=r
        )
        self.requests = Counter(
            "tandem_requests", "finished requests by endpoint and HTTP status",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "tandem_request_latency_seconds", "arrival to last token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds", "arrival to first token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.sync = Histogram(
            "tandem_weight_sync_seconds", "weight pushes applied (or failed), by outcome",
            ["outcome"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        core.update_listeners.append(self._on_update)

    def _on_update(self, version: int, seconds: float, error: str | None) -> None:
        self.sync.labels(outcome="failed" if error else "ok").observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TokenCounter:
    """``tandem_generation_tokens_total``, counted by the engine thread."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        yield CounterMetricFamily(
            "tandem_generation_tokens", "tokens generated (all requests)",
            value=self.engine.generated_tokens,
        )  # fmt: skip
