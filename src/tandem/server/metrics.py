"""Prometheus metrics of one server (its own registry, served at ``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tandem.engine.dtype_auto import DtypeChoice
from tandem.engine.state import EngineState
from tandem.server.async_fleet import AsyncFleet

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, engine: AsyncFleet):
        self.registry = r = CollectorRegistry()
        for name, doc, value in (
            ("queue_depth", "requests waiting to be scheduled", lambda: engine.num_waiting),
            ("running_sequences", "sequences holding KV blocks", lambda: engine.num_running),
            ("kv_blocks_used", "KV cache blocks in use",
             lambda: engine.stats().kv_blocks_used),
            ("kv_blocks_total", "KV cache blocks", lambda: engine.stats().kv_blocks_total),
            ("weight_version", "version of the weights being served",
             lambda: engine.weight_version),
            ("engine_sleeping", "1 while the KV cache is released",
             lambda: int(engine.state is EngineState.SLEEPING)),
            ("prefix_cache_hit_rate",
             "share of admitted prompt tokens served from shared or cached KV blocks",
             lambda: engine.stats().prefix_cache_hit_rate),
            ("prefix_cache_blocks", "KV blocks in the prefix cache",
             lambda: engine.stats().prefix_cache_blocks),
        ):  # fmt: skip
            Gauge(f"tandem_{name}", doc, registry=r).set_function(value)
        r.register(_TokenCounter(engine))
        r.register(_ReplicaGauges(engine))
        r.register(_EngineCounters(engine))
        _dtype_gauges(engine.dtype_choice, r)
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "prompt tokens of admitted requests", registry=r
        )
        self.requests = Counter(
            "tandem_requests",
            "finished requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "tandem_request_latency_seconds",
            "arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.sync = Histogram(
            "tandem_weight_sync_seconds",
            "weight pushes applied (or failed), by outcome",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        engine.on_weight_update(self._on_update)

    def _on_update(self, version: int, seconds: float, error: str | None) -> None:
        self.sync.labels(outcome="failed" if error else "ok").observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _dtype_gauges(choice: DtypeChoice, registry: CollectorRegistry) -> None:
    """``tandem_dtype_info{dtype, source, reason} 1``: the dtype the engine runs in and why."""
    info = Gauge(
        "tandem_dtype_info",
        "the dtype the engine runs in (source, reason: why)",
        ["dtype", "source", "reason"],
        registry=registry,
    )
    info.labels(dtype=choice.dtype, source=choice.source, reason=choice.reason).set(1)


class _TokenCounter:
    """``tandem_generation_tokens_total``, counted by the engine thread."""

    def __init__(self, engine: AsyncFleet):
        self.engine = engine

    def collect(self):
        yield CounterMetricFamily(
            "tandem_generation_tokens",
            "tokens generated (all requests)",
            value=self.engine.generated_tokens,
        )


class _EngineCounters:
    """The engine core's own counts: prefix-cache tokens, and tokens computed per kind (their
    ratio to ``tandem_engine_steps_total`` is the mean prefill / decode tokens per step)."""

    def __init__(self, engine: AsyncFleet):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for name, doc, value in (
            ("prefix_cache_queried_tokens", "prompt tokens admitted",
             stats.prefix_cache_queried_tokens),
            ("prefix_cache_hit_tokens", "of those, served from shared or cached KV blocks",
             stats.prefix_cache_hit_tokens),
            ("engine_steps", "model steps scheduled", stats.steps),
            ("prefill_tokens", "prompt tokens computed (chunks and recomputation included)",
             stats.prefill_tokens),
            ("decode_tokens", "tokens computed one per running sequence", stats.decode_tokens),
            ("encode_batches", "embed / classify model passes", stats.encode_batches),
            ("encode_inputs", "sequences embedded or classified", stats.encode_inputs),
        ):  # fmt: skip
            yield CounterMetricFamily(f"tandem_{name}", doc, value=value)


class _ReplicaGauges:
    """Per replica of the fleet (``replica`` label; a single engine is replica 0): what it
    serves, what it runs, the tokens routed to it still owed, its prefix-cache hit rate, the
    tokens it generated."""

    def __init__(self, engine: AsyncFleet):
        self.engine = engine

    def collect(self):
        families = {
            name: GaugeMetricFamily(f"tandem_replica_{name}", doc, labels=["replica"])
            for name, doc in (
                ("weight_version", "version of the weights the replica serves"),
                ("available", "1 while the replica takes requests"),
                ("load", "tokens the replica still owes to the requests routed to it"),
                ("running_sequences", "sequences holding the replica's KV blocks"),
                ("queue_depth", "requests waiting on the replica"),
                ("prefix_cache_hit_rate", "share of its admitted prompt tokens served cached"),
            )
        }
        tokens = CounterMetricFamily(
            "tandem_replica_generation_tokens", "tokens the replica generated", labels=["replica"]
        )
        health = self.engine.replica_health()
        for replica, h in zip(self.engine.replicas, health, strict=True):
            label = [str(h["replica"])]
            families["weight_version"].add_metric(label, h["version"])
            families["available"].add_metric(label, int(h["status"] == "ok"))
            families["load"].add_metric(label, h["load"])
            families["running_sequences"].add_metric(label, replica.num_running)
            families["queue_depth"].add_metric(label, replica.num_waiting)
            families["prefix_cache_hit_rate"].add_metric(
                label, replica.stats().prefix_cache_hit_rate
            )
            tokens.add_metric(label, replica.generated_tokens)
        yield from families.values()
        yield tokens
