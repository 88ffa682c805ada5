"""The engine's lifecycle: one enum, and every transition between its values in one class."""

from __future__ import annotations

from enum import Enum

from tandem.engine.executor import EngineDeadError
from tandem.exchange.receiver import WeightSyncError


class EngineAsleepError(RuntimeError):
    """The engine released its KV cache (`sleep`); `wake` it before generating."""


class EngineState(Enum):
    RUNNING = "running"  # serves requests
    SLEEPING = "sleeping"  # KV cache released (`sleep`) until `wake`; weights stay
    TORN = "torn"  # an in-place push broke mid-write: requests are refused until a push lands
    DEAD = "dead"  # a worker is gone; terminal


class EngineLifecycle:
    """The current `EngineState`, why the engine is in it, and the allowed transitions.

    Whether the KV cache is allocated is a fact apart from the state: an engine put to sleep
    and then torn by a push is TORN with its cache released, and returns to SLEEPING (not
    RUNNING) when a complete push lands.
    """

    def __init__(self):
        self.state = EngineState.RUNNING
        self.reason: str | None = None  # for TORN and DEAD
        self.kv_released = False

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

    def unavailable(self) -> str | None:
        """Why no request can be served (DEAD or TORN), or None: sleeping requests wait."""
        if self.state is EngineState.DEAD:
            return f"the engine is dead: {self.reason}"
        if self.state is EngineState.TORN:
            return f"weights are incomplete after a failed push: {self.reason}"
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
        if self.state is EngineState.TORN:
            self.state, self.reason = self._resting(), None

    def slept(self) -> None:
        self.kv_released = True
        if self.state is EngineState.RUNNING:
            self.state = EngineState.SLEEPING

    def woke(self) -> None:
        self.kv_released = False
        if self.state is EngineState.SLEEPING:
            self.state = EngineState.RUNNING

    def _resting(self) -> EngineState:
        return EngineState.SLEEPING if self.kv_released else EngineState.RUNNING
