"""The engine's weights as a push sees them: the version they are, whether they hold memory
(`sleep(level=2)` releases it, `reload_weights` reads the checkpoint again), and the window in
which one push's phases run while no step does (`tandem.engine.weight_update`, driven by the
exchange server)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tandem.engine.engine_lock import EngineLock
from tandem.engine.kv_cache import BlockManager
from tandem.engine.lora_registry import LoRARegistry
from tandem.engine.messages import ReleaseWeights, ReloadWeights, RestoreWeights
from tandem.engine.state import EngineLifecycle
from tandem.engine.stepper import Stepper
from tandem.engine.weight_update import WeightUpdate
from tandem.exchange.settings import PushPhase, UpdateSpec


class PushWindow:
    def __init__(self, lock: EngineLock, stepper: Stepper, lifecycle: EngineLifecycle,
                 blocks: BlockManager, lora: LoRARegistry | None):  # fmt: skip
        self._lock = lock
        self._stepper = stepper
        self._lifecycle = lifecycle
        self._blocks = blocks
        self._lora = lora
        self.version = 0  # the weights serving (0: the checkpoint's)
        # called after every push attempt with (version, seconds, error or None): the
        # exchange server calls them (metrics, logs)
        self.update_listeners: list[Callable[[int, float, str | None], None]] = []

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[WeightUpdate]:
        """A window for one push: steps already in flight (pipeline) finish, then no step runs
        until it closes; the caller runs the push's phases in it (`WeightUpdate.run`).
        Waiting and running requests go on afterwards with the new weights, each recording
        the versions it used. The lock is held only while a phase runs, never while the caller
        waits on trainers."""
        with self._lock.control():
            self._stepper.drain()
            self._lifecycle.check_alive()
            if self._lifecycle.weights_released:  # sleep(level=2): memory for the push first
                self.memory(RestoreWeights())
            if spec.adapter is not None:  # the slot's adapter leaves (LoRARegistry.begin)
                self._lora.begin(spec.adapter)
            self._lifecycle.open_update()
            update = WeightUpdate(self.apply_phase, spec, self.version)
        adapter = spec.adapter
        try:
            yield update
        except BaseException as exc:
            if adapter is not None:  # the slot may be half-written: it serves nothing now
                update.torn = None
                self._lora.failed(adapter, intact=not update.exposed)
            elif update.exposed and update.torn is None:  # broke after writing live weights
                update.torn = f"the push of version {spec.version} broke: {exc}"
            try:
                self.apply_phase(PushPhase.ABORT, spec, {})  # every rank drops what it held
            except Exception:  # a dead rank: the engine is marked dead by apply_phase
                pass
            raise
        finally:
            with self._lock.control():
                if update.landed or update.exposed:  # cached KV came from the old weights
                    self._blocks.reset_prefix_cache()
                if adapter is None:
                    self._lifecycle.close_update(update.torn, update.landed)
                    if update.torn is None and update.landed:  # the spec's version (a driver
                        self.version = update.spec.version  # may name it at commit)
                else:  # the base weights are as they were; the adapter's version is its own
                    self._lifecycle.close_update(None, False)
                    if update.landed:
                        self._lora.committed(adapter, update.spec.version)
                self._lock.resumed.notify_all()

    def apply_phase(self, phase: PushPhase, spec: UpdateSpec,
                    records_by_rank: dict[int, list]):  # fmt: skip
        """One phase of a push on every rank, under the engine lock: (errors, bytes moved)."""
        with self._lock.control():
            executor = self._stepper.executor
            return self._stepper.guarded(lambda: executor.apply(phase, spec, records_by_rank))

    def relabel(self, version: int) -> None:
        """Call the weights being served ``version`` from now on (vLLM's
        ``/update_weight_version``: a trainer names the version after its push landed)."""
        with self._lock.control():
            self.version = version

    def memory(self, msg: ReleaseWeights | RestoreWeights | ReloadWeights) -> list[str]:
        """Release, restore or reload the weights' memory on every rank (under the lock): the
        errors reported. Every LoRA slot reads as zeros afterwards."""
        if self._lora is not None:
            self._lora.forget_all()
        executor = self._stepper.executor
        return self._stepper.guarded(lambda: executor.weight_memory(msg))

    def reloaded(self) -> None:
        """The checkpoint was read again: version 0 serves."""
        self.version = 0
        self._lifecycle.push_landed()
