"""A snapshot of the engine core's counters, for `/metrics`, benchmarks and tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int  # held by sequences (cached blocks nobody holds count as free)
    prefix_cache_blocks: int  # full blocks registered in the prefix cache
    prefix_cache_queried_tokens: int  # prompt tokens of admitted sequences
    prefix_cache_hit_tokens: int  # of those, served from shared (forked) or cached blocks
    steps: int  # model steps scheduled
    prefill_tokens: int  # prompt tokens computed (chunks and recomputation included)
    decode_tokens: int  # tokens computed one per running sequence
    num_waiting: int  # sequences waiting (a request's unforked samples count)
    num_running: int
    num_preemptions: int
    peak_steps_in_flight: int = 0  # most steps in flight at once (pipeline overlap)
    encode_batches: int = 0  # embed / classify model passes
    encode_inputs: int = 0  # sequences encoded in them
    score_batches: int = 0  # `LLM.score` model passes
    score_prompts: int = 0  # prompts scored in them

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "prefix_cache_hit_rate": round(self.prefix_cache_hit_rate, 4)}


def combined(stats: list[EngineStats]) -> EngineStats:
    """A fleet's figures: every replica's counts added up (peak steps in flight: the most of
    any replica)."""
    sums = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(EngineStats)}
    sums["peak_steps_in_flight"] = max(s.peak_steps_in_flight for s in stats)
    return EngineStats(**sums)
