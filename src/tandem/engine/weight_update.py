"""One weight push applied across the engine's ranks: receive (dist), verify, commit.

Every rank finishes a phase before any rank starts the next, so a rejected push (bad checksum,
unknown tensor, wrong dtype) changes nothing — unless bytes were already written into the live
parameters (``in_place``: a dist receive, or trainers writing over shm), in which case the
weights are *torn* and the engine must refuse requests until a complete push lands.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.exchange.receiver import WeightSyncError

# (phase, records by rank) -> the ranks' errors
RunPhase = Callable[[str, dict[int, list]], list[str]]


class WeightUpdate:
    def __init__(self, update: dict, run_phase: RunPhase):
        self.update = update
        self.run_phase = run_phase
        self.in_place = update.get("mode") == "in_place"
        self.torn: str | None = None  # set when the live weights were left half-written

    def __call__(self, records_by_rank: dict[int, list], checksums, serving: int) -> None:
        """Apply the push or raise WeightSyncError (``self.torn`` says whether it tore).
        ``checksums()``, if given, is called after the receive phase and returns the records
        with the senders' CRC32s; ``serving`` is the version serving now (for messages)."""
        version = self.update["version"]
        if self.update["transport"] == "dist":
            errors = self.run_phase("receive", records_by_rank)
            if errors:
                self._fail(errors, f"receiving version {version} failed", serving)
        if checksums is not None:
            try:
                records_by_rank = checksums()
            except Exception as exc:
                if self.in_place:  # written but never verified: do not serve it as any version
                    self.torn = f"the push broke after an in-place receive ({exc})"
                raise
        errors = self.run_phase("verify", records_by_rank)
        if errors:
            self._fail(errors, f"update to version {version} rejected", serving)
        if self.update["transport"] == "shm" and self.in_place:
            return  # nothing to commit: the trainers wrote into the parameters themselves
        errors = self.run_phase("commit", records_by_rank)
        if errors:
            self.torn = "; ".join(errors)
            raise WeightSyncError(
                "update failed while writing; requests are refused until a complete push "
                "lands: " + self.torn
            )

    def _fail(self, errors: list[str], what: str, serving: int) -> None:
        detail = "; ".join(errors)
        if self.in_place:  # the live parameters already hold (some of) the new bytes
            self.torn = detail
            raise WeightSyncError(
                f"{what}; requests are refused until a complete push lands: {detail}"
            )
        raise WeightSyncError(f"{what}; version {serving} keeps serving: {detail}")
