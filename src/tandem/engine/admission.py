"""What the engine accepts: limits checked once at start, then every request or encode input
checked and turned into sequences (or ids) before it is queued. ValueError names the problem."""

from __future__ import annotations

import itertools
import time

from tandem.config import EngineConfig
from tandem.engine.kv_cache import BlockManager, blocks_for
from tandem.engine.model_runner import POOLINGS
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.engine.tokenizer import Tokenizer

# Tokens per step unless configured: decodes first, then prompt chunks. Large enough that a step
# of prompt work amortises the per-step overhead, small enough that decodes keep flowing.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class Limits:
    """The engine's context length and step token budget, checked against the model."""

    def __init__(self, spec, config: EngineConfig):
        _check_task(config.task, spec)
        limit = spec.max_context_len
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's {limit}")
        self.max_model_len: int = config.max_model_len or limit
        scheduler = config.scheduler
        self.max_num_batched_tokens: int = (
            scheduler.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        )
        if self.max_num_batched_tokens < scheduler.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({scheduler.max_num_seqs}): every running sequence decodes a token each step"
            )


class RequestError(ValueError):
    """A request the engine refuses; ``field`` names what the caller changes: ``"prompt"`` or
    ``"max_tokens"`` (the server maps it to its request's field)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def at(self, where: str) -> RequestError:
        """The same error about one prompt of many: ``where`` (``"prompt 2"``) leads."""
        return RequestError(self.field, f"{where}: {self}")


class Admission:
    """Checks requests against the model, the limits and the KV cache; prompts -> ids."""

    def __init__(
        self, spec, task: str, limits: Limits, tokenizer: Tokenizer | None, blocks: BlockManager
    ):
        self.spec = spec
        self.task = task
        self.limits = limits
        self.tokenizer = tokenizer
        self.blocks = blocks
        self._seq_ids = itertools.count()

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A text through the tokenizer, or token ids as given (checked by `make_sequences`)."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def tokenize_inputs(self, items) -> tuple[list[list[int]], list[list[int]] | None]:
        """Texts (through the tokenizer and its post-processor) or token-id lists (as given)
        -> (ids, token types when the model takes them, else None)."""
        ids, types = [], []
        for item in items:
            if isinstance(item, str):
                i, t = self.tokenizer.encode_with_types(item)
            else:
                i, t = list(item), [0] * len(item)
            ids.append(i)
            types.append(t)
        return ids, types if self.spec.cls.token_types else None

    def check_encode(self, inputs: list[list[int]], pooling: str | None) -> str:
        """Check inputs for `encode`; the pooling to use (the model's unless given)."""
        if self.task == "generate":
            raise ValueError(
                "this engine's task is 'generate': embed / classify need task='embed' or 'classify'"
            )
        pooling = pooling or self.spec.cls.default_pooling
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        max_len = self.limits.max_model_len
        for i, ids in enumerate(inputs):
            if not ids:
                raise RequestError("input", f"input {i} is empty")
            if len(ids) > max_len:
                raise RequestError(
                    "input", f"input {i} has {len(ids)} tokens; max_model_len is {max_len}"
                )
            bad = self._bad_ids(ids)
            if bad:
                raise RequestError("input", f"input {i}: {bad}")
        return pooling

    def check_score(self, prompts: list[list[int]]) -> None:
        """Check prompts for `Encoder.score`: the engine generates, and each prompt is
        non-empty, within ``max_model_len`` and in the vocabulary (`RequestError` on
        ``prompt``, naming which)."""
        if self.task != "generate":
            raise ValueError(f"score needs task='generate'; this engine's task is {self.task!r}")
        max_len = self.limits.max_model_len
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError("prompt", "prompt is empty").at(f"prompt {i}")
            bad = self._bad_ids(ids)
            if bad:
                raise RequestError("prompt", f"prompt has {bad}").at(f"prompt {i}")
            if len(ids) > max_len:
                raise RequestError(
                    "prompt", f"prompt has {len(ids)} tokens; max_model_len is {max_len}"
                ).at(f"prompt {i}")

    def make_sequences(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> list[Sequence]:
        """Check one request and turn it into its ``n`` samples (not queued yet).
        `RequestError` names the field to change, as vLLM's server does: a prompt that is
        empty, holds ids outside the vocabulary or leaves no room, a ``max_tokens`` past
        what the context leaves (None: all of it)."""
        if self.task != "generate":
            raise ValueError(f"this engine's task is {self.task!r}, not 'generate'")
        if not prompt_ids:
            raise RequestError("prompt", "prompt is empty")
        bad = self._bad_ids(prompt_ids)
        if bad:
            raise RequestError("prompt", f"prompt has {bad}")
        max_len = self.limits.max_model_len
        room = max_len - len(prompt_ids)
        if room < 1 and not (params.max_tokens == 0 and room == 0):
            raise RequestError(
                "prompt",
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_len} and "
                "at least one token must be generated",
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(
                "max_tokens",
                f"max_tokens is too large: {params.max_tokens}; the context is "
                f"{max_len} tokens (max_model_len) and the prompt has {len(prompt_ids)}, so "
                f"max_tokens <= {room}",
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        need = blocks_for(len(prompt_ids) + max(max_tokens, 1), self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise RequestError(
                "prompt" if params.max_tokens is None else "max_tokens",
                f"needs {need} KV blocks but the cache has {self.blocks.num_blocks}; raise "
                "kv_cache_memory or lower max_tokens",
            )
        now = time.monotonic()
        return [
            Sequence(
                next(self._seq_ids), request_id, i, prompt_ids, params, max_tokens, now, priority
            )
            for i in range(params.n)
        ]

    def _bad_ids(self, ids: list) -> str | None:
        vocab = self.spec.vocab_size
        bad = [
            t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        return f"token ids outside [0, {vocab}): {bad[:8]}" if bad else None


def _check_task(task: str, spec) -> None:
    """The model class can do what the task asks (`TandemModel.tasks`)."""
    if task not in spec.cls.tasks:
        raise ValueError(
            f"task={task!r}: {spec.architecture} does {sorted(spec.cls.tasks)}, not {task!r} "
            "(a causal LM generates; a *ForSequenceClassification classifies)"
        )
