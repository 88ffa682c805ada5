"""A real ``vllm serve`` as the vLLM tests (tests/integrations/vllm) run it, and what they ask
of it over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from support.vllm_models import PROMPTS
from tandem.wire.frames import free_port


@contextmanager
def vllm_serve(model_dir: str, log: Path, *options: str, env: dict | None = None) -> Iterator[str]:
    """``vllm serve`` of ``model_dir`` (TP=2, a core per worker, float32, 128 tokens, 8 MiB of
    KV cache, eager) with ``options`` (tandem's flags) and ``env`` added to this process's
    environment, its output in ``log``: its URL once healthy; stopped (its process group) on
    exit."""
    with vllm_serves(model_dir, [log], *options, env=env, tensor_parallel_size=2) as servers:
        yield servers[0].url


@dataclass
class VllmServer:
    url: str
    process: subprocess.Popen  # the leader of its process group (the server and its workers)
    command: list[str]
    env: dict
    log: Path

    def kill(self) -> None:
        """SIGKILL the server and its workers at once, as a crash would."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(60)

    def restart(self) -> None:
        """Start it again, as it was started (its port, its checkpoint): once healthy."""
        self.process = _start(self.command, self.env, self.log)
        _wait_healthy([self], time.monotonic() + 240)


def _start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    with log.open("a") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _wait_healthy(servers: list[VllmServer], deadline: float) -> None:
    for server in servers:
        while not healthy(server.url):
            if server.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up:\n{server.log.read_text()[-3000:]}")
            time.sleep(1)  # polling the health route, not synchronizing


@contextmanager
def vllm_serves(
    model_dir: str,
    logs: list[Path],
    *options: str,
    env: dict | None = None,
    tensor_parallel_size: int = 1,
) -> Iterator[list[VllmServer]]:
    """One ``vllm serve`` per log in ``logs``, started side by side (each as `vllm_serve`
    describes, at ``tensor_parallel_size``): the servers once every one is healthy; all stopped
    on exit."""
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_CPU_CI_ENV": "1", **(env or {})}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    started: list[VllmServer] = []
    try:
        for i, log in enumerate(logs):
            # a core per worker, servers taking the cores in turn
            bound = [
                cores[(i * tensor_parallel_size + w) % len(cores)]
                for w in range(tensor_parallel_size)
            ]
            own = {**env, "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, bound))}
            port = free_port()
            # vllm-cpu's `vllm` script looks its own version up under the name "vllm" and
            # fails: its server module, which `vllm serve` runs
            cmd = [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--dtype",
                "float32",
                "--max-model-len",
                "128",
                "--kv-cache-memory-bytes",
                str(8 << 20),
                "--enforce-eager",
                "--tensor-parallel-size",
                str(tensor_parallel_size),
                *options,
            ]
            log.write_text("")
            server = VllmServer(f"http://127.0.0.1:{port}", _start(cmd, own, log), cmd, own, log)
            started.append(server)
        _wait_healthy(started, time.monotonic() + 240 * len(logs))
        yield started
    finally:
        for server in started:
            stop(server.process)


def stop(proc: subprocess.Popen) -> None:
    """Stop a ``vllm serve`` (its process group): SIGTERM, then SIGKILL past a minute."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def complete(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The server's greedy completion of ``prompt`` (6 tokens): its tokens and log-probs."""
    tokens, logprobs, _ = completion(url, prompt)
    return tokens, logprobs


def completion(url: str, prompt: list[int]) -> tuple[list[int], list[float], list[int] | None]:
    """`complete`, and the weight versions the answer names (tandem's vLLM middleware's
    ``x-tandem-weight-versions``; None without it)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    # as long as the router lets a call wait for a replica it may take (its route_wait_s):
    # behind --max-staleness 0 a call made once a push is held waits for a replica that has
    # committed it, which with a server killed mid-rollout took past 60 s on a slow VM
    with urllib.request.urlopen(request, timeout=300) as r:
        choice = json.loads(r.read())["choices"][0]
        named = r.headers.get("x-tandem-weight-versions")
    versions = None if named is None else [int(v) for v in named.split(",")]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], versions


def assert_serves(url: str, model: torch.nn.Module) -> None:
    """The server's greedy completions of `PROMPTS` are transformers' on ``model``, log-probs
    within float32 noise."""
    for ids in PROMPTS:
        tokens, logprobs = complete(url, ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        assert tokens == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-3)
