"""The engine core: requests in, one scheduled model step at a time, finished sequences out.

`LLMEngine.step` is the token path: schedule a batch (`Scheduler`), run it on every rank
(`Executor`: `submit`, then `collect` the sampling rank's `StepResult`), and process the outputs
(`OutputProcessor.record_step`). What else the engine does lives beside it, one concern per
module: admission (`admission.py`), embed / classify (`encode.py`), pause / abort / sleep /
wake (`controls.py`) and the weight-push window (`push_window.py`); the lifecycle they all move
through is `state.EngineLifecycle`.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tandem.config import EngineConfig
from tandem.engine.admission import Admission, Limits
from tandem.engine.controls import EngineControls
from tandem.engine.dtype_auto import resolve_dtype
from tandem.engine.encode import EngineEncode
from tandem.engine.executor import EngineDeadError, Executor, InProcessExecutor
from tandem.engine.kv_cache import BlockManager
from tandem.engine.lora_adapters import EngineLoRA
from tandem.engine.lora_registry import LoRARegistry
from tandem.engine.messages import StepResult
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.push_window import PushWindow
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineLifecycle, EngineState
from tandem.engine.stats import EngineStats
from tandem.engine.step_message import step_message
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import LoRAError
from tandem.lora.config import LORA_MODULES
from tandem.models.loader import read_model_spec
from tandem.models.registry import import_model_modules

HEALTH_CHECK_S = 1.0  # how often a paused step checks that its workers are still there
CONTROL_YIELD_S = 0.0002  # how long `step` sleeps while a control call waits for the lock


class LLMEngine(EngineControls, EngineEncode, PushWindow, EngineLoRA):
    def __init__(self, config: EngineConfig):
        import_model_modules(config.model_modules)
        self.spec = read_model_spec(config.model, config.quantization)
        self.dtype_choice = resolve_dtype(config, self.spec)  # once: every rank gets the name
        self.config = config = config.model_copy(update={"dtype": self.dtype_choice.dtype})
        self.limits = Limits(self.spec, config)
        self.tokenizer, self.outputs = None, None  # an image model has no tokenizer
        if config.task == "generate" or (self.spec.path / "tokenizer.json").is_file():
            self.tokenizer = Tokenizer(self.spec.path)
        if config.task == "generate":
            self.outputs = OutputProcessor(
                self.tokenizer, self.spec.eos_token_ids, self.limits.max_model_len
            )
        self.executor: Executor = _make_executor(self.spec, config)
        self.blocks = BlockManager(
            self.executor.num_blocks,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self.admission = Admission(self.spec, config.task, self.limits, self.tokenizer,
                                   self.blocks)  # fmt: skip
        self.scheduler = Scheduler(
            self.blocks,
            config.scheduler.max_num_seqs,
            self.limits.max_num_batched_tokens,
            policy=config.scheduler.scheduling_policy,
            max_wait_s=config.scheduler.max_wait_s,
            batching=config.scheduler.batching,
        )
        self.weight_version = 0
        self.lora = None  # LoRA adapters' slots (`tandem.engine.lora_registry`)
        if config.lora.enable_lora:
            if not any(lay.lora_sites for lay in self.executor.layouts):
                self.executor.shutdown()
                raise LoRAError(f"{self.spec.cls.__name__} has no layers LoRA adapts "
                                f"({', '.join(LORA_MODULES)})")  # fmt: skip
            self.lora = LoRARegistry(config.lora, self._lora_busy)
        self.lifecycle = EngineLifecycle(weights=config.load_format == "auto")
        self._step_ids = itertools.count()
        self._in_flight: deque[ScheduledBatch] = deque()
        self._released: list[int] = []  # finished sequences the ranks may forget
        self._peak_in_flight = 0
        self.lock = threading.RLock()  # one step or one control call at a time
        self._resumed = threading.Condition(self.lock)  # a pause, a push or an abort ended
        self._controls = 0  # control calls waiting for the lock (`_control`)
        self._controls_lock = threading.Lock()
        # The exchange server calls these after every push attempt with (version, seconds,
        # error or None): metrics, logs.
        self.update_listeners: list[Callable[[int, float, str | None], None]] = []

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

    def step(self, for_seqs: list[Sequence] | None = None) -> list[Sequence]:
        """Schedule, run, and process outputs: fills the pipeline with steps (with P pipeline
        stages up to P steps on disjoint sequences are in flight), then finishes the oldest and
        returns the sequences that finished in it. While paused or updating it waits; with
        ``for_seqs`` it returns as soon as those are finished (by another thread's step)."""
        while self._controls:  # a control call (pause, push, abort...) goes first
            time.sleep(CONTROL_YIELD_S)
        with self.lock:
            if not self._wait_for_work(for_seqs):
                return []
            self._guarded(self._schedule)
            return self._process_outputs(self._guarded(self.executor.collect))

    def _wait_for_work(self, for_seqs: list[Sequence] | None) -> bool:
        """Wait out a pause or a push window (raising EngineDeadError if a worker dies
        meanwhile); whether there is a step to run."""
        while (self.lifecycle.updating or self.held()) and self.has_unfinished():
            if for_seqs is not None and all(seq.finished for seq in for_seqs):
                return False  # another thread's step or an abort finished them
            if not self._resumed.wait(timeout=HEALTH_CHECK_S) and not self.lifecycle.updating:
                self._guarded(self.executor.check_alive)  # paused: are the workers there?
            self.lifecycle.check_alive()
        if not self.has_unfinished():  # aborted (pause, abort) while this call waited
            return False
        self.lifecycle.check_runnable()
        return True

    def _schedule(self) -> None:
        """Submit batches until the pipeline is full: each step in flight takes its share of
        the unfinished sequences, disjoint from the others'."""
        depth = self.executor.max_in_flight
        while len(self._in_flight) < depth:
            busy = {s.seq_id for b in self._in_flight for s in b.seqs}
            share = math.ceil(self.scheduler.num_unfinished / depth)
            batch = self.scheduler.schedule(busy, max_seqs=max(1, share))
            if not batch:
                break
            self.executor.submit(step_message(next(self._step_ids), batch, self._released))
            self._released = []
            self._in_flight.append(batch)
            self._peak_in_flight = max(self._peak_in_flight, len(self._in_flight))
        if not self._in_flight:
            raise RuntimeError("scheduler produced an empty batch with requests pending")

    def _process_outputs(self, result: StepResult) -> list[Sequence]:
        """The oldest step's results onto its sequences; the ones that finished."""
        batch = self._in_flight.popleft()
        self.outputs.record_step(batch.seqs, batch.samples, result, self.weight_version)
        self.scheduler.finish_step(batch)
        finished = [s for s in batch.seqs if s.finished]
        self._released.extend(s.seq_id for s in finished)
        if finished:
            self._resumed.notify_all()  # `step` callers waiting on these
        return finished

    def _drain_in_flight(self) -> None:
        while self._in_flight:
            self._process_outputs(self._guarded(self.executor.collect))

    def _guarded(self, call):
        """Run an executor call; a dead worker marks the engine dead and stops the rest."""
        try:
            return call()
        except EngineDeadError as exc:
            self.lifecycle.died(str(exc))
            self.executor.shutdown()
            raise

    def add(self, seqs: list[Sequence]) -> None:
        """Queue sequences from `Admission.make_sequences` (a request's samples share its
        prompt)."""
        with self._control():
            requests: dict[str, list[Sequence]] = {}
            for seq in seqs:
                requests.setdefault(seq.request_id, []).append(seq)
            for samples in requests.values():
                self.scheduler.add_request(samples)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def batch_window_left(self) -> float:
        """Seconds an idle static-batching engine should still let a burst gather before its
        next batch starts (0: step now). A server calls it; offline, every request is queued
        before the first step."""
        window = self.config.scheduler.static_batch_window_s
        return self.scheduler.static_batch_window_left(window) if window else 0.0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (blocks in use stay with their sequences)."""
        with self._control():
            self.blocks.reset_prefix_cache()

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

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
            peak_steps_in_flight=self._peak_in_flight,
            encode_batches=self.encode_batches,
            encode_inputs=self.encode_inputs,
        )

    def shutdown(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
        self.executor.shutdown()


def _make_executor(spec, config: EngineConfig) -> Executor:
    if config.parallel.distributed_executor_backend == "ray":
        from tandem.engine.ray_executor import RayExecutor

        return RayExecutor(spec, config)
    if config.parallel.world_size == 1 and config.parallel.data_parallel_size == 1:
        return InProcessExecutor(spec, config)  # a fleet's replicas run in processes of their own
    from tandem.engine.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec, config)
