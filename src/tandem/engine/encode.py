"""Embed / classify / score: whole sequences through the model without a KV cache, packed
unpadded into batches that run between generation steps."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine.admission import Admission
from tandem.engine.engine_lock import EngineLock
from tandem.engine.messages import EncodeMessage, ScoreMessage
from tandem.engine.state import EngineLifecycle
from tandem.engine.stepper import Stepper


class Encoder:
    """The engine's embed / classify / score calls: they run under the engine lock, between
    steps."""

    def __init__(
        self,
        lock: EngineLock,
        stepper: Stepper,
        lifecycle: EngineLifecycle,
        admission: Admission,
        task: str,
    ):
        self._lock = lock
        self._stepper = stepper
        self._lifecycle = lifecycle
        self._admission = admission
        self._task = task
        self.batches = 0  # embed / classify model passes
        self.inputs = 0  # sequences encoded in them
        self.score_batches = 0  # score model passes
        self.score_prompts = 0  # prompts scored in them

    def encode(
        self,
        inputs: list[list[int]],
        token_types: list[list[int]] | None,
        pooling: str | None,
        pixels: list[list[float]] | None = None,
    ) -> list[list[float]]:
        """Whole sequences through the model, no KV cache, each pooled (``cls``, ``last`` or
        ``mean`` of its last hidden states; default: the model's) and, for task ``classify``,
        through its head: one row per input. Sequences are packed unpadded into batches of
        at most ``max_num_batched_tokens`` tokens; batches run between generation steps."""
        pooling = self._admission.check_encode(inputs, pooling)
        return self.run(inputs, token_types, pooling, pixels)

    def run(
        self,
        inputs: list[list[int]],
        token_types: list[list[int]] | None,
        pooling: str,
        pixels: list[list[float]] | None = None,
    ) -> list[list[float]]:
        """`encode` on inputs `Admission.check_encode` accepted (its pooling resolved)."""

        def message(step_id: int, batch: list[int]) -> EncodeMessage:
            return EncodeMessage(
                step_id=step_id,
                seqs=[inputs[i] for i in batch],
                token_types=None if token_types is None else [token_types[i] for i in batch],
                pooling=pooling,
                task=self._task,
                pixels=None if pixels is None else [pixels[i] for i in batch],
            )

        rows: list[list[float]] = []
        for batch, result in self._between_steps(inputs, message, lambda ex, msg: ex.encode(msg)):
            rows.extend(result.rows)
            self.batches += 1
            self.inputs += len(batch)
        return rows

    def score(self, prompts: list[list[int]], logprobs: bool = True) -> list[torch.Tensor]:
        """Each prompt's next-token log-probs (``logprobs``; else the raw logits) at every
        position, float32 [len(prompt), vocab] on the CPU, from the weights being served: the
        prompts run whole, packed into batches of at most ``max_num_batched_tokens`` tokens
        between generation steps, without the KV cache (running requests go on as they were).
        Task ``generate`` only; an empty prompt, one past ``max_model_len`` or ids outside the
        vocabulary raise `RequestError` on ``prompt``."""
        self._admission.check_score(prompts)

        def message(step_id: int, batch: list[int]) -> ScoreMessage:
            return ScoreMessage(
                step_id=step_id, seqs=[list(prompts[i]) for i in batch], logprobs=logprobs
            )

        out: list[torch.Tensor] = []
        for batch, rows in self._between_steps(prompts, message, lambda ex, msg: ex.score(msg)):
            out.extend(rows.split([len(prompts[i]) for i in batch]))
            self.score_batches += 1
            self.score_prompts += len(batch)
        return out

    def _between_steps(self, inputs: list[list[int]], message: Callable, run: Callable) -> list:
        """``inputs`` packed into batches of at most ``max_num_batched_tokens`` tokens, each
        sent as ``message(step_id, batch)`` and run on the ranks by ``run(executor, msg)``,
        all under the engine lock once the steps in flight finished: (batch, result) each."""
        budget = self._admission.limits.max_num_batched_tokens
        executor = self._stepper.executor
        done = []
        with self._lock.control():
            self._stepper.drain()
            self._lifecycle.check_runnable()
            for batch in pack(inputs, budget):
                msg = message(self._stepper.next_step_id(), batch)
                done.append((batch, self._stepper.guarded(lambda msg=msg: run(executor, msg))))
        return done


def pack(inputs: list[list[int]], budget: int) -> list[list[int]]:
    """Indices of ``inputs`` in order, cut into batches of at most ``budget`` tokens (an input
    longer than that goes alone)."""
    batches, current, size = [], [], 0
    for i, ids in enumerate(inputs):
        if current and size + len(ids) > budget:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += len(ids)
    batches.append(current)
    return batches


def unit_norm(row: list[float]) -> list[float]:
    """``row`` scaled to unit L2 norm (embeddings with ``normalize``)."""
    vector = torch.tensor(row)
    return (vector / vector.norm().clamp_min(1e-12)).tolist()
