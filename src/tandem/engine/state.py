"""The engine's lifecycle: one enum, and every transition between its values in one class."""

from __future__ import annotations

from enum import Enum

from tandem.engine.executor import EngineDeadError
from tandem.exchange.receiver import WeightSyncError


class EngineAsleepError(RuntimeError):
    """The engine released its KV cache (`sleep`); `wake` it before generating."""


class WeightsReleasedError(RuntimeError):
    """``sleep(level=2)`` released the weights: push new ones or `reload_weights` first."""


NO_WEIGHTS_REASON = (
    "the engine holds no weights (released by sleep(level=2), or started with "
    "load_format='dummy'); push new weights (WeightSender) or reload "
    "them from the checkpoint (reload_weights) first"
)


class PauseMode(Enum):
    """How `Controls.pause` stops generation (vLLM's ``/pause`` modes)."""

    ABORT = "abort"  # unfinished sequences end now, keeping what they generated
    WAIT = "wait"  # no new sequence is admitted; running ones finish
    KEEP = "keep"  # no step runs; sequences keep their KV blocks until `resume`


PAUSE_MODES = tuple(m.value for m in PauseMode)


class EngineState(Enum):
    RUNNING = "running"  # serves requests
    SLEEPING = "sleeping"  # KV cache released (`sleep`) until `wake`; requests wait
    NO_WEIGHTS = "no_weights"  # awake after sleep(level=2): refused until a push or a reload
    TORN = "torn"  # an in-place push broke mid-write: requests are refused until a push lands
    DEAD = "dead"  # a worker is gone; terminal


class EngineLifecycle:
    """The current `EngineState`, why the engine is in it, and the allowed transitions.

    Whether the KV cache and the weights hold memory are facts apart from the state: an engine
    put to sleep and then torn by a push is TORN with its cache released, and returns to
    SLEEPING (not RUNNING) when a complete push lands; an engine whose weights were released
    (level 2) is SLEEPING until woken, then NO_WEIGHTS until a complete push or a reload.
    A pause (`PauseMode`) and an open push window are facts apart from the state too: they
    stop steps, not requests.
    """

    def __init__(self, weights: bool = True):
        self.state = EngineState.RUNNING if weights else EngineState.NO_WEIGHTS
        self.reason: str | None = None  # for TORN and DEAD
        self.kv_released = False
        self.weights_released = not weights
        self.pause_mode: PauseMode | None = None
        self.updating = False  # a push's window is open: no step runs

    def pause(self, mode: str) -> PauseMode:
        try:
            self.pause_mode = PauseMode(mode)
        except ValueError:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}") from None
        return self.pause_mode

    def resume(self) -> None:
        self.pause_mode = None

    def open_update(self) -> None:
        self.check_alive()
        self.updating = True

    def close_update(self, torn: str | None, landed: bool) -> None:
        """A push's window closes: ``torn`` says why the live weights are half-written."""
        self.updating = False
        if torn is not None:
            self.torn(torn)
        elif landed:
            self.push_landed()

    def check_idle_for(self, what: str) -> None:
        """A call that replaces the weights (``sleep(level=2)``, a reload) waits for no push."""
        if self.updating:
            raise RuntimeError(f"a weight push is in progress: {what} after it")

    def check_runnable(self) -> None:
        """Raise the error that says why no step can run now (nothing when RUNNING)."""
        if self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine is dead: {self.reason}")
        if self.state is EngineState.TORN:
            raise WeightSyncError(
                "weights are incomplete after a failed push; requests are refused until a "
                f"complete push lands: {self.reason}"
            )
        if self.state is EngineState.SLEEPING:
            raise EngineAsleepError("the engine is asleep (KV cache released); call wake() first")
        if self.state is EngineState.NO_WEIGHTS:
            raise WeightsReleasedError(NO_WEIGHTS_REASON)

    def unavailable(self) -> str | None:
        """Why no request can be served (DEAD, TORN, NO_WEIGHTS), or None: sleeping requests
        wait."""
        if self.state is EngineState.DEAD:
            return f"the engine is dead: {self.reason}"
        if self.state is EngineState.TORN:
            return f"weights are incomplete after a failed push: {self.reason}"
        if self.state is EngineState.NO_WEIGHTS:
            return NO_WEIGHTS_REASON
        return None

    def check_alive(self) -> None:
        if self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine is dead: {self.reason}")

    def died(self, reason: str) -> None:
        self.state, self.reason = EngineState.DEAD, reason

    def torn(self, reason: str) -> None:
        if self.state is not EngineState.DEAD:
            self.state, self.reason = EngineState.TORN, reason

    def push_landed(self) -> None:
        """Every parameter was written: a complete push, or a reload from the checkpoint."""
        self.weights_released = False
        if self.state in (EngineState.TORN, EngineState.NO_WEIGHTS):
            self.state, self.reason = self._resting(), None

    def slept(self, weights: bool) -> None:
        self.kv_released = True
        self.weights_released = self.weights_released or weights
        if self.state in (EngineState.RUNNING, EngineState.NO_WEIGHTS):
            self.state = EngineState.SLEEPING

    def woke(self) -> None:
        self.kv_released = False
        if self.state is EngineState.SLEEPING:
            self.state = self._resting()

    def _resting(self) -> EngineState:
        if self.kv_released:
            return EngineState.SLEEPING
        return EngineState.NO_WEIGHTS if self.weights_released else EngineState.RUNNING
