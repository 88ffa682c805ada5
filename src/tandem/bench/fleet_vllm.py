"""`tandem bench fleet --into vllm`: tandem's fleet over vLLM servers. Measured in one run, on
this host:

- ``REPLICAS`` ``vllm serve`` of the generate bench's model (`tandem.bench.generate.SETUPS`;
  vLLM's CPU build from its own venv, needs ``make vllm``), each one worker bound to a core in
  turn, float32, eager (no compile: every window runs the same engines), made with tandem's
  worker extension and middleware and vLLM's dev-mode routes (``/pause``, ``/resume``), behind
  one ``tandem router``;
- ``CLIENTS`` client threads each looping one sampled completion of ``NEW_TOKENS`` tokens
  through the router's URL (a bounded load: that many requests in flight), tokens counted by
  vLLM's ``usage`` of the requests that finished inside a window;
- the trainer: the same model in transformers, in this process, pushing through the router's
  URL (``shm``: one staging read by every server) back to back for ``WINDOW_S`` seconds, each
  push a new version of the same weights (a full push's bytes moved and checked every time),
  each waiting until every server serves its version (``/fleet_state``);
- ``steady``: no push, measured before the pushes and after them (their mean). ``all``:
  pushes with ``policy="all"`` (every server commits together, vLLM running the commit
  between two steps). ``stop_the_world``: what RL frameworks do to vLLM (verl, slime): every
  server paused with vLLM's own ``/pause?mode=wait`` (fanned out by the router), the push,
  ``/resume``. ``rolling``: ``policy="rolling", max_unavailable=1, wave="wait"``: every
  server verifies and holds the push while serving, then one at a time commits under vLLM's
  pause while the others serve. ``failed_requests``: client calls that failed (goal: 0).
  Where the servers share cores (3 on a 2-core host), a paused server's core goes to the
  others: the ratios then say that requests go on and none fails, not what a fleet of
  machines keeps;
- ``egress``: one push's trainer bytes against the bytes one server needs (the trainer sends
  once for the fleet);
- ``heal``: one server SIGKILLed and started again on its checkpoint: seconds until the
  router serves it again at the fleet's version, healed from a live vLLM peer (its worker's
  weights read back from vLLM's layers and pushed as a trainer rank).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from tandem.bench.generate import SETUPS as GENERATE_SETUPS
from tandem.bench.generate import bench_model_dir
from tandem.bench.generate_vllm import serve_command, serve_env, stop_group, vllm_python
from tandem.bench.load import ClientLoad, back_to_back, wait_serving
from tandem.server.process import ServerProcess
from tandem.wire.frames import free_port

REPLICAS = 3
CLIENTS = 6
NEW_TOKENS = 32
PROMPT_TOKENS = 16
WINDOW_S = {False: 20.0, True: 4.0}
KEY = "tandem-bench-fleet-vllm-key"
START_TIMEOUT_S = 300.0


class VllmServer:
    """One ``vllm serve`` with tandem's extension, its output in ``log``."""

    def __init__(self, python: Path, model: Path, core: int, log: Path):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.command = serve_command(
            python,
            model,
            port,
            64 << 20,
            "--worker-extension-cls",
            "tandem.integrations.vllm.worker.TandemWorkerExtension",
            "--middleware",
            "tandem.integrations.vllm.serve.exchange",
        )
        self.env = serve_env(python, str(core), TANDEM_ADMIN_KEY=KEY)
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        with self.log.open("a") as out:
            return subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def wait_healthy(self, deadline: float) -> None:
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"vllm serve at {self.url} did not come up:\n{tail}")
            time.sleep(0.5)  # polling the health route

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(60)

    def restart(self) -> None:
        self.process = self._start()

    def stop(self) -> None:
        stop_group(self.process)


def _clients(url: str, model: str, vocab: int) -> ClientLoad:
    """``CLIENTS`` threads looping one sampled completion each through ``url``: the tokens
    vLLM's ``usage`` counts."""

    local = threading.local()  # each client thread's own connection, kept across its calls

    def call(client: int, rng) -> int:
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=url, timeout=300)
        body = {
            "model": model,
            "prompt": [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)],
            "max_tokens": NEW_TOKENS,
            "temperature": 0.8,
            "ignore_eos": True,
        }
        r = local.http.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    return ClientLoad(CLIENTS, call)


def _serving(router: httpx.Client, version: int, timeout_s: float = 300.0) -> None:
    wait_serving(lambda: router.get("/fleet_state").json(), version, timeout_s, poll_s=0.01)


def _steady(clients: ClientLoad, window_s: float) -> float:
    start = time.monotonic()
    time.sleep(window_s)
    return clients.tokens_per_s(start, time.monotonic())


def _pushes(router, sender, how: str, window_s: float, version: int):
    """Push back to back for ``window_s`` (``how``: all, stop_the_world, rolling): (window
    start, end, next version, seconds per push until every server serves it)."""

    def push(v: int) -> None:
        if how == "stop_the_world":
            router.post("/pause", params={"mode": "wait"}).raise_for_status()
            try:
                sender.push(version=v, policy="all", delta=False)
            finally:
                router.post("/resume").raise_for_status()
        else:
            policy = "rolling" if how == "rolling" else "all"
            sender.push(version=v, policy=policy, max_unavailable=1, delta=False)
        _serving(router, v)

    return back_to_back(push, window_s, version)


def run(quick: bool = False) -> dict[str, Any]:
    import transformers

    from tandem.exchange import WeightSender

    python = vllm_python()
    if python is None:
        raise RuntimeError("tandem bench fleet --into vllm needs vLLM's venv: run `make vllm`")
    path = bench_model_dir(GENERATE_SETUPS[quick])
    window = WINDOW_S[quick]
    trainer = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    cores = sorted(os.sched_getaffinity(0))
    result: dict[str, Any] = {
        "benchmark": "fleet-vllm",
        "quick": quick,
        "model": str(path),
        "replicas": REPLICAS,
        "clients": CLIENTS,
        "new_tokens": NEW_TOKENS,
        "window_s": window,
        "cores": len(cores),
    }
    logs = Path(tempfile.mkdtemp(prefix="tandem-bench-fleet-vllm-"))
    servers: list[VllmServer] = []
    router = None
    try:
        for i in range(REPLICAS):
            servers.append(VllmServer(python, path, cores[i % len(cores)], logs / f"vllm-{i}.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_healthy(deadline)
        router = ServerProcess(
            [
                *(f for s in servers for f in ("--replica", s.url)),
                "--admin-key",
                KEY,
                "--health-interval",
                "0.2",
            ],
            60.0,
            command="router",
        )
        front = httpx.Client(
            base_url=router.url, timeout=300, headers={"authorization": f"Bearer {KEY}"}
        )
        model = front.get("/v1/models").json()["data"][0]["id"]
        sender = WeightSender(trainer, router.url, admin_key=KEY, transport="shm")
        try:
            # warm-up, outside the windows: the staging memory, the plan, vLLM's first pause
            first = sender.push(version=1, delta=False)
            sender.push(version=2, policy="rolling", max_unavailable=1, delta=False).wait(300)
            _serving(front, 2)
            result["egress"] = {
                "trainer_bytes": first.bytes_moved,
                "bytes_one_server_needs": first.bytes_needed,
                "sent_per_fleet": round(first.bytes_moved / first.bytes_needed, 3),
            }
            clients = _clients(router.url, model, trainer.config.vocab_size)
            try:
                time.sleep(window / 2)  # the load settles
                steady = [_steady(clients, window)]
                during, rollouts, pushes, version = {}, {}, {}, 3
                for how in ("all", "stop_the_world", "rolling"):
                    t0, t1, version, seconds = _pushes(front, sender, how, window, version)
                    during[how] = clients.tokens_per_s(t0, t1)
                    rollouts[how] = round(statistics.mean(seconds), 3)
                    pushes[how] = len(seconds)
                steady.append(_steady(clients, window))  # again: the load may drift
            finally:
                clients.stop(300)
            result["heal"] = _heal(front, servers[-1], version - 1)
        finally:
            sender.close()
            front.close()
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
    result["steady_before_after"] = [round(v, 1) for v in steady]
    steady = statistics.mean(steady)
    result["tokens_per_s"] = {"steady": round(steady, 1)} | {
        how: round(v, 1) for how, v in during.items()
    }
    result["pushes"] = pushes
    result["rollout_seconds"] = rollouts
    result["failed_requests"] = len(clients.failed)
    result["failures"] = clients.failed[:3]
    result["ratios"] = {
        "rolling_vs_steady": round(during["rolling"] / steady, 3),
        "all_vs_steady": round(during["all"] / steady, 3),
        "stop_the_world_vs_steady": round(during["stop_the_world"] / steady, 3),
        "rolling_vs_stop_the_world": round(during["rolling"] / during["stop_the_world"], 3),
    }
    result["targets"] = {
        "rolling_vs_steady >= 0.6": result["ratios"]["rolling_vs_steady"] >= 0.6,
        "failed_requests == 0": result["failed_requests"] == 0,
        "trainer sends once per fleet": result["egress"]["sent_per_fleet"] <= 1.0,
        "healed": result["heal"]["healed_s"] is not None,
    }
    result["logs"] = str(logs)
    return result


def _heal(front: httpx.Client, server: VllmServer, version: int) -> dict[str, Any]:
    """SIGKILL ``server``, start it again on its checkpoint, time until it serves ``version``
    (healed from a live peer)."""
    server.kill()
    t0 = time.monotonic()
    server.restart()
    server.wait_healthy(t0 + START_TIMEOUT_S)
    up = time.monotonic() - t0
    try:
        _serving(front, version)
    except RuntimeError:
        return {"restart_s": round(up, 3), "healed_s": None}
    return {"restart_s": round(up, 3), "healed_s": round(time.monotonic() - t0 - up, 3)}


def summary(result: dict[str, Any]) -> str:
    lines = [f"{k}: {v}x" for k, v in result["ratios"].items()]
    lines.append(
        f"tokens/s: {result['tokens_per_s']}; rollout s: {result['rollout_seconds']}; "
        f"failed requests: {result['failed_requests']}"
    )
    lines.append(f"egress: {result['egress']}; heal: {result['heal']}")
    lines.append(f"targets: {result['targets']}")
    return "\n".join(lines)
