"""A rolling push after its trainers were answered: the engine's side reports the rollout to
them (`RolloutReport`: a `RolloutProgress` every `HEARTBEAT_S`, then `RolloutDone`), and each
trainer rank's `PushStats.wait` waits on it (`Rollout`) for `RolloutResult`: which replicas
committed, which were lost and why.

The trainer's connection stays open for the rollout; the engine's waves are bounded by their
own deadlines, and a trainer that hears nothing for `SILENCE_S` calls the engine lost.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tandem.exchange.protocol import PUSH, ReplicaPush, RolloutDone, RolloutProgress
from tandem.exchange.receiver import WeightSyncError
from tandem.wire import PeerGone, recv_frame, send_frame

HEARTBEAT_S = 2.0
SILENCE_S = 30.0  # no word from the engine this long: the rollout's report is lost


@dataclass(frozen=True, slots=True)
class RolloutResult:
    """How a push came out on every replica it reached (a single engine: replica 0)."""

    version: int
    replicas: tuple[ReplicaPush, ...]

    @property
    def committed(self) -> list[int]:
        """The replicas serving the version."""
        return [r.replica for r in self.replicas if r.state == "committed"]

    @property
    def failed(self) -> dict[int, str]:
        """The replicas that left the push (quarantined, then healed from a peer) and why."""
        return {r.replica: r.error or "" for r in self.replicas if r.state == "failed"}


class RolloutReport:
    """The engine's side: once started, ``progress()`` (the replicas so far) every
    `HEARTBEAT_S` to every trainer rank's socket until `finish` sends the end and closes
    them. A trainer gone meanwhile is skipped: the rollout depends on no one listening."""

    def __init__(
        self, socks: list[socket.socket], version: int, progress: Callable[[], list[ReplicaPush]]
    ):
        self._socks, self._version, self._progress = socks, version, progress
        self._lock = threading.Lock()
        self._over = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="tandem-rollout-report", daemon=True
        )

    def start(self) -> None:
        """Once the trainers were answered: the heartbeats begin."""
        self._thread.start()

    def _beat(self) -> None:
        while not self._over.wait(HEARTBEAT_S):
            self._send(RolloutProgress(self._version, self._progress()))

    def _send(self, message) -> None:
        with self._lock:
            for sock in self._socks:
                try:
                    send_frame(sock, PUSH.encode(message))
                except OSError:
                    pass

    def finish(self, replicas: list[ReplicaPush], error: str | None) -> None:
        self._over.set()
        if self._thread.is_alive():
            self._thread.join(HEARTBEAT_S + SILENCE_S)
        self._send(RolloutDone(self._version, replicas, error))
        with self._lock:
            for sock in self._socks:
                sock.close()


class Rollout:
    """A trainer rank's view of a rolling push it was answered for: the engine's report,
    read on a thread of its own from the push's connection (now its own)."""

    def __init__(self, sock: socket.socket, version: int, replicas: tuple[ReplicaPush, ...]):
        self.version = version
        self._sock = sock
        self._latest = replicas
        self._result: RolloutResult | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._read, name=f"tandem-rollout-{version}", daemon=True).start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def replicas(self) -> tuple[ReplicaPush, ...]:
        """Each replica as last reported (``rolling`` until its wave committed)."""
        return self._result.replicas if self._result is not None else self._latest

    def _read(self) -> None:
        try:
            self._sock.settimeout(SILENCE_S)
            while True:
                message = PUSH.decode(recv_frame(self._sock))
                if isinstance(message, RolloutProgress):
                    self._latest = tuple(message.replicas) or self._latest
                    continue
                if not isinstance(message, RolloutDone):
                    raise WeightSyncError(
                        f"unexpected {type(message).__name__} while "
                        f"version {self.version} rolled out"
                    )
                if message.error is not None:
                    raise WeightSyncError(message.error)
                self._result = RolloutResult(message.version, tuple(message.replicas))
                return
        except TimeoutError:
            self._error = WeightSyncError(
                f"no word from the engine for {SILENCE_S:g} s while version {self.version} "
                "rolled out: the engine is lost (its replicas may still commit it)"
            )
        except (PeerGone, OSError, ValueError) as exc:
            self._error = WeightSyncError(
                f"lost the engine while version {self.version} rolled out ({exc})"
            )
        except WeightSyncError as exc:
            self._error = exc
        finally:
            self._sock.close()
            self._done.set()

    def wait(self, timeout: float | None = None) -> RolloutResult:
        """Until the rollout ended: how each replica came out. `TimeoutError` past
        ``timeout`` seconds (the rollout goes on); `WeightSyncError` if it committed nowhere
        or the engine was lost."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"version {self.version} was still rolling out after "
                f"{timeout:g} s: {_states(self.replicas)}"
            )
        if self._result is None:
            raise self._error or WeightSyncError(f"version {self.version}: no rollout report")
        return self._result


def _states(replicas: tuple[ReplicaPush, ...]) -> str:
    return ", ".join(f"replica {r.replica} {r.state}" for r in replicas) or "no replica"
