"""The engine core: requests in, one scheduled model step at a time, finished sequences out.

`LLMEngine.step` is the token path: schedule a batch (`Scheduler`), run it on every rank
(`Stepper`: the executor's `submit`, then `collect` the sampling rank's `StepResult`), and
process the outputs (`OutputProcessor.record_step`). The engine is made of parts that own
their state, each in its own module, sharing one lock (`EngineLock`): admission
(`admission.py`), the scheduler with its KV blocks, the stepper, the controls with the
lifecycle (`controls.py`, `state.EngineLifecycle`), embed / classify / score (`encode.py`), LoRA
adapters (`lora_adapters.py`) and the weights' push window (`push_window.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tandem.config import EngineConfig
from tandem.engine.admission import Admission, Limits
from tandem.engine.controls import Controls
from tandem.engine.dtype_auto import resolve_dtype
from tandem.engine.encode import Encoder
from tandem.engine.engine_lock import EngineLock
from tandem.engine.engine_target import EngineTarget
from tandem.engine.executor import EngineDeadError, Executor, InProcessExecutor, ReplicaSlot
from tandem.engine.kv_cache import BlockManager
from tandem.engine.lora_adapters import Adapters
from tandem.engine.lora_registry import LoRARegistry
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.push_window import PushWindow
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineLifecycle, EngineState
from tandem.engine.stats import EngineStats
from tandem.engine.step_loop import HEALTH_CHECK_S, StepLoop
from tandem.engine.stepper import Stepper
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import LoRAError
from tandem.lora.config import LORA_MODULES
from tandem.models.loader import read_model_spec
from tandem.models.registry import import_model_modules


class LLMEngine:
    """One engine: requests in, one scheduled model step at a time, finished sequences out.

    Its public API:
    - what it serves: ``spec``, ``config``, ``dtype_choice``, ``limits``, ``tokenizer``,
      ``admission`` (checks requests and makes their sequences), ``outputs`` (their text);
    - the requests: `add`, `run` (wait for them: one caller at a time steps), `step`, `abort`,
      `has_unfinished`, `batch_window_left`, `reset_prefix_cache`, `stats`, ``scheduler``
      (read-only: what waits and runs);
    - ``controls`` (`Controls`: pause, resume, abort by request, sleep, wake, reload, and the
      ``lifecycle``), ``encoder`` (`Encoder`: embed, classify, score), ``adapters`` (`Adapters`:
      LoRA), ``window`` (`PushWindow`: the weights' version and a push's window), ``target``
      (`EngineTarget`: the push side, with its exchange server);
    - ``weight_version``, `state`, `unavailable`, `check_health`, `worker_locations`,
      `apply_model` (a function on the model, where the ranks run in this process),
      `shutdown`.
    """

    def __init__(self, config: EngineConfig, slot: ReplicaSlot | None = None):
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
        executor: Executor = _make_executor(self.spec, config, slot)
        self._blocks = BlockManager(
            executor.num_blocks,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self.admission = Admission(
            self.spec, config.task, self.limits, self.tokenizer, self._blocks
        )
        self.scheduler = Scheduler(
            self._blocks,
            config.scheduler.max_num_seqs,
            self.limits.max_num_batched_tokens,
            policy=config.scheduler.scheduling_policy,
            max_wait_s=config.scheduler.max_wait_s,
            batching=config.scheduler.batching,
        )
        lora = None  # LoRA adapters' slots (`tandem.engine.lora_registry`)
        if config.lora.enable_lora:
            if not any(lay.lora_sites for lay in executor.layouts):
                executor.shutdown()
                raise LoRAError(
                    f"{self.spec.cls.__name__} has no layers LoRA adapts "
                    f"({', '.join(LORA_MODULES)})"
                )
            lora = LoRARegistry(config.lora, self.scheduler.lora_slots)
        lifecycle = EngineLifecycle(weights=config.load_format == "auto")
        self._lock = EngineLock()
        self._stepper = Stepper(executor, self.scheduler, self.outputs, lifecycle)
        self.window = PushWindow(self._lock, self._stepper, lifecycle, self._blocks, lora)
        self.controls = Controls(
            self._lock,
            lifecycle,
            self.scheduler,
            self._blocks,
            self._stepper,
            self.window,
            self.spec.path,
        )
        self.encoder = Encoder(self._lock, self._stepper, lifecycle, self.admission, config.task)
        self.adapters = Adapters(lora, self._lock, lambda: self.target.exchange_server().address)
        self.target = EngineTarget(self)  # the push side
        self._loop = StepLoop(self.step, self._runnable, self.check_health, self._lock, lifecycle)

    def run(self, seqs: list[Sequence]) -> None:
        """Until ``seqs`` (queued with `add`) are finished: one waiting caller at a time steps
        for all of them (`StepLoop`); raises what keeps them from finishing."""
        self._loop.wait(seqs, self.controls.held)

    def step(self) -> list[Sequence]:
        """Schedule, run, and process outputs: fills the pipeline with steps (with P pipeline
        stages up to P steps on disjoint sequences are in flight), then finishes the oldest and
        returns the sequences that finished in it. While paused or updating it waits. Called
        by one thread at a time: the caller whose turn it is (`run`), or a server's engine
        thread."""
        with self._lock.step():
            if not self._wait_for_work():
                return []
            self._stepper.fill(self.window.version)
            finished = self._stepper.finish_oldest()
            if finished:
                self._lock.resumed.notify_all()  # `step` callers waiting on these
            return finished

    def _wait_for_work(self) -> bool:
        """Wait out a pause or a push window (raising EngineDeadError if a worker dies
        meanwhile); whether there is a step to run."""
        lifecycle = self.controls.lifecycle
        while (lifecycle.updating or self.controls.held()) and self.has_unfinished():
            if not self._lock.resumed.wait(timeout=HEALTH_CHECK_S) and not lifecycle.updating:
                self._stepper.guarded(self._stepper.executor.check_alive)  # paused: workers?
            lifecycle.check_alive()
        if not self.has_unfinished():  # aborted (pause, abort) while this call waited
            return False
        lifecycle.check_runnable()
        return True

    def add(self, seqs: list[Sequence]) -> None:
        """Queue sequences from `Admission.make_sequences` (a request's samples share its
        prompt)."""
        with self._lock.control():
            requests: dict[str, list[Sequence]] = {}
            for seq in seqs:
                requests.setdefault(seq.request_id, []).append(seq)
            for samples in requests.values():
                self.scheduler.add_request(samples)
            self._lock.resumed.notify_all()  # a stepping loop waiting for work

    def _runnable(self) -> bool:
        """Whether a step would run now: sequences wait, no pause holds them, no push window
        is open, and the engine is running."""
        controls = self.controls
        return (
            self.has_unfinished()
            and self.state is EngineState.RUNNING
            and not controls.lifecycle.updating
            and not controls.held()
        )

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop these sequences now (see `Controls.abort`)."""
        self.controls.abort(seqs)

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
        with self._lock.control():
            self._blocks.reset_prefix_cache()

    @property
    def state(self) -> EngineState:
        return self.controls.lifecycle.state

    def check_health(self) -> None:
        """Notice a dead worker while idle (marks the engine dead). Skipped while a step or a
        weight update holds the engine: those notice it themselves."""
        if self.state is not EngineState.DEAD and self._lock.try_acquire():
            try:
                self._stepper.guarded(self._stepper.executor.check_alive)
            except EngineDeadError:
                pass
            finally:
                self._lock.release()

    def stats(self) -> EngineStats:
        blocks, scheduler = self._blocks, self.scheduler
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
            peak_steps_in_flight=self._stepper.peak_in_flight,
            encode_batches=self.encoder.batches,
            encode_inputs=self.encoder.inputs,
            score_batches=self.encoder.score_batches,
            score_prompts=self.encoder.score_prompts,
        )

    def worker_locations(self) -> list[dict]:
        """Where each rank runs: ``{rank, node_id, pid}``."""
        return self._stepper.executor.worker_locations()

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list:
        """``func(model)`` between steps, on the model of each rank (vLLM's ``apply_model``):
        the results in rank order. The ranks must run in this process (one rank, in-process);
        else `NotImplementedError`: tandem sends no code to its workers."""
        with self._lock.control():
            return self._stepper.executor.apply_model(func)

    @property
    def weight_version(self) -> int:
        """The version of the weights serving (0: the checkpoint's)."""
        return self.window.version

    def unavailable(self) -> str | None:
        """Why no request can be served now (dead, torn weights, none loaded), or None."""
        return self.controls.lifecycle.unavailable()

    def shutdown(self) -> None:
        self.target.close()
        self._stepper.executor.shutdown()


def _make_executor(spec, config: EngineConfig, slot: ReplicaSlot | None) -> Executor:
    if config.parallel.distributed_executor_backend == "ray":
        from tandem.engine.ray_executor import RayExecutor

        return RayExecutor(spec, config, slot)
    if config.parallel.world_size == 1 and (slot is None or slot.size == 1):
        return InProcessExecutor(spec, config)  # a fleet's replicas run in processes of their own
    from tandem.engine.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec, config, slot)
