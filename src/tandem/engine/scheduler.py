"""Iteration-level scheduling: which sequences run this step and how many tokens each.

Every step, running sequences advance one token (decode) and waiting ones join with their whole
prompt (prefill), all in one flat batch. KV blocks are taken on demand; when they run out, the
newest running sequences are preempted (blocks freed, recomputed later).

Admission order: preempted sequences first, then any request that has waited longer than
``max_wait_s`` (the starvation bound), then by priority (lower first, with the ``priority``
policy) and arrival. The first candidate that does not fit stops admission for the step: a long
request is never overtaken by shorter ones that happen to fit.

``batching="static"`` is the request-level baseline: a new batch is admitted only when the
previous one has completely finished.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tandem.engine.kv_cache import BlockManager
from tandem.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens to compute this step

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        policy: Literal["fcfs", "priority"] = "fcfs",
        max_wait_s: float = 30.0,
        batching: Literal["continuous", "static"] = "continuous",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.max_wait_s = max_wait_s
        self.batching = batching
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _admission_key(self, seq: Sequence, now: float) -> tuple:
        starving = now - seq.arrival > self.max_wait_s
        priority = seq.priority if self.policy == "priority" else 0
        return (not seq.preempted, not starving, priority, seq.arrival, seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, busy: set[int] = frozenset(), max_seqs: int | None = None) -> ScheduledBatch:
        """The next step's batch: at most ``max_seqs`` sequences, none of those in ``busy``
        (already in a step still in flight)."""
        limit = min(max_seqs or self.max_num_seqs, self.max_num_seqs)
        batch = ScheduledBatch([], [])
        preempted = self._schedule_running(batch, busy, limit)
        if not preempted:
            self._admit_waiting(batch, limit)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, busy: set[int], limit: int) -> bool:
        queue = deque(s for s in self.running if s.seq_id not in busy)
        preempted = False
        while queue and len(batch) < limit:
            seq = queue.popleft()
            while not self.blocks.can_grow(seq, len(seq)):
                preempted = True
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, len(seq))
                batch.seqs.append(seq)
                batch.num_new_tokens.append(seq.num_uncached_tokens)
        return preempted

    def _admit_waiting(self, batch: ScheduledBatch, limit: int) -> None:
        if self.batching == "static" and self.running:
            return
        now = self.clock()
        self.waiting.sort(key=lambda s: self._admission_key(s, now))
        budget = self.max_num_batched_tokens - sum(batch.num_new_tokens)
        admitted = 0
        for seq in self.waiting:
            if len(self.running) >= self.max_num_seqs or len(batch) >= limit:
                break
            if seq.num_uncached_tokens > budget or not self.blocks.can_grow(seq, len(seq)):
                break
            admitted += 1
            seq.preempted = False
            self.blocks.grow(seq, len(seq))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(seq.num_uncached_tokens)
            budget -= seq.num_uncached_tokens
        del self.waiting[:admitted]

    def remove(self, seq: Sequence) -> None:
        """Forget an aborted sequence, freeing its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq)

    def preempt_all(self) -> None:
        """Free every running sequence's blocks (they recompute when admitted again)."""
        for seq in list(self.running):
            self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.preempted = True
        self.waiting.append(seq)
        self.num_preemptions += 1

    def finish_step(self, batch: ScheduledBatch) -> None:
        """Account the computed tokens; release the blocks of sequences that finished."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_cached_tokens += n
            if seq.finished:
                self.blocks.free(seq)
        self.running = [s for s in self.running if not s.finished]
