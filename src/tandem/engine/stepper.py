"""The engine's ranks as one stepping machine: scheduled batches go to the executor (with P
pipeline stages, up to P steps on disjoint sequences are in flight), results come back in
order and land on their sequences (`OutputProcessor.record_step`). What a step sends every
rank is only what changed since the sequence's last step (`step_message`, rule 8).

It owns what is in flight, the step ids and the finished sequences the ranks may forget; a
dead worker found by any executor call marks the lifecycle dead and shuts the executor down.
Callers hold the engine lock (`EngineLock`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque

from tandem.engine.executor import EngineDeadError, Executor
from tandem.engine.messages import SeqParams, SeqStep, StepMessage, StepResult
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineLifecycle


class Stepper:
    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        outputs: OutputProcessor | None,
        lifecycle: EngineLifecycle,
    ):
        self.executor = executor
        self._scheduler = scheduler
        self._outputs = outputs
        self._lifecycle = lifecycle
        self._step_ids = itertools.count()
        # each step in flight, with the weight version that computes it
        self._in_flight: deque[tuple[ScheduledBatch, int]] = deque()
        self._released: list[int] = []  # finished sequences the ranks may forget
        self.peak_in_flight = 0

    def next_step_id(self) -> int:
        return next(self._step_ids)

    @property
    def in_flight(self) -> int:
        """Steps submitted and not collected yet."""
        return len(self._in_flight)

    def busy(self) -> set[int]:
        """Ids of the sequences inside a step in flight."""
        return {s.seq_id for b, _ in self._in_flight for s in b.seqs}

    def release(self, seq_id: int) -> None:
        """The ranks may forget this sequence (told with the next step)."""
        self._released.append(seq_id)

    def fill(self, version: int) -> None:
        """Submit batches until the pipeline is full, each computed by weights ``version``:
        each step in flight takes its share of the unfinished sequences, disjoint from the
        others'."""
        depth = self.executor.max_in_flight
        while len(self._in_flight) < depth:
            share = math.ceil(self._scheduler.num_unfinished / depth)
            batch = self._scheduler.schedule(self.busy(), max_seqs=max(1, share))
            if not batch:
                break
            msg = step_message(self.next_step_id(), batch, self._released)
            self.guarded(lambda msg=msg: self.executor.submit(msg))
            self._released = []
            self._in_flight.append((batch, version))
            self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
        if not self._in_flight:
            raise RuntimeError("scheduler produced an empty batch with requests pending")

    def finish_oldest(self) -> list[Sequence]:
        """Collect the oldest step's results onto its sequences; the ones that finished."""
        result: StepResult = self.guarded(self.executor.collect)
        batch, version = self._in_flight.popleft()
        self._outputs.record_step(batch.seqs, batch.samples, result, version)
        self._scheduler.finish_step(batch)
        finished = [s for s in batch.seqs if s.finished]
        self._released.extend(s.seq_id for s in finished)
        return finished

    def drain(self) -> None:
        """Every step in flight finished (before a control call changes what they run on)."""
        while self._in_flight:
            self.finish_oldest()

    def guarded(self, call):
        """Run an executor call; a dead worker marks the engine dead and stops the rest."""
        try:
            return call()
        except EngineDeadError as exc:
            self._lifecycle.died(str(exc))
            self.executor.shutdown()
            raise


def step_message(step_id: int, batch: ScheduledBatch, released: list[int]) -> StepMessage:
    """The batch as a `StepMessage`: each sequence's new tokens, the KV blocks it took since
    its last step (its whole table when it changed otherwise), its sampling settings the
    first time; ``released``: finished sequences the ranks may forget. Marks on each sequence
    what was sent."""
    steps = []
    for i, seq in enumerate(batch.seqs):
        start, n = seq.num_cached_tokens, batch.num_new_tokens[i]
        replace, seq.table_changed = seq.table_changed, False
        blocks = seq.block_table if replace else seq.block_table[seq.num_blocks_sent :]
        seq.num_blocks_sent = len(seq.block_table)
        params = None
        if not seq.params_sent:
            params, seq.params_sent = _seq_params(seq), True
        logits_from = batch.logits_from[i]
        steps.append(
            SeqStep(
                seq_id=seq.seq_id,
                start=start,
                token_ids=seq.token_ids[start : start + n],
                blocks=list(blocks),
                params=params,
                replace_table=replace,
                sample=batch.samples[i],
                logits_from=-1 if logits_from is None else logits_from,
            )
        )
    copies = [[src, dst] for src, dst in batch.copies]
    return StepMessage(step_id=step_id, seqs=steps, released=released, copies=copies)


def _seq_params(seq: Sequence) -> SeqParams:
    p = seq.params
    return SeqParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=None if p.seed is None else p.seed + seq.index,
        logprobs=p.logprobs,
        processed_logprobs=p.logprobs_mode == "processed",
        prompt_logprobs=p.prompt_logprobs,
        num_prompt_tokens=seq.num_prompt_tokens,
        return_routed_experts=p.return_routed_experts,
        lora_slot=seq.lora_slot,
    )
