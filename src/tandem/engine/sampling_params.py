"""Per-request generation settings (vLLM field names), checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class SamplingParams:
    """How to generate for one prompt.

    ``temperature=0`` is greedy. ``top_k`` of -1 or 0 disables it. ``logprobs=None`` returns
    no logprobs; ``logprobs=k`` returns the log-prob of every sampled token and, for k > 0,
    the k most likely alternatives. ``logprobs_mode`` picks ``raw`` (log_softmax of the model's
    logits, what a trainer recomputes — default) or ``processed`` (after temperature, top-k and
    top-p: the distribution actually sampled from). ``max_tokens=None`` runs to the context limit.

    ``prompt_logprobs=k`` also scores the prompt: `RequestOutput.prompt_logprobs` holds the raw
    log-prob of every prompt token given the ones before it (None for the first) and, for
    k > 0, the k most likely alternatives at each position. Such a prompt is computed in full
    (no prefix-cache hits). ``max_tokens=0`` (only with ``prompt_logprobs``) scores the prompt
    and generates nothing. ``detokenize=False`` skips output text (token ids and log-probs
    only, for RL loops that train on ids). ``return_routed_experts=True`` (MoE models) gives
    each completion ``routed_experts``: per sampled token, per MoE layer, the top-k expert ids
    of the forward pass whose logits sampled it (routing replay, `tandem.rl.replay_routing`).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    detokenize: bool = True  # False: token ids (and log-probs) only, no output text
    return_routed_experts: bool = False  # MoE: the experts behind each sampled token

    def __post_init__(self):
        _check_int("n", self.n, minimum=1)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if self.max_tokens is not None:
            scoring = self.prompt_logprobs is not None
            if self.max_tokens == 0 and not scoring:
                raise ValueError("max_tokens=0 needs prompt_logprobs (score the prompt only)")
            _check_int("max_tokens", self.max_tokens, minimum=0)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (use stop_token_ids)")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for tid in self.stop_token_ids:
            _check_int("stop_token_ids", tid, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(
                f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}"
            )


def _check_int(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
