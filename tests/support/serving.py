"""A real `tandem serve` subprocess for tests: started on a free port, stopped (and checked to
have stopped, workers included) on exit."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from support.trainers import wait_ranks
from tandem.engine.launcher import start_process
from tandem.server.process import ServerProcess

ADMIN_KEY = "test-admin-key-0123456789"


class Server(ServerProcess):
    """`ServerProcess` with an httpx client on its URL, quiet logs, and ``--model DIR`` or a
    TOML ``config``."""

    def __init__(self, model_dir: str, *args: str, config: str | None = None, timeout=120.0):
        where = ["--config", config] if config else ["--model", model_dir]
        super().__init__([*where, "--log-level", "warning", *args], start_timeout_s=timeout)
        self.model = self.model_name
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.client.get(path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.client.post(path, **kw)

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return self.client.request(method, path, headers=headers, **kw)

    def metric(self, name: str, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return sample.value
        return 0.0

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        code = super().stop(sig, timeout)
        if hasattr(self, "client"):
            self.client.close()
        return code


def _parents() -> dict[int, int]:
    """Every live process's parent (from /proc; zombies left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out[int(entry)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Live processes under ``pid``: its children, theirs, and so on."""
    parents, out, frontier = _parents(), [], {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        out += sorted(frontier)
    return out


def _workers(pid: int) -> dict[int, int]:
    """The live engine workers under ``pid`` (named ``tandem-w<local rank>``): local rank ->
    pid."""
    ranked = {}
    for p in descendants(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("tandem-w"):
            ranked[int(name.removeprefix("tandem-w"))] = p
    return ranked


def workers_of(pid: int) -> list[int]:
    """The live engine workers under ``pid``, in local rank order (in a fleet of TP=1
    replicas, a replica's index is its worker's local rank)."""
    return [p for _, p in sorted(_workers(pid).items())]


def worker_of(pid: int, local_rank: int) -> int:
    """The pid of the live worker of ``local_rank`` under ``pid``."""
    if (worker := _workers(pid).get(local_rank)) is None:
        raise AssertionError(f"no worker of local rank {local_rank} under {pid}")
    return worker


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


TRAINER = str(Path(__file__).with_name("http_trainer.py"))
HTTP_TRAINER = ("transformers", "transformers.models.llama.modeling_llama", "tandem.exchange")
# Token-id prompts: tiny models made with different seeds have different tokenizers.
ID_PROMPTS = [[5, 17, 99, 3], [40, 41, 42]]


def greedy(server: Server, max_tokens: int = 6) -> tuple[list[list[int]], dict]:
    """Greedy token ids for ID_PROMPTS, and the response body."""
    r = server.post(
        "/v1/completions",
        json={
            "model": server.model,
            "prompt": ID_PROMPTS,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])], body


def push(
    server: Server,
    model_dir: str,
    transport: str = "shm",
    *extra: str,
    key=ADMIN_KEY,
    url: str | None = None,
) -> subprocess.CompletedProcess:
    """Run tests/support/http_trainer.py: a separate trainer process pushing into ``server``
    (forked from a template that imported its modules once), its output captured."""
    argv = [str(TRAINER), model_dir, url or server.url, transport, key, *extra]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = start_process(
            argv, dict(os.environ), preload=HTTP_TRAINER, stdout=str(out), stderr=str(err)
        )
        [code] = wait_ranks([proc], 180)
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
