"""Python's cyclic garbage collector held off while a push runs, on both ends.

A full collection walks every object a process holds: in `tandem bench sync` one took 260 ms
in a trainer process (a model and its framework's objects) and 150-240 ms in the engine's
process, each landing in the middle of a push now and then, while the engine waited with its
weights paused or half-written. `held` defers automatic collection until the push is over (it
then runs as usual); calls may nest or overlap across threads (a trainer pushing into an
engine in its own process): the collector comes back as it was once the last one ends.
"""

from __future__ import annotations

import functools
import gc
import threading

_lock = threading.Lock()
_depth = 0  # calls running under `held`
_was_enabled = False  # whether automatic collection ran before the first of them


def held(method):
    """``method`` with automatic garbage collection held off while it runs."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        global _depth, _was_enabled
        with _lock:
            if _depth == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _depth += 1
        try:
            return method(*args, **kwargs)
        finally:
            with _lock:
                _depth -= 1
                if _depth == 0 and _was_enabled:
                    gc.enable()

    return run
