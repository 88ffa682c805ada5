"""The engine core: requests in, one scheduled model step at a time, finished sequences out."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from tandem.config import EngineConfig
from tandem.engine.executor import EngineDeadError, Executor, InProcessExecutor
from tandem.engine.kv_cache import BlockManager, blocks_for
from tandem.engine.messages import SeqParams, SeqStep, StepMessage, StepResult
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.weight_update import WeightUpdate
from tandem.exchange.layout import RankLayout
from tandem.exchange.receiver import WeightSyncError
from tandem.models.loader import read_model_spec
from tandem.models.registry import import_model_modules


class EngineAsleepError(RuntimeError):
    """The engine released its KV cache (`sleep`); `wake` it before generating."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        import_model_modules(config.model_modules)
        self.spec = read_model_spec(config.model)
        limit = self.spec.max_context_len
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's {limit}")
        self.max_model_len = config.max_model_len or limit
        max_batched = config.max_num_batched_tokens or max(8192, self.max_model_len)
        if max_batched < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= max_model_len "
                f"({self.max_model_len}) so any prompt fits in one step"
            )
        self.tokenizer = Tokenizer(self.spec.path)
        self.executor: Executor = _make_executor(self.spec, config)
        self.blocks = BlockManager(self.executor.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.blocks,
            config.max_num_seqs,
            max_batched,
            policy=config.scheduling_policy,
            max_wait_s=config.max_wait_s,
            batching=config.batching,
        )
        self.weight_version = 0
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._in_flight: deque[ScheduledBatch] = deque()
        self._released: list[int] = []  # finished sequences the ranks may forget
        self.dead: str | None = None  # why the executor can no longer run steps
        self.torn: str | None = None  # a push failed mid-write: refuse to generate
        self.sleeping = False  # KV cache released (`sleep`) until `wake`
        self.lock = threading.RLock()  # one step or one weight update at a time
        # The exchange server calls these after every push attempt with (version, seconds,
        # error or None): metrics, logs.
        self.update_listeners: list[Callable[[int, float, str | None], None]] = []
        self._exchange = None
        self.peak_in_flight = 0  # most steps in flight at once (pipeline overlap, for tests)

    @property
    def runner(self):
        """The in-process model runner (single-rank engines only)."""
        return self.executor.runner

    def shutdown(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
        self.executor.shutdown()

    def exchange_server(self):
        if self._exchange is None:
            from tandem.engine.exchange_server import ExchangeServer

            self._exchange = ExchangeServer(self, host=self.config.exchange_host)
        return self._exchange

    def weight_layouts(self) -> list[RankLayout]:
        """What every rank holds, as canonical boxes: the receiving side of exchange plans."""
        return self.executor.layouts

    def update_weights(self, update: dict, records_by_rank: dict[int, list], checksums=None):
        """Apply a push between steps (`WeightUpdate`: the phases, and what a failure leaves).
        Steps already in flight (pipeline) finish first; waiting and running requests go on
        with the new weights, and each records the versions it used."""
        with self.lock:
            self._drain_in_flight()
            if self.dead is not None:
                raise EngineDeadError(f"the engine is dead: {self.dead}")
            run = WeightUpdate(update, lambda phase, records: self._guarded(
                lambda: self.executor.apply(phase, update, records)))  # fmt: skip
            try:
                run(records_by_rank, checksums, self.weight_version)
            finally:
                if run.torn is not None:
                    self.torn = run.torn
            self.torn = None
            self.weight_version = update["version"]

    def make_sequences(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> list[Sequence]:
        """Check one request and turn it into its ``n`` samples (not queued yet)."""
        if not prompt_ids:
            raise ValueError(f"request {request_id}: prompt is empty")
        vocab = self.spec.vocab_size
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int)]
        bad += [t for t in prompt_ids if isinstance(t, int) and not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id}: token ids outside [0, {vocab}): {bad[:8]}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"request {request_id}: prompt has {len(prompt_ids)} tokens; max_model_len is "
                f"{self.max_model_len} and at least one token must be generated"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        need = blocks_for(len(prompt_ids) + max_tokens, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"request {request_id}: needs {need} KV blocks but the cache has "
                f"{self.blocks.num_blocks}; raise kv_cache_memory or lower max_tokens"
            )
        now = time.monotonic()
        return [
            Sequence(
                next(self._seq_ids), request_id, i, prompt_ids, params, max_tokens, now, priority
            )
            for i in range(params.n)
        ]

    def add(self, seqs: list[Sequence]) -> None:
        with self.lock:
            for seq in seqs:
                self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop these sequences now (their client went away); their KV blocks return to the
        pool. One inside a step still in flight is released when that step lands."""
        with self.lock:
            busy = {s.seq_id for b in self._in_flight for s in b.seqs}
            for seq in seqs:
                if seq.finished:
                    continue
                seq.finish("abort")
                if seq.seq_id not in busy:
                    self.scheduler.remove(seq)
                    self._released.append(seq.seq_id)

    def check_health(self) -> None:
        """Notice a dead worker while idle (marks the engine dead). Skipped while a step or a
        weight update holds the engine: those notice it themselves."""
        if self.dead is None and self.lock.acquire(blocking=False):
            try:
                self._guarded(self.executor.check_alive)
            except EngineDeadError:
                pass
            finally:
                self.lock.release()

    def sleep(self) -> None:
        """Release the KV cache (every rank) so a colocated trainer can use the memory.
        Running sequences are preempted (recomputed after `wake`); nothing is lost."""
        with self.lock:
            if self.sleeping:
                return
            self._drain_in_flight()
            self.scheduler.preempt_all()
            self._guarded(lambda: self.executor.set_kv_cache(False))
            self.sleeping = True

    def wake(self) -> None:
        """Re-allocate the KV cache released by `sleep`."""
        with self.lock:
            if not self.sleeping:
                return
            self._guarded(lambda: self.executor.set_kv_cache(True))
            self.sleeping = False

    def step(self) -> list[Sequence]:
        """Fill the pipeline with steps, then finish the oldest; returns the sequences that
        finished in it. With P pipeline stages up to P steps (on disjoint sequences) are in
        flight, so every stage has work."""
        with self.lock:
            return self._step()

    def _step(self) -> list[Sequence]:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        if self.torn is not None:
            raise WeightSyncError(
                "weights are incomplete after a failed push; requests are refused until a "
                f"complete push lands: {self.torn}"
            )
        if self.sleeping:
            raise EngineAsleepError("the engine is asleep (KV cache released); call wake() first")
        self._guarded(self._fill_pipeline)
        if not self._in_flight:
            raise RuntimeError("scheduler produced an empty batch with requests pending")
        return self._finish_oldest()

    def _finish_oldest(self) -> list[Sequence]:
        result = self._guarded(self.executor.collect)
        batch = self._in_flight.popleft()
        self._append(batch, result)
        self.scheduler.finish_step(batch)
        finished = [s for s in batch.seqs if s.finished]
        self._released.extend(s.seq_id for s in finished)
        return finished

    def _drain_in_flight(self) -> None:
        while self._in_flight:
            self._finish_oldest()

    def _guarded(self, call):
        """Run an executor call; a dead worker marks the engine dead and stops the rest."""
        try:
            return call()
        except EngineDeadError as exc:
            self.dead = str(exc)
            self.executor.shutdown()
            raise

    def _fill_pipeline(self) -> None:
        depth = self.executor.max_in_flight
        while len(self._in_flight) < depth:
            busy = {s.seq_id for b in self._in_flight for s in b.seqs}
            # Leave sequences for the other in-flight slots: each step takes its share.
            share = math.ceil(self.scheduler.num_unfinished / depth)
            batch = self.scheduler.schedule(busy, max_seqs=max(1, share))
            if not batch:
                return
            self.executor.submit(self._message(batch))
            self._in_flight.append(batch)
            self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))

    def _message(self, batch: ScheduledBatch) -> StepMessage:
        steps = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_cached_tokens
            blocks = seq.block_table if start == 0 else seq.block_table[seq.num_blocks_sent :]
            seq.num_blocks_sent = len(seq.block_table)
            params = None
            if not seq.params_sent:
                params, seq.params_sent = _seq_params(seq), True
            steps.append(
                SeqStep(seq.seq_id, start, seq.token_ids[start : start + n], list(blocks), params)
            )
        msg = StepMessage(next(self._step_ids), steps, self._released)
        self._released = []
        return msg

    def _append(self, batch: ScheduledBatch, out: StepResult) -> None:
        now = time.monotonic()
        for row, seq in enumerate(batch.seqs):
            if seq.finished:  # aborted while its step was in flight
                continue
            token = out.token_ids[row]
            seq.token_ids.append(token)
            seq.weight_versions.add(self.weight_version)
            if seq.first_token_time is None:
                seq.first_token_time = now
            k = seq.params.logprobs
            if k is not None:
                seq.logprobs.append(out.logprobs[row])
                if k > 0:
                    top = zip(out.top_ids[row][:k], out.top_logprobs[row][:k], strict=True)
                    seq.top_logprobs.append(dict(top))
            self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if not params.ignore_eos and token in self.spec.eos_token_ids:
            return seq.finish("stop")
        if token in params.stop_token_ids:
            return seq.finish("stop", token)
        if params.stop:
            text = self.output_text(seq)
            found = [(i, s) for s in params.stop if (i := text.find(s)) >= 0]
            if found:
                idx, stop = min(found)
                seq.text = text[: idx + (len(stop) if params.include_stop_str_in_output else 0)]
                return seq.finish("stop", stop)
        if seq.num_output_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
            seq.finish("length")

    def output_text(self, seq: Sequence) -> str:
        if seq.text is not None:
            return seq.text
        return self.tokenizer.decode(seq.output_token_ids, seq.params.skip_special_tokens)


def _seq_params(seq: Sequence) -> SeqParams:
    p = seq.params
    return SeqParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=None if p.seed is None else p.seed + seq.index,
        logprobs=p.logprobs,
        processed_logprobs=p.logprobs_mode == "processed",
    )


def _make_executor(spec, config: EngineConfig) -> Executor:
    if config.world_size == 1:
        return InProcessExecutor(spec, config)
    from tandem.engine.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec, config)
