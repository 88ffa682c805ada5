"""Python's cyclic garbage collector held off while a push runs, on both ends.

A full collection walks every object a process holds: in `tandem bench sync` one took 260 ms
in a trainer process (a model and its framework's objects) and 150-240 ms in the engine's
process, each landing in the middle of a push now and then, while the engine waited with its
weights paused or half-written. `Held` defers automatic collection until the push no longer
holds anyone up (it then runs as usual); holds may nest or overlap across threads (a trainer
pushing into an engine in its own process): the collector comes back as it was once the last
one is released.
"""

from __future__ import annotations

import functools
import gc
import threading

_lock = threading.Lock()
_depth = 0  # holds not yet released
_was_enabled = False  # whether automatic collection ran before the first of them


class Held:
    """A hold on automatic collection, from entering the ``with`` until `release` or the
    ``with``'s end, whichever comes first."""

    def __init__(self):
        self._holding = False

    def __enter__(self) -> Held:
        global _depth, _was_enabled
        with _lock:
            if not self._holding:
                if _depth == 0:
                    _was_enabled = gc.isenabled()
                    gc.disable()
                _depth += 1
                self._holding = True
        return self

    def release(self) -> None:
        """Let go of this hold (again: nothing)."""
        global _depth
        with _lock:
            if not self._holding:
                return
            self._holding = False
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()

    def __exit__(self, *exc) -> None:
        self.release()


def held(method):
    """``method`` with automatic garbage collection held off while it runs."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        with Held():
            return method(*args, **kwargs)

    return run
