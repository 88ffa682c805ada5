"""Iteration-level scheduling: which sequences run this step and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``). Running sequences go first: each
decoding one advances one token, then prompts part-way through prefill take their next chunk;
waiting sequences join with a chunk of their prompt in what is left. So a long prompt is
prefilled over several steps and never stalls everyone's next token. KV blocks for a whole
prompt are taken at admission, starting from its longest cached prefix (`BlockManager`); when
blocks run out, the newest running sequences are preempted (blocks freed, recomputed later).

The ``n`` samples of one request are queued as one sequence until its prompt is computed: the
step that computes the prompt's last chunk forks the others, which share its blocks and sample
their first token from the same logits (with prefix caching off, every sample prefills alone).

Admission order: preempted sequences first, then any request that has waited longer than
``max_wait_s`` (the starvation bound), then by the policy's key, then arrival: ``fcfs`` none,
``priority`` the request's priority (lower first), ``lof`` its output still to come (longest
first, SGLang's "longest output first"). ``lof`` is for throughput under a backlog: the long
requests start early and the short ones fill the slots they leave, so fewer steps at the end run
a few long stragglers alone (docs/benchmarks.md, `tandem bench serve`); a short request may wait
behind longer ones, up to ``max_wait_s``. The first candidate that does not fit stops admission
for the step: a long request is never overtaken by shorter ones that happen to fit.

``batching="static"`` is the request-level baseline, run the way a static system would: a batch
of up to ``max_num_seqs`` is admitted, shortest total length first (alike lengths end together),
and runs until all of it has finished; it may be split over several steps in flight so pipeline
stages overlap, but nothing joins once one of its steps has landed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from tandem.engine.kv_cache import BlockManager
from tandem.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence: tokens to compute
    samples: list[bool] = field(default_factory=list)  # per sequence: its last token is computed
    logits_from: list[int | None] = field(default_factory=list)  # a forked sample: the member
    # (index in seqs) whose last row it samples from
    copies: list[tuple[int, int]] = field(default_factory=list)  # KV block copies, before the step

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int, logits_from: int | None = None) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.samples.append(seq.num_cached_tokens + num_new_tokens == len(seq))
        self.logits_from.append(logits_from)


@dataclass(slots=True)
class StepCounters:
    """Tokens computed, split by kind: prompt (and recomputed) tokens vs decoded ones."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        policy: Literal["fcfs", "priority", "lof"] = "fcfs",
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
        self.counters = StepCounters()
        self._num_unforked = 0  # samples waiting inside their request's first sequence
        self.admitting = True  # False while the engine is paused: waiting sequences stay put
        self._static_closed = False  # the static batch running has had a step land

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue one request's samples; with prefix caching they share one prefill."""
        if self.blocks.enable_prefix_caching and len(seqs) > 1:
            seqs[0].unforked = list(seqs[1:])
            self._num_unforked += len(seqs) - 1
            seqs = seqs[:1]
        self.waiting.extend(seqs)

    def _admission_key(self, seq: Sequence, now: float) -> tuple:
        if self.batching == "static":
            return (not seq.preempted, seq.num_prompt_tokens + seq.max_tokens, seq.seq_id)
        starving = now - seq.arrival > self.max_wait_s
        if self.policy == "priority":
            key = seq.priority
        elif self.policy == "lof":
            key = seq.num_output_tokens - seq.max_tokens
        else:
            key = 0
        return (not seq.preempted, not starving, key, seq.arrival, seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + self._num_unforked

    def static_batch_window_left(self, window_s: float) -> float:
        """With static batching and no batch running: how long the oldest waiting request may
        still wait for others to fill the batch (0 once full, or not static)."""
        if self.batching != "static" or self.running or not self.waiting:
            return 0.0
        if self.num_unfinished >= self.max_num_seqs:
            return 0.0
        oldest = min(s.arrival for s in self.waiting)
        return max(0.0, oldest + window_s - self.clock())

    def schedule(self, busy: set[int] = frozenset(), max_seqs: int | None = None) -> ScheduledBatch:
        """The next step's batch: at most ``max_seqs`` sequences (forked samples aside), none of
        those in ``busy`` (already in a step still in flight)."""
        limit = min(max_seqs or self.max_num_seqs, self.max_num_seqs)
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, busy, limit)
        if budget is not None:
            if self.admitting:
                self._admit_waiting(batch, limit, budget)
        self.counters.steps += bool(batch)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, busy: set[int], limit: int) -> int | None:
        """Decodes first, then prompts being prefilled in chunks. Returns the token budget left,
        or None when a sequence had to be preempted (nothing is admitted then)."""
        ready = [s for s in self.running if s.seq_id not in busy]
        queue = deque(sorted(ready, key=lambda s: s.num_uncached_tokens > 1))
        budget, preempted = self.max_num_batched_tokens, False
        while queue and len(batch) < limit and budget > 0:
            seq = queue.popleft()
            while (copies := self.blocks.grow(seq)) is None:
                preempted = True
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.copies.extend(copies)
                budget -= self._add(batch, seq, min(seq.num_uncached_tokens, budget))
        return None if preempted else budget

    def _admit_waiting(self, batch: ScheduledBatch, limit: int, budget: int) -> None:
        if self.batching == "static" and self.running and self._static_closed:
            return
        now = self.clock()
        self.waiting.sort(key=lambda s: self._admission_key(s, now))
        admitted, unforked = 0, []
        for seq in self.waiting:
            if len(self.running) >= self.max_num_seqs or len(batch) >= limit or budget <= 0:
                break
            if not self.blocks.can_allocate(seq):
                break
            admitted += 1
            seq.preempted = False
            self.blocks.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._add(batch, seq, min(seq.num_uncached_tokens, budget), unforked)
        del self.waiting[:admitted]
        self.waiting.extend(unforked)

    def _add(
        self, batch: ScheduledBatch, seq: Sequence, n: int, leftovers: list | None = None
    ) -> int:
        """Put ``n`` of ``seq``'s tokens in the batch; when they end its prompt, fork the
        request's other samples onto its blocks. Returns ``n``."""
        decoding = n == 1 and seq.num_output_tokens > 0 and seq.num_uncached_tokens == 1
        self.counters.decode_tokens += n if decoding else 0
        self.counters.prefill_tokens += 0 if decoding else n
        batch.add(seq, n)
        if seq.unforked and batch.samples[-1]:
            self._fork(batch, len(batch) - 1, self.waiting if leftovers is None else leftovers)
        return n

    def _fork(self, batch: ScheduledBatch, parent_index: int, leftovers: list) -> None:
        parent = batch.seqs[parent_index]
        children, parent.unforked = parent.unforked, []
        self._num_unforked -= len(children)
        for i, child in enumerate(children):
            if len(self.running) >= self.max_num_seqs:  # no room: they prefill on their own
                leftovers.extend(children[i:])
                return
            self.blocks.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            batch.add(child, 0, logits_from=parent_index)

    def lora_slots(self) -> set[int]:
        """The LoRA slots that unfinished sequences run with."""
        return {s.lora_slot for s in self.unfinished() if s.lora_slot >= 0}

    def unfinished(self) -> list[Sequence]:
        """Every sequence not finished: running, waiting, and samples waiting inside their
        request's first sequence."""
        holders = [*self.running, *self.waiting]
        return [*holders, *(u for h in holders for u in h.unforked)]

    def remove(self, seq: Sequence) -> None:
        """Forget an aborted sequence, freeing its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq)
        else:
            for holder in self.waiting + self.running:
                if seq in holder.unforked:
                    holder.unforked.remove(seq)
                    self._num_unforked -= 1
        if seq.unforked:  # the request's other samples no longer wait for this one's prompt
            self._num_unforked -= len(seq.unforked)
            self.waiting.extend(seq.unforked)
            seq.unforked = []

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
        """Account the computed tokens, cache their full blocks, release finished sequences."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_cached_tokens += n
            self.blocks.register(seq)
            if seq.finished:
                self.blocks.free(seq)
        self.running = [s for s in self.running if not s.finished]
        self._static_closed = bool(self.running)
