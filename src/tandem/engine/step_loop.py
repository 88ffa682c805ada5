"""Whose turn it is to step an engine, for callers that hand it sequences and wait for them
(`LLM.generate`, each replica of a fleet): one thread at a time steps. The first caller that
finds nobody stepping takes the turn and steps for everyone (each step runs every queued
sequence, other callers' too) until its own sequences are finished or nothing can run; then
the turn passes to a caller still waiting. The others wait on the engine's ``resumed``
condition, woken when a step finishes sequences, when the turn is free again, and by whatever
lets a step run (new sequences, resume, a push closing).

The stepper is a caller's own thread, not a thread of the engine's: on CPU a step's parallel
regions then run on the thread pool of the thread that loaded the model (OpenMP keeps one
pool per thread that starts parallel work; a second pool on the same cores cost the bench
17-27% in context switches). A server's engine thread is the one stepper of a served engine.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.engine_lock import EngineLock
from tandem.engine.sequence import Sequence
from tandem.engine.state import EngineLifecycle, EngineState

HEALTH_CHECK_S = 1.0  # how often a held or waiting step, or caller, checks the workers


class StepLoop:
    def __init__(
        self,
        step: Callable[[], list[Sequence]],
        runnable: Callable[[], bool],
        check_health: Callable[[], None],
        lock: EngineLock,
        lifecycle: EngineLifecycle,
    ):
        self._step = step  # one step; [] when there was nothing to run
        self._runnable = runnable  # whether a step would run now (work, not held, running)
        self._check_health = check_health  # marks the engine dead if a worker is gone
        self._lock = lock
        self._lifecycle = lifecycle
        self._stepping = False  # a caller has the turn

    def wait(self, seqs: list[Sequence], held: Callable[[], bool]) -> None:
        """Until ``seqs`` (queued) are finished: stepping while this caller has the turn,
        else waiting for the caller who has it. Raises what keeps them from finishing: the
        engine died, its weights are torn or released, it sleeps (a pause or a push window,
        ``held`` or open, is waited out), or a step this caller ran failed."""
        resumed = self._lock.resumed
        while True:
            with resumed:
                while True:
                    if all(seq.finished for seq in seqs):
                        return
                    if not (self._lifecycle.updating or held()):
                        self._lifecycle.check_runnable()  # dead, torn, asleep, no weights
                    elif self._lifecycle.state is EngineState.DEAD:
                        self._lifecycle.check_alive()
                    if not self._stepping and self._runnable():
                        self._stepping = True  # this caller's turn
                        break
                    if not resumed.wait(HEALTH_CHECK_S) and not self._stepping:
                        self._check_health()  # idle or held: are the workers still there?
            try:
                while not all(seq.finished for seq in seqs) and self._runnable():
                    self._step()
            finally:
                with resumed:
                    self._stepping = False
                    resumed.notify_all()  # the turn is free: a waiting caller may take it
