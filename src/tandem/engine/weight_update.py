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

from tandem.exchange.items import Record
from tandem.exchange.receiver import WeightSyncError
from tandem.exchange.settings import PushPhase, UpdateSpec


class WeightUpdate:
    """Drives the phases of one push on every engine rank (``apply_phase``: the engine's
    `PushWindow.apply_phase`); what a failure means depends on whether the live weights were
    already touched. The engine's `tandem.exchange.UpdateWindow`."""

    def __init__(self, apply_phase: Callable, spec: UpdateSpec, serving: int):
        self._apply_phase = apply_phase
        self.spec = spec
        self.serving = serving  # the version serving when the push began (for messages)
        self.exposed = False  # bytes may have gone into the live parameters
        self.torn: str | None = None  # set when the live weights were left half-written
        self.landed = False
        self._opened = time.perf_counter()
        self._phase_bytes: dict[PushPhase, int] = {}
        self._seconds = 0.0

    def expose(self) -> None:
        """From now on the push writes into the live parameters (in_place delivery begins)."""
        self.exposed = True

    def run(self, phase: PushPhase, records_by_rank: dict[int, list[Record]]) -> int:
        """Run ``phase`` on every rank; the bytes they moved. Raises WeightSyncError, saying
        whether the old version still serves, on any rank's error."""
        if phase is PushPhase.COMMIT and not self.spec.settings.in_place:
            self.exposed = True  # a staged commit writes the live parameters
        errors, nbytes = self._apply_phase(phase, self.spec, records_by_rank)
        if errors:
            self.fail("; ".join(errors), phase.value)
        if phase is PushPhase.COMMIT:
            self.landed = True
        self._phase_bytes[phase] = nbytes
        self._seconds = time.perf_counter() - self._opened
        return nbytes

    def ingress(self) -> dict[int, tuple[int, float]]:
        got = self._phase_bytes
        arrived = got.get(PushPhase.RECEIVE) or got.get(PushPhase.HOLD) or got.get(
            PushPhase.COMMIT, 0)  # fmt: skip
        return {0: (arrived, self._seconds)}

    def failures(self) -> dict[int, str]:
        return {}  # a failure raises: one engine commits all of a push or none

    def fail(self, detail: str, phase: str = "delivery") -> None:
        version = self.spec.version
        if self.spec.adapter is not None:  # the base weights are untouched
            what = ("its slot is empty until a push lands" if self.exposed
                    else "the versions loaded before keep serving")  # fmt: skip
            raise WeightSyncError(f"push of LoRA adapter {self.spec.adapter.name!r} version "
                                  f"{version} failed in {phase}; {what}: {detail}")  # fmt: skip
        if self.exposed:  # the live parameters already hold (some of) the new bytes
            self.torn = f"{phase} of version {version} failed: {detail}"
            raise WeightSyncError(
                f"update to version {version} failed in {phase}; requests are refused until a "
                f"complete push lands: {detail}"
            )
        raise WeightSyncError(
            f"update to version {version} rejected in {phase}; version {self.serving} keeps "
            f"serving: {detail}"
        )
