"""One sample being generated: its tokens, KV blocks, random stream and status."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING

from tandem.engine.outputs import CompletionOutput, VersionSpan
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.output_processor import IncrementalDetokenizer


class SequenceStatus(Enum):
    WAITING = auto()  # queued, or preempted (its KV freed, to be recomputed)
    RUNNING = auto()  # holds KV blocks, advances every step
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival: float,
        priority: int = 0,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.priority = priority  # lower runs first under the "priority" policy
        self.preempted = False  # waiting again after losing its KV blocks: goes first
        # [version, start, end): output tokens start..end-1 came from that weight version
        self.version_spans: list[VersionSpan] = []
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.status = SequenceStatus.WAITING
        self.lora_slot = -1  # the LoRA slot it runs with (-1: the base model)
        self.lora_key = b""  # its adapter version's prefix-cache key (b"": the base model)
        self.num_cached_tokens = 0  # tokens whose keys/values are in the KV cache
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text: str | None = None  # set when a stop string cut the output
        self.detok: IncrementalDetokenizer | None = None  # output text so far (OutputProcessor's)
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.routed_experts: list[list[list[int]]] = []  # per output token, per MoE layer
        # scored prompt (SamplingParams.prompt_logprobs): entry p for prompt position p
        self.prompt_logprobs: list[float | None] = [None]
        self.prompt_top_logprobs: list[dict[int, float] | None] = [None]
        self.num_blocks_sent = 0  # of block_table, already told to the model ranks
        self.table_changed = False  # block_table changed other than by appending: resend it
        self.block_digests: list[bytes] = []  # prefix-cache keys of its full blocks so far
        self.num_registered_blocks = 0  # of block_table, already in the prefix cache
        self.cache_epoch = -1  # the prefix cache's epoch when its blocks were taken
        self.unforked: list[Sequence] = []  # samples of its request waiting to share its prompt
        self.params_sent = False

    def record_prompt_logprobs(self, first: int, logprobs, top_ids, top_logprobs) -> None:
        """Scores of prompt positions first, first+1, ... (positions already scored, as when
        a preempted sequence recomputes its prompt, are kept)."""
        skip = len(self.prompt_logprobs) - first
        if skip < 0:
            raise RuntimeError(f"sequence {self.seq_id}: prompt scores skip position {first}")
        self.prompt_logprobs.extend(logprobs[skip:])
        for ids, values in zip(top_ids[skip:], top_logprobs[skip:], strict=True):
            self.prompt_top_logprobs.append(dict(zip(ids, values, strict=True)))

    def record_version(self, version: int) -> None:
        """The output token just appended was sampled from this weight version's logits."""
        i = self.num_output_tokens - 1
        last = self.version_spans[-1] if self.version_spans else None
        if last is not None and last.version == version and last.end == i:
            self.version_spans[-1] = VersionSpan(version, last.start, i + 1)
        else:
            self.version_spans.append(VersionSpan(version, i, i + 1))

    def spans(self, start: int, end: int) -> list[VersionSpan]:
        """Its version spans cut to output tokens ``start .. end-1``."""
        cut = (
            VersionSpan(s.version, max(s.start, start), min(s.end, end)) for s in self.version_spans
        )
        return [s for s in cut if s.start < s.end]

    def output(self, text: str, start: int = 0) -> CompletionOutput:
        """Its output from output token ``start`` on (0: all of it; later: what a stream has
        not sent yet); ``text``: that part's text. Version spans index the whole output."""
        k = self.params.logprobs
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.output_token_ids[start:],
            logprobs=list(self.logprobs[start:]) if k is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            top_logprobs=list(self.top_logprobs[start:]) if k else None,
            weight_versions=self.spans(start, self.num_output_tokens),
            routed_experts=list(self.routed_experts[start:])
            if self.params.return_routed_experts
            else None,
        )

    @property
    def weight_versions(self) -> set[int]:
        """Every version that produced one of its tokens."""
        return {s.version for s in self.version_spans}

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.finished_time = time.monotonic()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
