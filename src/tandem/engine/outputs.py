"""What `LLM.generate` returns (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``start .. end-1`` were sampled from weight version ``version``."""

    version: int
    start: int
    end: int

    def to_json(self) -> dict:
        return {"version": self.version, "start": self.start, "end": self.end}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None  # log-prob of each sampled token; mode per SamplingParams
    finish_reason: str | None  # "stop" (EOS, stop token or string) or "length"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    top_logprobs: list[dict[int, float]] | None = None  # when SamplingParams.logprobs > 0
    # which weight version sampled which tokens (several spans when a push landed mid-way)
    weight_versions: list[VersionSpan] = field(default_factory=list)
    # SamplingParams.return_routed_experts: per token, per MoE layer, the top-k expert ids
    routed_experts: list[list[list[int]]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(self.logprobs))


@dataclass
class RequestMetrics:
    """Times (``time.monotonic()`` seconds) of one request's life in the engine."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    weight_version: int = 0  # the newest version that generated its tokens
    metrics: RequestMetrics | None = None
    weight_versions: list[int] = field(default_factory=list)  # every version that did (async)
    # SamplingParams.prompt_logprobs: the raw log-prob of each prompt token given the ones
    # before it (None for the first), and for k > 0 the k most likely tokens at each position
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    replica: int = 0  # which replica of a fleet served it (`LLM(data_parallel_size=R)`)
    # the LoRA adapter it ran with (vLLM's field) and that adapter's version (its push's)
    lora_request: Any = None
    lora_version: int | None = None
