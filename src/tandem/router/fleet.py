"""The replicas behind `tandem router` as one fleet: one push target (a `FleetTarget` of
`RemoteReplica`s, so a push through the router updates them all, in waves if asked), their
states (`ReplicaBoard`: the router routes only to replicas serving), and what keeps the fleet
whole. A replica quarantined by a push, or back from being down at an older version than the
others serve (a restarted server reads its checkpoint), heals by a push from a live peer
(``POST {peer}/admin/weights/push_to``: the peer's ranks in the trainer's role, planned and
CRC-checked like any push) and only then takes requests again; `RouterFleet.add` grows a
running fleet the same way. Blocking calls: run them off the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit

import httpx

from tandem.fleet.board import NoReplicaError, ReplicaBoard, ReplicaState
from tandem.fleet.remote import RemoteReplica
from tandem.fleet.target import FleetTarget
from tandem.router.replicas import ReplicaPool

log = logging.getLogger(__name__)


class RouterFleet:
    def __init__(self, pool: ReplicaPool, admin_key: str | None, exchange_host: str,
                 push_phase_timeout_s: float = 300.0):  # fmt: skip
        if not push_phase_timeout_s > 0:
            raise ValueError(f"the push phase timeout must be > 0 s, got {push_phase_timeout_s}")
        self.pool = pool
        self.admin_key = admin_key
        # as a fleet in one process: the transport's waits end first (the dist group, trainers
        # staging), then a replica still silent in a phase is left behind (quarantined)
        self.timeout_s = push_phase_timeout_s + 2 * min(30.0, push_phase_timeout_s)
        self.board = ReplicaBoard(len(pool.replicas), self._versions)
        self.replicas = [RemoteReplica(r.url, admin_key or "", self.timeout_s)
                         for r in pool.replicas]  # fmt: skip
        self.target = FleetTarget(self.replicas, exchange_host, self.board, self._drain,
                                  phase_timeout_s=self.timeout_s,
                                  stage_timeout_s=push_phase_timeout_s)  # fmt: skip
        self.target.update_listeners.append(self._pushed)
        self._healing: set[int] = set()
        self._lock = threading.Lock()  # the replica lists, grown by `add`
        pool.routable = lambda i: self.board.state(i) is ReplicaState.SERVING

    def _versions(self) -> list[int]:
        return [r.health.get("weight_version") or 0 for r in self.pool.replicas]

    def _pushed(self, version: int, seconds: float, error: str | None) -> None:
        """After every push through the router, before its trainers are answered (a rolling
        push: once its last wave committed): every replica's health again, so `state` and
        the board read the versions the push left, not the last poll's."""
        for i in range(len(self.pool.replicas)):
            self.pool.check_one_blocking(i)

    def _drain(self, replica: int, timeout_s: float) -> None:
        """A rolling wave's ``wait``: the requests the router sent the replica finish."""
        deadline = time.monotonic() + timeout_s
        while self.pool.router.loads[replica] > 0 and time.monotonic() < deadline:
            time.sleep(0.01)

    def state(self) -> list[dict]:
        loads = list(self.pool.router.loads)
        out = []
        for i, status in enumerate(self.board.snapshot()):
            entry = {"replica": i, "url": self.pool.replicas[i].url, "state": status.state.value,
                     "version": self._versions()[i], "load": loads[i]}  # fmt: skip
            if status.reason and status.state is ReplicaState.QUARANTINED:
                entry["reason"] = status.reason
            out.append(entry)
        return out

    def check(self) -> None:
        """After a round of health checks: quarantine a replica back at an older version than
        the fleet serves, and heal the quarantined ones that answer again. Nothing while a
        push runs (a rolling push holds versions apart on purpose)."""
        if not self.target.lock.acquire(blocking=False):
            return
        try:
            versions = self._versions()
            live = [i for i, r in enumerate(self.pool.replicas)
                    if r.healthy and self.board.state(i) is ReplicaState.SERVING]  # fmt: skip
            newest = max((versions[i] for i in live), default=None)
            for i in live:
                if newest is not None and versions[i] < newest:
                    self.board.quarantine(i, f"serves version {versions[i]}, the fleet "
                                             f"{newest} (restarted?)")  # fmt: skip
        finally:
            self.target.lock.release()
        for i, replica in enumerate(self.pool.replicas):
            if self.board.state(i) is ReplicaState.QUARANTINED and replica.healthy:
                self.heal_later(i)

    def heal_later(self, replica: int) -> None:
        with self._lock:
            if replica in self._healing:
                return
            self._healing.add(replica)

        def run() -> None:
            try:
                self.heal(replica)
            except Exception as exc:  # stays quarantined, saying why
                log.warning("replica %d could not be healed: %s", replica, exc)
            finally:
                with self._lock:
                    self._healing.discard(replica)

        threading.Thread(target=run, name=f"tandem-router-heal-{replica}", daemon=True).start()

    def heal(self, replica: int) -> dict:
        """A live peer pushes its weights into ``replica``; then it serves. Raises if none
        can (it stays quarantined)."""
        reason = self.board.reason(replica)
        self.board.set(replica, ReplicaState.JOINING, reason)  # why it heals
        try:
            with self.target.lock:  # no push writes the peer's weights while it sends them
                versions = self._versions()
                peers = [i for i, r in enumerate(self.pool.replicas) if i != replica
                         and r.healthy and self.board.state(i) is ReplicaState.SERVING]  # fmt: skip
                if not peers:
                    raise NoReplicaError(f"no live peer to pull from: {self.board.why_none()}")
                peer = max(peers, key=lambda i: (versions[i], -i))
                done = self._push(self.pool.replicas[peer].url, self.pool.replicas[replica].url)
            self.board.set(replica, ReplicaState.SERVING)
        except Exception as exc:
            self.board.quarantine(replica, f"{reason}; healing failed: {exc}")
            raise
        self.pool.replicas[replica].health["weight_version"] = done["version"]
        log.info("replica %d serves version %s, pulled from replica %d", replica,
                 done["version"], peer)  # fmt: skip
        return {"replica": replica, "peer": peer, **done}

    def add(self, url: str) -> dict:
        """Grow the fleet: the `tandem serve` at ``url`` (same model and admin key) joins,
        takes the fleet's weights from a live peer, then takes requests."""
        url = url.rstrip("/")
        with self._lock:
            if url in [r.url for r in self.pool.replicas]:
                raise ValueError(f"{url} is already a replica")
            replica = self.board.add(ReplicaState.JOINING)
            self.replicas.append(RemoteReplica(url, self.admin_key or "", self.timeout_s))
            if self.pool.add(url) != replica:
                raise RuntimeError("replicas were added at the same time")
        self.pool.check_one_blocking(replica)
        if not self.pool.replicas[replica].healthy:
            self.board.quarantine(replica, self.pool.replicas[replica].reason or "unhealthy")
            raise ValueError(f"{url} is not healthy: {self.pool.replicas[replica].reason}")
        return self.heal(replica)

    def _push(self, peer_url: str, target_url: str) -> dict:
        same_host = urlsplit(peer_url).hostname == urlsplit(target_url).hostname
        with httpx.Client(timeout=self.timeout_s) as client:
            r = client.post(f"{peer_url}/admin/weights/push_to",
                            json={"url": target_url, "transport": "shm" if same_host else "dist"},
                            headers={"authorization": f"Bearer {self.admin_key}"})  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"{peer_url} could not push into {target_url}: {r.status_code} "
                               f"{r.text[:500]}")  # fmt: skip
        return r.json()

    def close(self) -> None:
        self.target.close()
        for replica in self.replicas:
            replica.close()
