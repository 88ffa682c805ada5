"""The fleet fault matrix over `tandem router` and three `tandem serve` servers (cells (a),
(d), (e), (g) of test_fleet_faults.py), under HTTP load through the router the whole
time: a replica's server SIGKILLed while it receives a push, drains for its rolling wave,
commits its wave, or is being healed by a peer. As a supervisor would, the test starts the
dead server again on its port; the router holds it out (quarantined), heals it from a live
peer at the newest version, and only then routes to it.

Each cell ends with: every load call answered 200 within its deadline (the router retries a
request whose replica died before answering on another one; its documented 503,
``no_replica``, cannot happen with two replicas alive, so none is allowed), no answer sampled
from two versions (each wave drains first) nor from a version older than the fleet served
when the call was sent, every replica serving the pushed version, and each server
greedy-decoding what transformers does on the trainer's weights (so one still holding its
checkpoint's weights fails)."""

import os
import signal
import textwrap
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import pytest
import torch
import transformers

from support.routers import Router, decodes
from support.serving import ADMIN_KEY, Server, descendants
from support.waits import until
from tandem.exchange import WeightSender, WeightSyncError

DEADLINE_S = 60.0  # every wait below ends well within it, or the test fails naming it
CALL_DEADLINE_S = 30.0  # a load call unanswered this long has hung

# SIGKILL of the server process that reaches ``TANDEM_TEST_KILL_PHASE`` of a push: of version 1
# in the server whose pid the file ``TANDEM_TEST_KILL_VICTIM`` holds, or (``..._IN`` "heal")
# of a peer's push into it (a heal: the only in-place pushes here). Once: the mark file.
KILL_IN_PHASE = """
    import os, signal
    from tandem.exchange import receiver

    honest = receiver.RankReceiver.handle

    def chosen(spec):
        if os.environ["TANDEM_TEST_KILL_IN"] == "heal":
            return spec.settings.in_place
        try:
            with open(os.environ["TANDEM_TEST_KILL_VICTIM"]) as f:
                victim = int(f.read())
        except (OSError, ValueError):
            return False
        return spec.version == 1 and victim == os.getpid()

    def handle(self, phase, spec, records):
        if phase.value == os.environ["TANDEM_TEST_KILL_PHASE"] and chosen(spec):
            try:
                os.close(os.open(os.environ["TANDEM_TEST_KILL_MARK"], os.O_CREAT | os.O_EXCL))
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        return honest(self, phase, spec, records)

    receiver.RankReceiver.handle = handle
"""


def _until(what: str, ok, timeout_s: float = DEADLINE_S):
    return until(what, ok, timeout_s)


@dataclass
class _Call:
    floor: int  # the version the whole fleet served when it was sent
    status: int | None  # None: no answer within CALL_DEADLINE_S (or the router unreachable)
    versions: list[set[int]] = field(default_factory=list)  # per choice: its spans' versions
    error: str = ""


class _HttpLoad:
    """Client threads looping ``POST /v1/completions`` through the router (token-id prompts,
    greedy, ``ignore_eos``), each call recorded."""

    def __init__(self, url: str, model: str, threads: int = 4, max_tokens: int = 32):
        self.calls: list[_Call] = []
        self.floor = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._loop, args=(url, model, k, max_tokens), name=f"load-{k}", daemon=True
            )
            for k in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, url: str, model: str, k: int, max_tokens: int) -> None:
        with httpx.Client(base_url=url, timeout=CALL_DEADLINE_S) as client:
            i = 0
            while not self._stop.is_set():
                prompt = [1 + (97 * k + 13 * i + j) % 400 for j in range(6)]
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                floor, i = self.floor, i + 1
                try:
                    r = client.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    self.calls.append(_Call(floor, None, error=repr(exc)))
                    continue
                if r.status_code != 200:
                    self.calls.append(_Call(floor, r.status_code, error=r.text[:500]))
                    continue
                versions = [
                    {s["version"] for s in c["weight_versions"]} for c in r.json()["choices"]
                ]
                self.calls.append(_Call(floor, 200, versions))

    def answered(self) -> int:
        return sum(c.status == 200 for c in self.calls)

    def stop(self) -> list[_Call]:
        """Stop the threads; every call answered 200 within its deadline, from one version,
        not older than the fleet's when it was sent."""
        self._stop.set()
        for t in self._threads:
            t.join(CALL_DEADLINE_S + 5)
            assert not t.is_alive(), f"{t.name} hung"
        bad = [c for c in self.calls if c.status != 200]
        assert not bad, f"{len(bad)} of {len(self.calls)} calls failed: {bad[:5]}"
        mixed = [c for c in self.calls if any(len(v) != 1 for v in c.versions)]
        assert not mixed, f"answers sampled from more than one version: {mixed[:5]}"
        stale = [c for c in self.calls if any(min(v) < c.floor for v in c.versions)]
        assert not stale, f"answers from a version the fleet had left: {stale[:5]}"
        assert self.answered() >= 10, self.calls
        return self.calls


class _Fleet:
    """Three `tandem serve` servers behind a router, under HTTP load, and a trainer."""

    def __init__(self, llama_dir: str, trainer_dir: str, router_flags: tuple[str, ...] = ()):
        self.llama_dir = llama_dir
        self.router_flags = router_flags
        self.servers: list[Server] = []
        self.router: Router | None = None
        self.load: _HttpLoad | None = None
        self.trainer = transformers.AutoModelForCausalLM.from_pretrained(
            trainer_dir, dtype=torch.float32
        )
        self.sender: WeightSender | None = None

    def start(self) -> None:
        started: list[Server | BaseException] = [None] * 3

        def one(i: int) -> None:
            try:
                started[i] = self._serve()
            except BaseException as exc:
                started[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.servers = [s for s in started if isinstance(s, Server)]
        for s in started:
            if not isinstance(s, Server):
                raise RuntimeError(f"a server did not start: {s}")
        for s in self.servers:  # one engine process each: the server is the replica
            assert descendants(s.pid) == [], descendants(s.pid)
        self.router = Router(*self.servers, extra=("--admin-key", ADMIN_KEY, *self.router_flags))
        _until("the router sees every replica", lambda: self.health()["status"] == "ok")
        self.sender = WeightSender(
            self.trainer, self.router.url, admin_key=ADMIN_KEY, transport="shm"
        )
        self.load = _HttpLoad(self.router.url, self.servers[0].model)
        _until(
            "the load answered on every replica",
            lambda: (
                all(r["requests"] for r in self.health()["replicas"]) and self.load.answered() >= 3
            ),
        )

    def _serve(self, port: int = 0) -> Server:
        return Server(self.llama_dir, "--admin-key", ADMIN_KEY, "--port", str(port))

    def health(self) -> dict:
        return self.router.client.get("/health").json()

    def states(self) -> list[tuple[str, int]]:
        return [(s["state"], s["version"]) for s in self.router.client.get("/fleet_state").json()]

    def kill(self, replica: int) -> None:
        """SIGKILL of the replica's engine process: its server's (the engine runs in it)."""
        os.kill(self.servers[replica].pid, signal.SIGKILL)

    def restart(self, replica: int) -> Server:
        """The dead server started again on its port (by its supervisor)."""
        old = self.servers[replica]
        old.proc.wait(DEADLINE_S)
        old.stop()  # (its client)
        self.servers[replica] = self._serve(urlsplit(old.url).port)
        return self.servers[replica]

    def healed_at(self, version: int) -> None:
        """Every replica serving ``version`` (the router's board and each server alike); the
        load's calls all good; every server decodes as transformers does on the trainer."""
        _until(
            f"every replica serving {version}", lambda: self.states() == [("serving", version)] * 3
        )
        assert [s.get("/health").json()["weight_version"] for s in self.servers] == [version] * 3
        assert self.health()["status"] == "ok"
        self.load.floor, answered = version, self.load.answered()
        _until("more calls answered", lambda: self.load.answered() >= answered + 5)
        self.load.stop()
        for server in self.servers:
            decodes(server, self.trainer)

    def stop(self) -> None:
        if self.load is not None:
            self.load._stop.set()
        if self.sender is not None:
            self.sender.close()
        if self.router is not None:
            self.router.stop()
        stops = [threading.Thread(target=s.stop) for s in self.servers]  # side by side
        for t in stops:
            t.start()
        for t in stops:
            t.join()


@contextmanager
def _routed_fleet(
    llama_dir,
    model_factory,
    tmp_path=None,
    monkeypatch=None,
    phase=None,
    kill_in: str = "push",
    router_flags: tuple[str, ...] = (),
):
    """A `_Fleet` started (with `KILL_IN_PHASE` on the servers' path when ``phase`` is
    given), stopped on exit."""
    if phase is not None:
        (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(KILL_IN_PHASE))
        path = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + path if path else ""))
        monkeypatch.setenv("TANDEM_TEST_KILL_MARK", str(tmp_path / "killed"))
        monkeypatch.setenv("TANDEM_TEST_KILL_VICTIM", str(tmp_path / "victim"))
        monkeypatch.setenv("TANDEM_TEST_KILL_PHASE", phase)
        monkeypatch.setenv("TANDEM_TEST_KILL_IN", kill_in)
    fleet = _Fleet(llama_dir, model_factory("llama", seed=1), router_flags)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def _victim(fleet: _Fleet, replica: int, tmp_path) -> None:
    (tmp_path / "victim").write_text(str(fleet.servers[replica].pid))


@pytest.mark.timeout(120)
def test_a_replica_killed_receiving_over_dist_fails_the_push_by_its_deadline_and_a_retry_lands(
    llama_dir, model_factory, tmp_path, monkeypatch
):
    """Cell (a), over dist (where replicas receive: shm replicas read the trainer's staging
    as they verify): replica 1's server dies as it starts receiving, before it joined the
    push's process group, so the group never forms: the push fails on every replica by the
    router's ``--push-phase-timeout`` (it waited 600 s before the option), each keeping
    version 0 and serving meanwhile. Started again, replica 1 serves; the retry lands on all
    three."""
    flags = ("--push-phase-timeout", "5")
    with _routed_fleet(
        llama_dir, model_factory, tmp_path, monkeypatch, "receive", router_flags=flags
    ) as fleet:
        _victim(fleet, 1, tmp_path)
        sender = WeightSender(
            fleet.trainer, fleet.router.url, admin_key=ADMIN_KEY, transport="dist"
        )
        try:
            start = time.monotonic()
            with pytest.raises(WeightSyncError):
                sender.push(version=1, policy="rolling", max_unavailable=1)
            assert time.monotonic() - start < 30  # 5 s to form the group, 15 s a phase
            assert (tmp_path / "killed").exists() and fleet.servers[1].proc.poll() is not None
            assert [s.get("/health").json()["weight_version"] for s in fleet.servers[::2]] == [0, 0]
            fleet.restart(1)
            _until("replica 1 back", lambda: fleet.states() == [("serving", 0)] * 3)
            again = sender.push(version=1, policy="rolling", max_unavailable=1)
            assert again.wait(DEADLINE_S).committed == [0, 1, 2]
        finally:
            sender.close()
        fleet.healed_at(1)


@pytest.mark.timeout(120)
def test_the_replica_draining_for_its_wave_killed_heals_and_nothing_is_lost(
    llama_dir, model_factory
):
    """Cell (d): SIGKILL of the server whose wave drains (requests still running on it):
    they run again on another replica, the wave's replica leaves the push, the other waves
    commit; started again, it heals from a peer at version 1."""
    with _routed_fleet(llama_dir, model_factory) as fleet:
        stats = fleet.sender.push(version=1, policy="rolling", max_unavailable=1)
        assert stats.rolling

        def draining() -> list[int]:
            state = fleet.router.client.get("/fleet_state").json()
            return [s["replica"] for s in state if s["state"] == "updating" and s["load"]]

        (victim, *_) = _until("a wave draining with requests on it", draining)
        fleet.kill(victim)
        ended = stats.wait(DEADLINE_S)
        # (it may have committed just as it died: then it heals to the version it had)
        assert list(ended.failed) in ([victim], []), ended
        assert len(ended.committed) + len(ended.failed) == 3, ended
        fleet.load.floor = 1  # (started again at version 0, it serves nothing until healed)
        fleet.restart(victim)
        fleet.healed_at(1)


@pytest.mark.timeout(120)
def test_a_replica_killed_committing_its_wave_heals_and_nothing_is_lost(
    llama_dir, model_factory, tmp_path, monkeypatch
):
    """Cell (e): replica 1's server dies in the commit of its wave: the push goes on (the
    third wave commits), it is quarantined; started again, it heals to version 1."""
    with _routed_fleet(llama_dir, model_factory, tmp_path, monkeypatch, "commit") as fleet:
        _victim(fleet, 1, tmp_path)
        stats = fleet.sender.push(version=1, policy="rolling", max_unavailable=1)
        ended = stats.wait(DEADLINE_S)
        assert (tmp_path / "killed").exists()
        assert ended.committed == [0, 2] and list(ended.failed) == [1], ended
        assert "commit" in ended.failed[1], ended
        assert fleet.states()[1][0] == "quarantined"
        fleet.load.floor = 1
        fleet.restart(1)
        fleet.healed_at(1)


@pytest.mark.timeout(150)
def test_a_replica_killed_while_a_peer_heals_it_heals_again_and_a_push_lands(
    llama_dir, model_factory, tmp_path, monkeypatch
):
    """Cell (g): after version 1 is everywhere, replica 2's server dies and is started again
    (at its checkpoint's version 0): the router quarantines it and a peer pushes version 1
    into it, and it dies again in that push's verify. Started once more, it heals; then a
    rolling push of version 2 reaches all three."""
    with _routed_fleet(
        llama_dir, model_factory, tmp_path, monkeypatch, "verify", kill_in="heal"
    ) as fleet:
        stats = fleet.sender.push(version=1, policy="rolling", max_unavailable=1)
        assert stats.wait(DEADLINE_S).committed == [0, 1, 2]
        fleet.load.floor = 1
        fleet.kill(2)
        fleet.restart(2)
        _until("the heal's fault", lambda: (tmp_path / "killed").exists())
        _until("replica 2 quarantined", lambda: fleet.states()[2][0] == "quarantined")
        fleet.restart(2)
        _until("replica 2 healed", lambda: fleet.states() == [("serving", 1)] * 3)
        with torch.no_grad():
            for p in fleet.trainer.parameters():
                p.mul_(1.02)
        stats = fleet.sender.push(version=2, policy="rolling", max_unavailable=1)
        assert stats.wait(DEADLINE_S).committed == [0, 1, 2]
        fleet.healed_at(2)
