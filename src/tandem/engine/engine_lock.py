"""The one lock an engine's parts share: a step, or one call from outside the stepping loop
(pause, abort, a push's phase, sleep, new requests), never two at once.

Locks are not fair: a thread stepping in a tight loop would take the lock again before a
waiting control call got it. So a control call announces itself first, and the next step
waits (on a condition, not a sleep) until no control call is waiting. The other way round
too: once the control calls waiting before it are done, a waiting step has its turn before
the next control call (a thread scoring or embedding in a tight loop would otherwise hold
generation off for good); a control call made inside the lock (nested) never waits for it.
``resumed`` is the
condition a step waits on while a pause or a push window holds it, notified whenever what it
waits for may have changed (a pause ended, a push closed, a sequence finished or aborted).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class EngineLock:
    def __init__(self):
        self._lock = threading.RLock()
        self.resumed = threading.Condition(self._lock)
        self._waiting = 0  # control calls announced and not yet done
        self._steps_waiting = 0  # step calls waiting for the lock
        self._step_owed = False  # control calls ran while a step waited: a step goes next
        self._gate = threading.Condition(threading.Lock())
        self._inside = threading.local()  # this thread's depth inside the lock

    @contextmanager
    def control(self) -> Iterator[None]:
        """The lock for a call from outside the stepping loop: it goes before the next step
        (after the one step owed a turn, if any)."""
        with self._gate:
            while self._step_owed and self._steps_waiting and not self._depth():
                self._gate.wait()
            self._waiting += 1
        try:
            with self._held():
                yield
        finally:
            with self._gate:
                self._waiting -= 1
                if not self._waiting:
                    self._step_owed = self._steps_waiting > 0
                    self._gate.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        """The lock for one step, once no control call is waiting for it (or its turn came)."""
        with self._gate:
            self._steps_waiting += 1
        turn = False
        try:
            with self._gate:
                while self._waiting and not self._step_owed:
                    self._gate.wait()
            with self._held():
                with self._gate:
                    self._steps_waiting -= 1
                    self._step_owed, turn = False, True
                    self._gate.notify_all()
                yield
        finally:
            if not turn:  # interrupted while waiting
                with self._gate:
                    self._steps_waiting -= 1
                    self._step_owed = self._step_owed and self._steps_waiting > 0
                    self._gate.notify_all()

    @contextmanager
    def _held(self) -> Iterator[None]:
        with self._lock:
            self._enter()
            try:
                yield
            finally:
                self._inside.depth -= 1

    def _enter(self) -> None:
        self._inside.depth = self._depth() + 1

    def _depth(self) -> int:
        return getattr(self._inside, "depth", 0)

    def try_acquire(self) -> bool:
        """The lock now if nobody holds it (a health check that must not wait)."""
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()
