"""One weight push as the engine sees it: a window in which the engine takes no step, and the
phases its ranks run in it (`tandem.exchange.receiver`: receive, verify, commit).

The exchange server (`tandem.exchange.server`) opens the window and drives it; everything it
does on sockets happens outside the engine lock (the engine is paused, not locked: stats and
new requests go on). Every rank finishes a phase before any rank starts the next, so a rejected
push changes nothing — unless bytes went into the live parameters (``in_place``, or a staged
commit that went wrong), in which case the weights are *torn* and the engine refuses requests
until a complete push lands.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import Protocol

from tandem.exchange.items import Record
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import PushPhase, UpdateSpec


class UpdatePlan(Protocol):
    """What one kind of push writes (the base weights, or one LoRA adapter's slot) and what
    its outcomes mean there (`tandem.engine.push_window`)."""

    subject: str  # "update to version 3", "push of LoRA adapter 'a' version 2"
    lost: str  # what a failure after bytes reached the live weights leaves
    tears: bool  # whether such a failure leaves the engine refusing requests

    def kept(self, serving: int) -> str:
        """What keeps serving when the push is rejected before touching anything."""


class UpdateState(Enum):
    """Where one push stands on the engine's weights."""

    OPEN = "open"  # phases may run; the live weights are untouched
    EXPOSED = "exposed"  # bytes may be landing in the live weights (in place, or a commit)
    LANDED = "landed"  # committed: every rank holds the pushed version
    TORN = "torn"  # broke after bytes reached the live weights: they are half-written


class WeightUpdate:
    """Drives the phases of one push on every engine rank (``apply_phase``: the engine's
    `PushWindow.apply_phase`); what a failure means depends on whether the live weights were
    already touched (``state``). The engine's `tandem.exchange.UpdateWindow`."""

    def __init__(self, apply_phase: Callable, spec: UpdateSpec, serving: int, plan: UpdatePlan):
        self._apply_phase = apply_phase
        self.plan = plan
        self.spec = spec
        self.serving = serving  # the version serving when the push began (for messages)
        self.state = UpdateState.OPEN
        self.torn_reason: str | None = None  # why the live weights were left half-written
        self._opened = time.perf_counter()
        self._phase_bytes: dict[PushPhase, int] = {}
        self._seconds = 0.0

    def expose(self) -> None:
        """From now on the push writes into the live parameters (in_place delivery begins)."""
        if self.state is UpdateState.OPEN:
            self.state = UpdateState.EXPOSED

    def tear(self, reason: str) -> None:
        """The live weights were left half-written (``reason`` says how)."""
        self.state, self.torn_reason = UpdateState.TORN, reason

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        """Run ``phase`` on every rank; the bytes they moved. Raises WeightSyncError, saying
        whether the old version still serves, on any rank's error."""
        if phase is PushPhase.COMMIT and not self.spec.settings.in_place:
            self.expose()  # a staged commit writes the live parameters
        errors, nbytes = self._apply_phase(phase, self.spec, records_by_rank)
        if errors:
            self.fail("; ".join(errors), phase.value)
        if phase is PushPhase.COMMIT:
            self.state = UpdateState.LANDED
        self._phase_bytes[phase] = nbytes
        self._seconds = time.perf_counter() - self._opened
        return nbytes

    def ingress(self) -> dict[int, tuple[int, float]]:
        got = self._phase_bytes
        arrived = (
            got.get(PushPhase.RECEIVE) or got.get(PushPhase.HOLD) or got.get(PushPhase.COMMIT, 0)
        )
        return {0: (arrived, self._seconds)}

    def failures(self) -> dict[int, str]:
        return {}  # a failure raises: one engine commits all of a push or none

    def fail(self, detail: str, phase: str = "delivery") -> None:
        """Raise the push's `WeightSyncError`: rejected (what served before still does), or
        failed after bytes reached what it writes (the plan says what that leaves)."""
        plan, version = self.plan, self.spec.version
        if self.state is UpdateState.OPEN:
            raise WeightSyncError(
                f"{plan.subject} rejected in {phase}; {plan.kept(self.serving)}: {detail}"
            )
        if plan.tears:
            self.tear(f"{phase} of version {version} failed: {detail}")
        raise WeightSyncError(f"{plan.subject} failed in {phase}; {plan.lost}: {detail}")
