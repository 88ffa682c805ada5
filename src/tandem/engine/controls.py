"""The engine's controls from outside the stepping loop: pause / resume, abort, sleep / wake and
reloading the checkpoint (RL frameworks call them between rollouts; vLLM's RL routes). Each
runs under the engine lock (`EngineLock.control`) and moves the `EngineLifecycle` it owns
through its transitions; the engine's step reads the lifecycle to know whether it may run."""

from __future__ import annotations

import time
from pathlib import Path

from tandem.engine.engine_lock import EngineLock
from tandem.engine.kv_cache import BlockManager
from tandem.engine.messages import ReleaseWeights, ReloadWeights, RestoreWeights
from tandem.engine.push_window import PushWindow
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineLifecycle, EngineState, PauseMode
from tandem.engine.step_loop import HEALTH_CHECK_S
from tandem.engine.stepper import Stepper
from tandem.errors import ModelLoadError


class Controls:
    def __init__(
        self,
        lock: EngineLock,
        lifecycle: EngineLifecycle,
        scheduler: Scheduler,
        blocks: BlockManager,
        stepper: Stepper,
        window: PushWindow,
        checkpoint: Path,
    ):
        self.lifecycle = lifecycle
        self._lock = lock
        self._scheduler = scheduler
        self._blocks = blocks
        self._stepper = stepper
        self._window = window
        self._checkpoint = checkpoint

    def pause(self, mode: str = "abort") -> list[Sequence]:
        """Stop generating until `resume` (RL controls, as vLLM's ``/pause``). ``abort``: every
        unfinished sequence ends now with finish_reason ``abort``, keeping the tokens and
        log-probs it has (returned: partial rollouts); ``wait``: no new sequence is admitted,
        running ones finish; ``keep``: no step runs, sequences keep their KV blocks and go on
        where they were after `resume`. New requests queue meanwhile; weight pushes land."""
        with self._lock.control():
            mode = self.lifecycle.pause(mode)
            self._scheduler.admitting = False
            aborted = self.abort_requests(None) if mode is PauseMode.ABORT else []
            self._lock.resumed.notify_all()
        return aborted

    def resume(self) -> None:
        with self._lock.control():
            self.lifecycle.resume()
            self._scheduler.admitting = True
            self._lock.resumed.notify_all()

    @property
    def paused(self) -> str | None:
        """The pause mode in force (``abort``, ``wait``, ``keep``), or None."""
        mode = self.lifecycle.pause_mode
        return None if mode is None else mode.value

    def held(self) -> bool:
        """Whether a pause stops the next step now (``keep``; ``abort``/``wait`` once nothing
        runs)."""
        mode = self.lifecycle.pause_mode
        if mode is None:
            return False
        return mode is PauseMode.KEEP or not (self._scheduler.running or self._stepper.in_flight)

    def wait_held(self, timeout_s: float | None = None) -> bool:
        """Until a pause holds the next step (``wait``: the running sequences finished) or
        the engine stops running: whether a pause holds it; False past ``timeout_s``. Waits
        on the condition a step notifies when sequences finish (and looks again every
        ``HEALTH_CHECK_S`` for an engine that died meanwhile)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock.resumed:  # not `control()`: the steps it waits for must run
            while not self.held() and self.lifecycle.state is EngineState.RUNNING:
                left = HEALTH_CHECK_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.resumed.wait(min(left, HEALTH_CHECK_S))
        return self.held()

    def abort_requests(self, request_ids=None) -> list[Sequence]:
        """Abort the unfinished sequences of these requests (None: of every request); the
        ones aborted, with what they generated so far."""
        with self._lock.control():
            wanted = None if request_ids is None else set(request_ids)
            seqs = [
                s for s in self._scheduler.unfinished() if wanted is None or s.request_id in wanted
            ]
            self.abort(seqs)
            return seqs

    def abort(self, seqs: list[Sequence]) -> None:
        """Stop these sequences now (their client went away); their KV blocks return to the
        pool. One inside a step still in flight is released when that step lands."""
        with self._lock.control():
            busy = self._stepper.busy()
            self._lock.resumed.notify_all()  # `step` callers waiting on these
            for seq in seqs:
                if seq.finished:
                    continue
                seq.finish("abort")
                if seq.seq_id not in busy:
                    self._scheduler.remove(seq)
                    self._stepper.release(seq.seq_id)

    def sleep(self, level: int = 1) -> None:
        """Release memory on every rank so a colocated trainer can use it: level 1 the KV
        cache (running sequences are preempted and recomputed after `wake`; nothing is lost,
        the cached prefixes go with the memory), level 2 the weights too (vLLM's level 2:
        after `wake`, requests are refused until a push lands or `reload_weights`)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache) or 2 (and weights), got {level}")
        with self._lock.control():
            self.lifecycle.check_alive()
            if level == 2:
                self.lifecycle.check_idle_for("sleep(level=2)")
            if not self.lifecycle.kv_released:
                self._stepper.drain()
                self._scheduler.preempt_all()
                self._blocks.reset_prefix_cache()  # their keys/values leave with the memory
                executor = self._stepper.executor
                self._stepper.guarded(lambda: executor.set_kv_cache(False))
            if level == 2 and not self.lifecycle.weights_released:
                self._window.memory(ReleaseWeights())
            self.lifecycle.slept(weights=level == 2)

    def wake(self, kv_cache: bool = True, weights: bool = True) -> None:
        """Re-allocate what `sleep` released (vLLM's ``wake_up`` tags): the KV cache, and the
        weights' memory (zeroed: they serve nothing until a push or `reload_weights`)."""
        with self._lock.control():
            self.lifecycle.check_alive()
            if weights and self.lifecycle.weights_released:
                self._window.memory(RestoreWeights())
            if kv_cache and self.lifecycle.kv_released:
                executor = self._stepper.executor
                self._stepper.guarded(lambda: executor.set_kv_cache(True))
                self.lifecycle.woke()

    def reload_weights(self) -> None:
        """Read every rank's weights from the checkpoint again (after ``sleep(level=2)``, or
        to undo pushes): the engine serves version 0, the checkpoint's. Sequences running go
        on under the reloaded weights, recording the version change."""
        with self._lock.control():
            self.lifecycle.check_alive()
            self.lifecycle.check_idle_for("reload_weights")
            self._stepper.drain()
            errors = self._window.memory(ReloadWeights())
            self._blocks.reset_prefix_cache()
            if errors:
                self.lifecycle.torn(f"reloading the checkpoint failed: {'; '.join(errors)}")
                raise ModelLoadError(
                    f"reloading the weights failed: {'; '.join(errors)}", file=str(self._checkpoint)
                )
            self._window.reloaded()
            self._lock.resumed.notify_all()
