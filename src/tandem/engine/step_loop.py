"""The one thread that steps an engine for callers that hand it sequences and wait for them
(`LLM.generate`, each replica of a fleet): callers never step, so however many threads
generate at once, one loop schedules, runs and processes each step (a server's engine thread
is that loop for a served engine).

The loop sleeps on the engine's ``resumed`` condition while there is nothing to run (no
sequence, a pause, a push window, an engine asleep or torn) and is woken by whatever changes
that (new sequences, resume, a push closing). A caller waits on the same condition until its
sequences are finished, and raises what keeps them from finishing: the engine died, its
weights are torn or released, it sleeps, or a step failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tandem.engine.engine_lock import EngineLock
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineLifecycle, EngineState

HEALTH_CHECK_S = 1.0  # how often an idle or held loop (and a waiting caller) looks again


class StepLoop:
    def __init__(self, step: Callable[[], list[Sequence]], runnable: Callable[[], bool],
                 check_health: Callable[[], None], lock: EngineLock,
                 lifecycle: EngineLifecycle):  # fmt: skip
        self._step = step  # one step; [] when there was nothing to run
        self._runnable = runnable  # whether a step would run now (work, not held, running)
        self._check_health = check_health  # marks the engine dead if a worker is gone
        self._lock = lock
        self._lifecycle = lifecycle
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failure: BaseException | None = None  # the last step's error, for its waiters
        self._failures = 0  # how many steps failed so far

    def wait(self, seqs: list[Sequence], held: Callable[[], bool]) -> None:
        """Until ``seqs`` (queued) are finished, stepped by the loop. Raises the error that
        keeps them from finishing (``held``: whether a pause holds the engine, which is
        waited out, as a push window is)."""
        resumed = self._lock.resumed
        with resumed:
            self._start()
            resumed.notify_all()  # new sequences: the loop steps them
            failures = self._failures
            while not all(seq.finished for seq in seqs):
                if self._failures != failures:
                    raise self._failure
                if not (self._lifecycle.updating or held()):
                    self._lifecycle.check_runnable()  # dead, torn, asleep, no weights
                elif self._lifecycle.state is EngineState.DEAD:
                    self._lifecycle.check_alive()
                resumed.wait(HEALTH_CHECK_S)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-engine-step",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def _run(self) -> None:
        resumed = self._lock.resumed
        while True:
            with resumed:
                while not self._closed and not self._runnable():
                    if self._lifecycle.state is EngineState.DEAD:
                        resumed.notify_all()  # its waiters raise
                        return
                    if not resumed.wait(HEALTH_CHECK_S):
                        self._check_health()  # idle or held: are the workers still there?
                if self._closed:
                    return
            try:
                self._step()
            except BaseException as exc:  # its waiters raise it; the loop goes on
                with resumed:
                    self._failure, self._failures = exc, self._failures + 1
                    resumed.notify_all()
                    resumed.wait(HEALTH_CHECK_S)  # not in a tight loop on a lasting fault

    def close(self) -> None:
        with self._lock.resumed:
            self._closed = True
            self._lock.resumed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * HEALTH_CHECK_S)
