"""The engine core: requests in, one scheduled model step at a time, finished sequences out."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from tandem.config import EngineConfig
from tandem.engine.executor import EngineDeadError, Executor, InProcessExecutor
from tandem.engine.kv_cache import BlockManager, blocks_for
from tandem.engine.messages import (
    EncodeMessage,
    ReleaseWeights,
    ReloadWeights,
    RestoreWeights,
    SeqParams,
    SeqStep,
    StepMessage,
    StepResult,
)
from tandem.engine.model_runner import POOLINGS
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineLifecycle, EngineState
from tandem.engine.stats import EngineStats
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.weight_update import WeightUpdate
from tandem.errors import ModelLoadError
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import PushPhase, UpdateSpec
from tandem.models.loader import read_model_spec
from tandem.models.registry import import_model_modules

# Tokens per step unless configured: decodes first, then prompt chunks. Large enough that a step
# of prompt work amortises the per-step overhead, small enough that decodes keep flowing.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
PAUSE_MODES = ("abort", "wait", "keep")
CONTROL_YIELD_S = 0.0002  # how long `step` sleeps while a control call waits for the lock


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        import_model_modules(config.model_modules)
        self.spec = read_model_spec(config.model)
        _check_task(config.task, self.spec)
        limit = self.spec.max_context_len
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's {limit}")
        self.max_model_len = config.max_model_len or limit
        max_batched = config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if max_batched < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= max_num_seqs "
                f"({config.max_num_seqs}): every running sequence decodes a token each step"
            )
        self.tokenizer, self.outputs = None, None  # an image model has no tokenizer
        if config.task == "generate" or (self.spec.path / "tokenizer.json").is_file():
            self.tokenizer = Tokenizer(self.spec.path)
        if config.task == "generate":
            self.outputs = OutputProcessor(
                self.tokenizer, self.spec.eos_token_ids, self.max_model_len
            )
        self.executor: Executor = _make_executor(self.spec, config)
        self.blocks = BlockManager(
            self.executor.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
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
        self.lifecycle = EngineLifecycle()
        self.lock = threading.RLock()  # one step or one weight-update phase at a time
        self._updating = False  # a push's window is open: no step runs (`weight_update`)
        self._paused: str | None = None  # a `PAUSE_MODES` entry while paused (`pause`)
        self._resumed = threading.Condition(self.lock)
        self._controls = 0  # control calls waiting for the lock (`_control`)
        self._controls_lock = threading.Lock()
        # The exchange server calls these after every push attempt with (version, seconds,
        # error or None): metrics, logs.
        self.update_listeners: list[Callable[[int, float, str | None], None]] = []
        self._exchange = None
        self.peak_in_flight = 0  # most steps in flight at once (pipeline overlap, for tests)
        self.encode_batches = self.encode_inputs = 0  # embed / classify passes, sequences

    @contextmanager
    def _control(self) -> Iterator[None]:
        """The engine lock for a call from outside the stepping loop (pause, resume, abort,
        a push's phases, sleep, new requests): `step` lets it in before its next step, so a
        thread stepping in a tight loop cannot starve it (locks are not fair)."""
        with self._controls_lock:
            self._controls += 1
        try:
            with self.lock:
                yield
        finally:
            with self._controls_lock:
                self._controls -= 1

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
            from tandem.exchange.server import ExchangeServer

            self._exchange = ExchangeServer(self, host=self.config.exchange_host)
        return self._exchange

    def weight_layouts(self) -> list[RankLayout]:
        """What every rank holds, as canonical boxes: the receiving side of exchange plans."""
        return self.executor.layouts

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[WeightUpdate]:
        """A window for one push: steps already in flight (pipeline) finish, then no step runs
        until it closes; the caller runs the push's phases in it (`WeightUpdate.run`).
        Waiting and running requests go on afterwards with the new weights, each recording
        the versions it used. The lock is held only while a phase runs, never while the caller
        waits on trainers."""
        with self._control():
            self._drain_in_flight()
            self.lifecycle.check_alive()
            if self.lifecycle.weights_released:  # sleep(level=2): memory for the push first
                self._weight_memory(RestoreWeights())
            self._updating = True
            update = WeightUpdate(self, spec, self.weight_version)
        try:
            yield update
        except BaseException as exc:
            if update.exposed and update.torn is None:  # broke after writing live weights
                update.torn = f"the push of version {spec.version} broke: {exc}"
            try:
                self.apply_phase(PushPhase.ABORT, spec, {})  # every rank drops what it held
            except Exception:  # a dead rank: the engine is marked dead by apply_phase
                pass
            raise
        finally:
            with self._control():
                self.blocks.reset_prefix_cache()  # cached KV came from the old weights
                if update.torn is not None:
                    self.lifecycle.torn(update.torn)
                elif update.landed:
                    self.lifecycle.push_landed()
                    self.weight_version = spec.version
                self._updating = False
                self._resumed.notify_all()

    def apply_phase(self, phase: PushPhase, spec: UpdateSpec,
                    records_by_rank: dict[int, list]):  # fmt: skip
        """One phase of a push on every rank, under the engine lock: (errors, bytes moved)."""
        with self._control():
            return self._guarded(lambda: self.executor.apply(phase, spec, records_by_rank))

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
        return self.run_encode(inputs, token_types, self.check_encode(inputs, pooling), pixels)

    def run_encode(
        self,
        inputs: list[list[int]],
        token_types: list[list[int]] | None,
        pooling: str,
        pixels: list[list[float]] | None = None,
    ) -> list[list[float]]:
        """`encode` on inputs `check_encode` already accepted (its pooling resolved)."""
        task = self.config.task
        budget = self.config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        batches, current, size = [], [], 0
        for i, ids in enumerate(inputs):
            if current and size + len(ids) > budget:
                batches.append(current)
                current, size = [], 0
            current.append(i)
            size += len(ids)
        batches.append(current)
        rows: list[list[float]] = []
        with self._control():
            self._drain_in_flight()
            self.lifecycle.check_runnable()
            for batch in batches:
                types = None if token_types is None else [token_types[i] for i in batch]
                images = None if pixels is None else [pixels[i] for i in batch]
                msg = EncodeMessage(next(self._step_ids), [inputs[i] for i in batch], types,
                                    pooling, task, images)  # fmt: skip
                rows.extend(self._guarded(lambda msg=msg: self.executor.encode(msg)).rows)
                self.encode_batches += 1
                self.encode_inputs += len(batch)
        return rows

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
        return ids, types if getattr(self.spec.cls, "token_types", False) else None

    def check_encode(self, inputs: list[list[int]], pooling: str | None) -> str:
        """Check inputs for `encode` (ValueError names the problem); the pooling to use."""
        if self.config.task == "generate":
            raise ValueError("this engine's task is 'generate': embed / classify need "
                             "task='embed' or 'classify'")  # fmt: skip
        pooling = pooling or getattr(self.spec.cls, "default_pooling", "last")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        vocab = self.spec.vocab_size
        for i, ids in enumerate(inputs):
            if not ids:
                raise ValueError(f"input {i} is empty")
            if len(ids) > self.max_model_len:
                raise ValueError(f"input {i} has {len(ids)} tokens; max_model_len is "
                                 f"{self.max_model_len}")  # fmt: skip
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < vocab]  # fmt: skip
            if bad:
                raise ValueError(f"input {i}: token ids outside [0, {vocab}): {bad[:8]}")
        return pooling

    def make_sequences(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> list[Sequence]:
        """Check one request and turn it into its ``n`` samples (not queued yet)."""
        if self.config.task != "generate":
            raise ValueError(f"this engine's task is {self.config.task!r}, not 'generate'")
        if not prompt_ids:
            raise ValueError(f"request {request_id}: prompt is empty")
        vocab = self.spec.vocab_size
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int)]
        bad += [t for t in prompt_ids if isinstance(t, int) and not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id}: token ids outside [0, {vocab}): {bad[:8]}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1 and not (params.max_tokens == 0 and room == 0):
            raise ValueError(
                f"request {request_id}: prompt has {len(prompt_ids)} tokens; max_model_len is "
                f"{self.max_model_len} and at least one token must be generated"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        need = blocks_for(len(prompt_ids) + max(max_tokens, 1), self.blocks.block_size)
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
        """Queue sequences from `make_sequences` (a request's samples share its prompt)."""
        with self._control():
            requests: dict[str, list[Sequence]] = {}
            for seq in seqs:
                requests.setdefault(seq.request_id, []).append(seq)
            for samples in requests.values():
                self.scheduler.add_request(samples)

    def batch_window_left(self) -> float:
        """Seconds an idle static-batching engine should still let a burst gather before its
        next batch starts (0: step now). A server calls it; offline, every request is queued
        before the first step."""
        window = self.config.static_batch_window_s
        return self.scheduler.static_batch_window_left(window) if window else 0.0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (blocks in use stay with their sequences)."""
        with self._control():
            self.blocks.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pause(self, mode: str = "abort") -> list[Sequence]:
        """Stop generating until `resume` (RL controls, as vLLM's ``/pause``). ``abort``: every
        unfinished sequence ends now with finish_reason ``abort``, keeping the tokens and
        log-probs it has (returned: partial rollouts); ``wait``: no new sequence is admitted,
        running ones finish; ``keep``: no step runs, sequences keep their KV blocks and go on
        where they were after `resume`. New requests queue meanwhile; weight pushes land."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._control():
            self._paused = mode
            self.scheduler.admitting = False
            aborted = self.abort_requests(None) if mode == "abort" else []
            self._resumed.notify_all()
        return aborted

    def resume(self) -> None:
        with self._control():
            self._paused = None
            self.scheduler.admitting = True
            self._resumed.notify_all()

    @property
    def paused(self) -> str | None:
        """The pause mode in force, or None."""
        return self._paused

    def held(self) -> bool:
        """Whether a pause stops the next step now (``keep``; ``abort``/``wait`` once nothing
        runs)."""
        if self._paused is None:
            return False
        return self._paused == "keep" or not (self.scheduler.running or self._in_flight)

    def abort_requests(self, request_ids=None) -> list[Sequence]:
        """Abort the unfinished sequences of these requests (None: of every request); the
        ones aborted, with what they generated so far."""
        with self._control():
            wanted = None if request_ids is None else set(request_ids)
            seqs = [s for s in self.scheduler.unfinished()
                    if wanted is None or s.request_id in wanted]  # fmt: skip
            self.abort(seqs)
            return seqs

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop these sequences now (their client went away); their KV blocks return to the
        pool. One inside a step still in flight is released when that step lands."""
        with self._control():
            busy = {s.seq_id for b in self._in_flight for s in b.seqs}
            self._resumed.notify_all()  # `step` callers waiting on these
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
        if self.state is not EngineState.DEAD and self.lock.acquire(blocking=False):
            try:
                self._guarded(self.executor.check_alive)
            except EngineDeadError:
                pass
            finally:
                self.lock.release()

    def stats(self) -> EngineStats:
        blocks, scheduler = self.blocks, self.scheduler
        return EngineStats(
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_used=blocks.num_blocks - blocks.num_free,
            prefix_cache_blocks=blocks.num_cached,
            prefix_cache_queried_tokens=blocks.stats.queried_tokens,
            prefix_cache_hit_tokens=blocks.stats.hit_tokens,
            steps=scheduler.counters.steps,
            prefill_tokens=scheduler.counters.prefill_tokens,
            decode_tokens=scheduler.counters.decode_tokens,
            num_waiting=scheduler.num_unfinished - len(scheduler.running),
            num_running=len(scheduler.running),
            num_preemptions=scheduler.num_preemptions,
            encode_batches=self.encode_batches,
            encode_inputs=self.encode_inputs,
        )

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    def sleep(self, level: int = 1) -> None:
        """Release memory on every rank so a colocated trainer can use it: level 1 the KV
        cache (running sequences are preempted and recomputed after `wake`; nothing is lost,
        the cached prefixes go with the memory), level 2 the weights too (vLLM's level 2:
        after `wake`, requests are refused until a push lands or `reload_weights`)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache) or 2 (and weights), got {level}")
        with self._control():
            self.lifecycle.check_alive()
            if level == 2 and self._updating:
                raise RuntimeError("a weight push is in progress: sleep(level=2) after it")
            if not self.lifecycle.kv_released:
                self._drain_in_flight()
                self.scheduler.preempt_all()
                self.blocks.reset_prefix_cache()  # their keys/values leave with the memory
                self._guarded(lambda: self.executor.set_kv_cache(False))
            if level == 2 and not self.lifecycle.weights_released:
                self._weight_memory(ReleaseWeights())
            self.lifecycle.slept(weights=level == 2)

    def wake(self, kv_cache: bool = True, weights: bool = True) -> None:
        """Re-allocate what `sleep` released (vLLM's ``wake_up`` tags): the KV cache, and the
        weights' memory (zeroed: they serve nothing until a push or `reload_weights`)."""
        with self._control():
            self.lifecycle.check_alive()
            if weights and self.lifecycle.weights_released:
                self._weight_memory(RestoreWeights())
            if kv_cache and self.lifecycle.kv_released:
                self._guarded(lambda: self.executor.set_kv_cache(True))
                self.lifecycle.woke()

    def reload_weights(self) -> None:
        """Read every rank's weights from the checkpoint again (after ``sleep(level=2)``, or
        to undo pushes): the engine serves version 0, the checkpoint's. Sequences running go
        on under the reloaded weights, recording the version change."""
        with self._control():
            self.lifecycle.check_alive()
            if self._updating:
                raise RuntimeError("a weight push is in progress: reload_weights after it")
            self._drain_in_flight()
            errors = self._weight_memory(ReloadWeights())
            self.blocks.reset_prefix_cache()
            if errors:
                self.lifecycle.torn(f"reloading the checkpoint failed: {'; '.join(errors)}")
                raise ModelLoadError(f"reloading the weights failed: {'; '.join(errors)}",
                                     file=str(self.spec.path))  # fmt: skip
            self.weight_version = 0
            self.lifecycle.push_landed()
            self._resumed.notify_all()

    def _weight_memory(self, msg) -> list[str]:
        return self._guarded(lambda: self.executor.weight_memory(msg))

    def step(self, for_seqs: list[Sequence] | None = None) -> list[Sequence]:
        """Schedule, run, and process outputs: fills the pipeline with steps (with P pipeline
        stages up to P steps on disjoint sequences are in flight), then finishes the oldest and
        returns the sequences that finished in it. While paused or updating it waits; with
        ``for_seqs`` it returns as soon as those are finished (by another thread's step)."""
        while self._controls:  # a control call (pause, push, abort...) goes first
            time.sleep(CONTROL_YIELD_S)
        with self.lock:
            while (self._updating or self.held()) and self.has_unfinished():
                if for_seqs is not None and all(seq.finished for seq in for_seqs):
                    return []  # another thread's step or an abort finished them
                self._resumed.wait()
            if not self.has_unfinished():  # aborted (pause, abort) while this call waited
                return []
            self.lifecycle.check_runnable()
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
        if finished:
            self._resumed.notify_all()  # `step` callers waiting on these
        return finished

    def _drain_in_flight(self) -> None:
        while self._in_flight:
            self._finish_oldest()

    def _guarded(self, call):
        """Run an executor call; a dead worker marks the engine dead and stops the rest."""
        try:
            return call()
        except EngineDeadError as exc:
            self.lifecycle.died(str(exc))
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
                    seq.seq_id, start, seq.token_ids[start : start + n], list(blocks), params,
                    replace, batch.samples[i], -1 if logits_from is None else logits_from,
                )
            )  # fmt: skip
        copies = [[src, dst] for src, dst in batch.copies]
        msg = StepMessage(next(self._step_ids), steps, self._released, copies)
        self._released = []
        return msg

    def _append(self, batch: ScheduledBatch, out: StepResult) -> None:
        now = time.monotonic()
        if out.prompt_logprobs:
            by_id = {seq.seq_id: seq for seq in batch.seqs}
            for p in out.prompt_logprobs:
                by_id[p.seq_id].record_prompt_logprobs(
                    p.first, p.logprobs, p.top_ids, p.top_logprobs
                )
        rows = itertools.count()
        for seq, sampled in zip(batch.seqs, batch.samples, strict=True):
            if not sampled:  # a prompt chunk: nothing to sample yet
                continue
            row = next(rows)
            if seq.finished:  # aborted while its step was in flight
                continue
            if seq.max_tokens == 0:  # the prompt was only scored
                seq.finish("length")
                continue
            token = out.token_ids[row]
            seq.token_ids.append(token)
            if seq.params.return_routed_experts:
                seq.routed_experts.append(out.routed_experts[row])
            seq.record_version(self.weight_version)
            if seq.first_token_time is None:
                seq.first_token_time = now
            k = seq.params.logprobs
            if k is not None:
                seq.logprobs.append(out.logprobs[row])
                if k > 0:
                    top = zip(out.top_ids[row][:k], out.top_logprobs[row][:k], strict=True)
                    seq.top_logprobs.append(dict(top))
            self.outputs.process(seq, token)


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
    )


def unit_norm(row: list[float]) -> list[float]:
    """``row`` scaled to unit L2 norm (embeddings with ``normalize``)."""
    vector = torch.tensor(row)
    return (vector / vector.norm().clamp_min(1e-12)).tolist()


def _check_task(task: str, spec) -> None:
    """The model class can do what the task asks."""
    needs = {"generate": "compute_logits", "classify": "classify"}.get(task)
    if needs is not None and getattr(spec.cls, needs, None) is None:
        raise ValueError(
            f"task={task!r}: {spec.architecture} has no {needs} (a causal LM generates; "
            "a *ForSequenceClassification classifies)"
        )


def _make_executor(spec, config: EngineConfig) -> Executor:
    if config.distributed_executor_backend == "ray":
        from tandem.engine.ray_executor import RayExecutor

        return RayExecutor(spec, config)
    if config.world_size == 1:
        return InProcessExecutor(spec, config)
    from tandem.engine.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec, config)
