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
from tandem.engine.weight_update import UpdateState, WeightUpdate
from tandem.exchange.layout import RankLayout
from tandem.exchange.settings import PushPhase, UpdateSpec


class PushWindow:
    def __init__(
        self,
        lock: EngineLock,
        stepper: Stepper,
        lifecycle: EngineLifecycle,
        blocks: BlockManager,
        lora: LoRARegistry | None,
    ):
        self._lock = lock
        self._stepper = stepper
        self._lifecycle = lifecycle
        self._blocks = blocks
        self._lora = lora
        self.version = 0  # the weights serving (0: the checkpoint's)
        # the id of the push the weights came from, untouched since (None: loaded from disk,
        # released, reloaded, torn, or pushed without an id): a delta push needs its base here
        self.base: str | None = None
        # called after every push attempt with (version, seconds, error or None): the
        # exchange server calls them (metrics, logs)
        self.update_listeners: list[Callable[[int, float, str | None], None]] = []

    @property
    def layouts(self) -> list[RankLayout]:
        """What every rank holds, as canonical boxes: what a push's plan writes into."""
        return self._stepper.executor.layouts

    @property
    def in_process(self) -> bool:
        """Whether the ranks (one) run in the engine's own process."""
        return self._stepper.executor.in_process

    @contextmanager
    def weight_update(self, spec: UpdateSpec) -> Iterator[WeightUpdate]:
        """A window for one push: steps already in flight (pipeline) finish, then no step runs
        until it closes; the caller runs the push's phases in it (`WeightUpdate.run`).
        Waiting and running requests go on afterwards with the new weights, each recording
        the versions it used. The lock is held only while a phase runs, never while the caller
        waits on trainers. What the push writes is its plan's: the base weights, or one
        LoRA adapter's slot."""
        if spec.adapter is None:
            plan = _BaseWeights(self, self._lifecycle, spec)
        else:
            plan = _AdapterSlot(self._lora, self._lifecycle, spec)
        with self._lock.control():
            self._stepper.drain()
            self._lifecycle.check_alive()
            if self._lifecycle.weights_released:  # sleep(level=2): memory for the push first
                self.memory(RestoreWeights())
            plan.open()
            self._lifecycle.open_update()
            update = WeightUpdate(self.apply_phase, spec, self.version, plan)
        try:
            yield update
        except BaseException as exc:
            plan.broke(update, exc)
            try:  # every rank drops what it held (a delta: puts back what it applied)
                errors, _ = self.apply_phase(PushPhase.ABORT, spec, {})
            except Exception as abort_exc:  # a dead rank: the engine is marked dead by apply_phase
                errors = [str(abort_exc)]
            if spec.delta and errors and update.state is UpdateState.OPEN:
                update.tear(f"a rejected delta of version {spec.version} was not undone: {errors}")
            raise
        finally:
            with self._lock.control():
                if update.state is not UpdateState.OPEN:  # cached KV came from old weights
                    self._blocks.reset_prefix_cache()
                plan.close(update)
                self._lock.resumed.notify_all()

    def apply_phase(self, phase: PushPhase, spec: UpdateSpec, records_by_rank: dict[int, list]):
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
        self.base = None
        executor = self._stepper.executor
        return self._stepper.guarded(lambda: executor.weight_memory(msg))

    def reloaded(self) -> None:
        """The checkpoint was read again: version 0 serves."""
        self.version = 0
        self.base = None
        self._lifecycle.push_landed()


class _BaseWeights:
    """A push of the model's weights: bytes written and then a failure leave the engine torn
    (refusing requests until a complete push lands); landing sets the engine's version."""

    tears = True
    lost = "requests are refused until a complete push lands"

    def __init__(self, window: PushWindow, lifecycle: EngineLifecycle, spec: UpdateSpec):
        self._window, self._lifecycle, self._spec = window, lifecycle, spec
        self.subject = f"update to version {spec.version}"

    def kept(self, serving: int) -> str:
        return f"version {serving} keeps serving"

    def open(self) -> None:
        pass

    def broke(self, update: WeightUpdate, exc: BaseException) -> None:
        if update.state is UpdateState.EXPOSED:  # broke after writing live weights
            update.tear(f"the push of version {self._spec.version} broke: {exc}")

    def close(self, update: WeightUpdate) -> None:
        self._lifecycle.close_update(update.torn_reason, update.state is UpdateState.LANDED)
        if update.state is UpdateState.LANDED:  # the spec's version (a driver may name it
            self._window.version = update.spec.version  # at commit)
            self._window.base = update.spec.push_id or None
        elif update.state is not UpdateState.OPEN:  # bytes went into the live weights
            self._window.base = None


class _AdapterSlot:
    """A push of one LoRA adapter into its slot: the base weights are untouched, so nothing
    tears the engine; the slot serves nothing while it is written, and what it held before
    comes back if the push failed before writing it."""

    tears = False
    lost = "its slot is empty until a push lands"

    def __init__(self, lora: LoRARegistry, lifecycle: EngineLifecycle, spec: UpdateSpec):
        self._lora, self._lifecycle = lora, lifecycle
        self._adapter = spec.adapter
        self.subject = f"push of LoRA adapter {spec.adapter.name!r} version {spec.version}"

    def kept(self, serving: int) -> str:
        return "the versions loaded before keep serving"

    def open(self) -> None:
        self._lora.begin(self._adapter)  # the slot's adapter leaves: no request pins it

    def broke(self, update: WeightUpdate, exc: BaseException) -> None:
        self._lora.failed(self._adapter, intact=update.state is UpdateState.OPEN)

    def close(self, update: WeightUpdate) -> None:
        self._lifecycle.close_update(None, False)  # the base weights are as they were
        if update.state is UpdateState.LANDED:  # the adapter's version is its own
            self._lora.committed(self._adapter, update.spec.version)
