"""The one lock an engine's parts share: a step, or one call from outside the stepping loop
(pause, abort, a push's phase, sleep, new requests), never two at once.

Locks are not fair: a thread stepping in a tight loop would take the lock again before a
waiting control call got it. So a control call announces itself first, and the next step
waits (on a condition, not a sleep) until no control call is waiting. ``resumed`` is the
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
        self._gate = threading.Condition(threading.Lock())

    @contextmanager
    def control(self) -> Iterator[None]:
        """The lock for a call from outside the stepping loop: it goes before the next step."""
        with self._gate:
            self._waiting += 1
        try:
            with self._lock:
                yield
        finally:
            with self._gate:
                self._waiting -= 1
                if not self._waiting:
                    self._gate.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        """The lock for one step, once no control call is waiting for it."""
        with self._gate:
            while self._waiting:
                self._gate.wait()
        with self._lock:
            yield

    def try_acquire(self) -> bool:
        """The lock now if nobody holds it (a health check that must not wait)."""
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()
