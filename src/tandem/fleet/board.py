"""What each replica of a fleet is doing, in one place the front's router and its pushes share:
`ReplicaState` per replica with the reason for it, the newest version the fleet serves or is
rolling out, and which replicas may take new requests (``max_staleness``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)


class ReplicaState(Enum):
    SERVING = "serving"  # takes requests
    UPDATING = "updating"  # its wave of a rolling push: drained or paused, then committed
    QUARANTINED = "quarantined"  # died, hung or failed a push: no requests until healed
    JOINING = "joining"  # pulling the fleet's weights from a live peer (healed, or added)


class NoReplicaError(RuntimeError):
    """No replica of the fleet can take requests (each one's reason is named)."""


@dataclass(slots=True)
class ReplicaStatus:
    state: ReplicaState = ReplicaState.SERVING
    reason: str | None = None  # why it is quarantined


class ReplicaBoard:
    """``versions()``: each replica's committed version (replica order). ``max_staleness``:
    how many versions behind the newest a replica may be and still take new requests (None:
    any)."""

    def __init__(
        self, replicas: int, versions: Callable[[], list[int]], max_staleness: int | None = None
    ):
        self.versions = versions
        self.max_staleness = max_staleness
        self.changed = threading.Condition()
        self._status = [ReplicaStatus() for _ in range(replicas)]
        self._rolling_to: int | None = None  # a rolling push held everywhere, not yet committed

    def __len__(self) -> int:
        return len(self._status)

    def add(self, state: ReplicaState = ReplicaState.JOINING) -> int:
        with self.changed:
            self._status.append(ReplicaStatus(state))
            self.changed.notify_all()
            return len(self._status) - 1

    def set(self, replica: int, state: ReplicaState, reason: str | None = None) -> None:
        with self.changed:
            self._status[replica] = ReplicaStatus(state, reason)
            self.changed.notify_all()

    def state(self, replica: int) -> ReplicaState:
        return self._status[replica].state

    def reason(self, replica: int) -> str | None:
        return self._status[replica].reason

    def quarantine(self, replica: int, reason: str) -> None:
        log.warning("replica %d quarantined: %s", replica, reason)
        self.set(replica, ReplicaState.QUARANTINED, reason)

    def members(self) -> list[int]:
        """The replicas a push updates: every one not quarantined or joining."""
        return [
            r
            for r, s in enumerate(self._status)
            if s.state in (ReplicaState.SERVING, ReplicaState.UPDATING)
        ]

    def rolling(self, version: int | None) -> None:
        """A rolling push to ``version`` is held by every replica (None: it is over)."""
        with self.changed:
            self._rolling_to = version
            self.changed.notify_all()

    @property
    def rolling_to(self) -> int | None:
        """The version a rolling push is rolling out (held everywhere, committing in waves)."""
        return self._rolling_to

    def newest(self, versions: list[int] | None = None) -> int:
        """The newest version any replica serving serves, or the one being rolled out."""
        versions = self.versions() if versions is None else versions
        serving = [v for r, v in enumerate(versions) if self.state(r) is ReplicaState.SERVING]
        return max([*serving, self._rolling_to or 0, 0])

    def allowed(self) -> list[int]:
        """The replicas that may take a new request now: serving, and within
        ``max_staleness`` of the newest version."""
        versions = self.versions()
        serving = [r for r in range(len(versions)) if self.state(r) is ReplicaState.SERVING]
        if self.max_staleness is None:
            return serving
        floor = self.newest(versions) - self.max_staleness
        return [r for r in serving if versions[r] >= floor]

    def wait_allowed(self, timeout_s: float) -> list[int]:
        """`allowed`, waiting (up to ``timeout_s``) while none is but some replica is
        updating or joining; NoReplicaError when none can serve."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not (allowed := self.allowed()):
                coming = [s for s in self._status if s.state is not ReplicaState.QUARANTINED]
                left = deadline - time.monotonic()
                if not coming or left <= 0:
                    raise NoReplicaError(self.why_none())
                self.changed.wait(min(left, 0.05))
            return allowed

    def why_none(self) -> str:
        parts = [
            f"replica {r}: {s.state.value}" + (f" ({s.reason})" if s.reason else "")
            for r, s in enumerate(self._status)
        ]
        return "no replica of the fleet can take requests: " + "; ".join(parts)

    def snapshot(self) -> list[ReplicaStatus]:
        with self.changed:
            return [ReplicaStatus(s.state, s.reason) for s in self._status]
