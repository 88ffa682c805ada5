"""The fleet fault matrix, trimmed to cells (a) receiving, (d) draining, (e) committing and
(g) being healed, over HTTP: `tandem serve --data-parallel-size 3` under client load while a
trainer pushes rolling through its URL and one replica's worker is SIGKILLed. Each cell ends
with no 5xx (none is documented while two replicas live), every answer's log-probs those of
transformers on the weights its `weight_versions` names, every replica serving the pushed
version, and each replica equal to transformers on the trainer's weights."""

import os
import signal
import textwrap
import threading
import time
from contextlib import contextmanager

import pytest
import torch
import transformers

from support.kills import KILL_IN_HEAL, KILL_IN_PHASE
from support.serving import ADMIN_KEY, Server, wait_for, worker_of
from tandem.exchange import WeightSender, WeightSyncError

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 60.0
PROMPTS = [[10 * k + i for i in range(12)] for k in range(1, 7)]


def _model(path: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class _HttpLoad:
    """Client threads posting greedy completions in a loop; every answer kept."""

    def __init__(self, server: Server, clients: int = 3):
        self.answers: list[tuple[int, list[int], dict | str]] = []  # (status, prompt, body)
        self._stop = threading.Event()

        def loop(c: int) -> None:
            k = 0
            while not self._stop.is_set():
                prompt = PROMPTS[(c + 3 * k) % len(PROMPTS)]
                k += 1
                body = {
                    "model": server.model,
                    "prompt": prompt,
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                }
                r = server.post("/v1/completions", json=body)
                self.answers.append(
                    (r.status_code, prompt, r.json() if r.status_code == 200 else r.text)
                )

        self._threads = [
            threading.Thread(target=loop, args=(c,), daemon=True) for c in range(clients)
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> list[tuple[int, list[int], dict | str]]:
        self._stop.set()
        for t in self._threads:
            t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in self._threads), "a client call hung"
        return self.answers


def _consistent(answers, references: dict[int, torch.nn.Module]) -> None:
    """Every call answered 200 in full (one whose replica was lost ran again elsewhere); each
    answer's log-probs are transformers' on the weights of the one version its
    ``weight_versions`` names (a span of two may mix, and says so)."""
    bad = [(status, body) for status, _, body in answers if status != 200]
    assert not bad, bad[:3]
    mixed = 0
    for _, prompt, body in answers:
        choice = body["choices"][0]
        assert len(choice["token_ids"]) == 24 and choice["finish_reason"] == "length", choice
        versions = _versions(choice)
        if len(versions) != 1:
            mixed += 1
            continue
        _check(references[versions[0]], prompt, choice)
    assert mixed <= len(answers) // 4, f"{mixed} of {len(answers)} answers span versions"


def _versions(choice: dict) -> list[int]:
    """The versions that sampled a choice's tokens (its spans)."""
    return sorted({span["version"] for span in choice["weight_versions"]})


def _check(reference: torch.nn.Module, prompt: list[int], choice: dict) -> None:
    ids = prompt + choice["token_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)
    n = len(prompt)
    want = logp[n - 1 : -1].gather(1, torch.tensor(choice["token_ids"])[:, None]).squeeze(1)
    got = torch.tensor(choice["logprobs"]["token_logprobs"])
    assert (got - want).abs().max() <= 1e-4, _versions(choice)


def _states(server: Server) -> list[tuple[str, int]]:
    return [(s["state"], s["version"]) for s in server.get("/fleet_state").json()]


def _every_replica_equals(server: Server, reference: torch.nn.Module, version: int) -> None:
    """Until each replica answered greedy requests (counted by its token metric): every
    answer at ``version`` with transformers' log-probs on ``reference``."""
    metric = "tandem_replica_generation_tokens_total"
    before = [server.metric(metric, replica=str(r)) for r in range(3)]
    deadline = time.monotonic() + DEADLINE_S
    while any(server.metric(metric, replica=str(r)) == before[r] for r in range(3)):
        assert time.monotonic() < deadline, "a replica took no request"
        body = {
            "model": server.model,
            "prompt": PROMPTS,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        }
        r = server.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert _versions(choice) == [version]
            _check(reference, PROMPTS[choice["index"]], choice)


def _worker(server: Server, replica: int) -> int:
    """The pid of ``replica``'s worker (TP=1: its rank's local_rank is the replica)."""
    return worker_of(server.proc.pid, replica)


@contextmanager
def _served_under_load(
    model_factory, tmp_path, monkeypatch, sitecustomize: str | None = None, transport: str = "shm"
):
    """(server, load, trainer, sender, references) for a `tandem serve` of 3 replicas whose
    workers start with ``sitecustomize`` (a fault planted in a push phase)."""
    if sitecustomize is not None:
        (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(sitecustomize))
        path = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [path])]))
        monkeypatch.setenv("TANDEM_TEST_KILL_MARK", str(tmp_path / "killed"))
    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    server = Server(
        engine_dir,
        "--data-parallel-size",
        "3",
        "--admin-key",
        ADMIN_KEY,
        "--push-phase-timeout",
        "5",
    )
    load = None
    try:
        load = _HttpLoad(server)
        assert wait_for(
            lambda: all(s["load"] for s in server.get("/fleet_state").json()),
            timeout=DEADLINE_S,
            interval=0.01,
        )
        trainer = _model(trainer_dir)
        sender = WeightSender(trainer, server.url, admin_key=ADMIN_KEY, transport=transport)
        yield server, load, trainer, sender, {0: _model(engine_dir), 1: trainer}
    finally:
        if load is not None:
            load._stop.set()
        server.stop()


def _ends_healed(server, load, trainer, references, version: int = 1) -> None:
    assert wait_for(lambda: _states(server) == [("serving", version)] * 3, timeout=DEADLINE_S)
    _consistent(load.stop(), references)
    _every_replica_equals(server, trainer, version)


def test_a_replica_killed_receiving_fails_the_push_and_the_retry_lands(
    model_factory, tmp_path, monkeypatch
):
    """Cell (a) over dist: the push fails (every replica keeps version 0) within the push's
    deadline, the lost replica heals, the retry reaches all three."""
    monkeypatch.setenv("TANDEM_TEST_KILL_PHASE", "receive")
    monkeypatch.setenv("TANDEM_TEST_KILL_SIGNAL", "SIGKILL")
    with _served_under_load(model_factory, tmp_path, monkeypatch, KILL_IN_PHASE, "dist") as (
        server,
        load,
        trainer,
        sender,
        references,
    ):
        start = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.push(version=1, policy="rolling", max_unavailable=1)
        assert time.monotonic() - start < 30 and (tmp_path / "killed").exists()
        assert wait_for(lambda: _states(server) == [("serving", 0)] * 3, timeout=DEADLINE_S)
        ended = sender.push(version=1, policy="rolling").wait(DEADLINE_S)
        assert ended.committed == [0, 1, 2], ended
        _ends_healed(server, load, trainer, references)


def test_the_replica_draining_for_its_wave_killed_heals(model_factory, tmp_path, monkeypatch):
    """Cell (d): `/fleet_state` names the replica whose wave drains; its worker is killed."""
    with _served_under_load(model_factory, tmp_path, monkeypatch) as (
        server,
        load,
        trainer,
        sender,
        references,
    ):
        stats = sender.push(version=1, policy="rolling", max_unavailable=1)
        updating: list[int] = []

        def draining() -> bool:
            state = server.get("/fleet_state").json()
            updating[:] = [s["replica"] for s in state if s["state"] == "updating"]
            assert all(s.get("rolling_to") == 1 for s in state if s["version"] < 1)
            return bool(updating)

        assert wait_for(draining, timeout=DEADLINE_S, interval=0.005)
        os.kill(_worker(server, updating[0]), signal.SIGKILL)
        ended = stats.wait(timeout=DEADLINE_S)
        # (it may have committed just before it died: then it heals to the version it had)
        assert list(ended.failed) in ([updating[0]], []), ended
        _ends_healed(server, load, trainer, references)


def test_a_replica_killed_committing_its_wave_heals(model_factory, tmp_path, monkeypatch):
    """Cell (e): the first worker to commit dies there; the other waves commit."""
    monkeypatch.setenv("TANDEM_TEST_KILL_PHASE", "commit")
    monkeypatch.setenv("TANDEM_TEST_KILL_SIGNAL", "SIGKILL")
    with _served_under_load(model_factory, tmp_path, monkeypatch, KILL_IN_PHASE) as (
        server,
        load,
        trainer,
        sender,
        references,
    ):
        ended = sender.push(version=1, policy="rolling", max_unavailable=1).wait(DEADLINE_S)
        assert (tmp_path / "killed").exists()
        assert len(ended.committed) == 2 and len(ended.failed) == 1, ended
        _ends_healed(server, load, trainer, references)


def test_a_replica_killed_while_being_healed_heals_again(model_factory, tmp_path, monkeypatch):
    """Cell (g): replica 2's worker is killed; while its peer's push into it verifies, the
    restarted worker is killed too; it heals again, then a rolling push reaches all three."""
    monkeypatch.setenv("TANDEM_TEST_KILL_PID", "")
    with _served_under_load(model_factory, tmp_path, monkeypatch, KILL_IN_HEAL) as (
        server,
        load,
        trainer,
        sender,
        references,
    ):
        first = _worker(server, 2)
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: (tmp_path / "killed").exists(), timeout=DEADLINE_S)

        def back() -> bool:
            return _states(server) == [("serving", 0)] * 3 and _worker(server, 2) != first

        assert wait_for(back, timeout=2 * DEADLINE_S)
        ended = sender.push(version=1, policy="rolling", max_unavailable=1).wait(DEADLINE_S)
        assert ended.committed == [0, 1, 2], ended
        _ends_healed(server, load, trainer, references)
