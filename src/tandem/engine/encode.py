"""Embed / classify: whole sequences through the model without a KV cache, packed unpadded
into batches that run between generation steps."""

from __future__ import annotations

import torch

from tandem.engine.messages import EncodeMessage


class EngineEncode:
    """Mixed into `LLMEngine`: its lock, step ids, admission and executor."""

    encode_batches = 0  # model passes
    encode_inputs = 0  # sequences encoded in them

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
        pooling = self.admission.check_encode(inputs, pooling)
        return self.run_encode(inputs, token_types, pooling, pixels)

    def run_encode(
        self,
        inputs: list[list[int]],
        token_types: list[list[int]] | None,
        pooling: str,
        pixels: list[list[float]] | None = None,
    ) -> list[list[float]]:
        """`encode` on inputs `Admission.check_encode` accepted (its pooling resolved)."""
        rows: list[list[float]] = []
        with self._control():
            self._drain_in_flight()
            self.lifecycle.check_runnable()
            for batch in pack(inputs, self.limits.max_num_batched_tokens):
                msg = EncodeMessage(
                    step_id=next(self._step_ids),
                    seqs=[inputs[i] for i in batch],
                    token_types=None if token_types is None else [token_types[i] for i in batch],
                    pooling=pooling,
                    task=self.config.task,
                    pixels=None if pixels is None else [pixels[i] for i in batch],
                )
                rows.extend(self._guarded(lambda msg=msg: self.executor.encode(msg)).rows)
                self.encode_batches += 1
                self.encode_inputs += len(batch)
        return rows


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
