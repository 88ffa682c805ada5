"""Fault injection against a real TP=2 `tandem serve` and real trainer processes.

For every fault: the documented outcome happens, `/health` says so within 5 s, no request hangs
or gets tokens from torn weights, the next push (or a restart) recovers, and no process, shared
memory segment or port is left behind. docs/reliability.md lists the outcomes.
"""

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from support.serving import ADMIN_KEY, ID_PROMPTS, Server, alive, greedy, push, wait_for, workers_of
from tandem import LLM, SamplingParams
from tandem.wire import free_port

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/tandem-*"))


def _port_free(port: int) -> bool:
    """Nobody listens on it: a new server could bind it (as servers do, with SO_REUSEADDR, so
    connections of the old one in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def models(model_factory):
    return {
        "engine": model_factory("llama", seed=0),
        "trainer": model_factory("llama", seed=1),
        "other": model_factory("llama", seed=2, hidden_size=96),
    }


@pytest.fixture(scope="module")
def expected(models):
    """Greedy tokens of the engine's own weights and of the trainer's."""
    out = {}
    for name in ("engine", "trainer"):
        with LLM(models[name], kv_cache_memory=8 << 20) as llm:
            out[name] = [o.outputs[0].token_ids for o in llm.generate(ID_PROMPTS, GREEDY)]
    return out


@pytest.fixture(scope="module")
def server(models):
    with Server(
        models["engine"], "--tp", "2", "--admin-key", ADMIN_KEY, "--kv-cache-memory", str(16 << 20)
    ) as s:
        yield s


def _greedy(server) -> tuple[list[list[int]], int]:
    tokens, body = greedy(server)
    return tokens, body["weight_version"]


def _version(server) -> int:
    return server.get("/health").json()["weight_version"]


def _healthy(server) -> bool:
    return server.get("/health").status_code == 200


def _restore(server, models, expected) -> None:
    """A complete push of the trainer's weights: the recovery every scenario must allow."""
    before = _version(server)
    done = push(server, models["trainer"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert wait_for(lambda: _healthy(server), timeout=5)
    tokens, version = _greedy(server)
    assert tokens == expected["trainer"] and version == before + 1


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_trainer_killed_mid_push_keeps_the_old_version(server, models, expected, transport):
    segments = _segments()
    tokens_before, version = _greedy(server)
    streamed = {}

    def stream():  # a request in flight while the push breaks: it must finish, not hang
        body = {
            "model": server.model,
            "prompt": "go",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                streamed["events"] = [x for x in r.iter_lines() if x.startswith("data:")]
        except Exception as exc:  # reported by the assertion below
            streamed["events"] = [repr(exc)]

    t = threading.Thread(target=stream)
    t.start()
    died = push(server, models["trainer"], transport, "--fault", "die")
    t.join(timeout=60)
    assert died.returncode == 17, died.stdout + died.stderr
    events = streamed["events"]
    assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2], events[-2:]
    assert wait_for(lambda: _healthy(server), timeout=5)  # staged: nothing was torn
    assert _greedy(server) == (tokens_before, version)  # the old version keeps serving
    assert _segments() <= segments  # the dead trainer's segment was removed by the engine
    assert server.metric("tandem_weight_sync_seconds_count", outcome="failed") >= 1
    _restore(server, models, expected)


def test_in_place_push_broken_midway_refuses_requests_until_a_complete_push(
    server, models, expected
):
    died = push(server, models["trainer"], "dist", "--mode", "in_place", "--fault", "die")
    assert died.returncode == 17, died.stdout + died.stderr
    assert wait_for(lambda: server.get("/health").status_code == 503, timeout=5)
    assert "incomplete" in server.get("/health").json()["reason"]
    r = server.post("/v1/completions", json={"model": server.model, "prompt": ID_PROMPTS})
    assert r.status_code == 503 and "choices" not in r.json()  # no tokens from torn weights
    assert r.json()["error"]["type"] == "service_unavailable"
    _restore(server, models, expected)


def test_layout_disagreement_is_refused_before_any_byte_moves(server, models):
    tokens, version = _greedy(server)
    segments = _segments()
    refused = push(server, models["other"])  # hidden 96 instead of 64
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "shape" in refused.stdout and "model.embed_tokens.weight" in refused.stdout
    assert _healthy(server) and _greedy(server) == (tokens, version)
    assert _segments() <= segments


def test_corrupted_byte_in_transit_is_rejected(server, models, expected):
    tokens, version = _greedy(server)
    refused = push(server, models["engine"], "shm", "--fault", "corrupt")
    assert refused.returncode == 3 and "checksum" in refused.stdout, refused.stdout
    assert _healthy(server) and _greedy(server) == (tokens, version)
    _restore(server, models, expected)


def test_peers_closing_connections_mid_request(server, models, expected):
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": server.model, "prompt": "x", "max_tokens": 300, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as s:  # closes halfway through the body
        s.sendall(head + body[:10])
    with socket.create_connection((host, int(port))) as s:  # closes while generating
        s.sendall(head + body)
        assert wait_for(lambda: server.metric("tandem_running_sequences") == 1, timeout=10)
    # the client is gone: its sequence is aborted and its KV blocks return to the pool
    assert wait_for(lambda: server.metric("tandem_kv_blocks_used") == 0, timeout=10)
    exchange = server.admin("GET", "/admin/weights").json()["exchange"]
    for junk in (b"", b"\x00\x00\x00\x05hello", b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection((exchange["host"], exchange["port"])) as s:
            s.sendall(junk)  # a stranger on the exchange port: dropped
    assert _healthy(server)
    _restore(server, models, expected)


def test_worker_killed_mid_generation(models):
    server = Server(models["engine"], "--tp", "2", "--kv-cache-memory", str(16 << 20))
    port = int(server.url.rsplit(":", 1)[1])
    workers = workers_of(server.proc.pid)
    result = {}

    def stream():
        body = {
            "model": server.model,
            "prompt": "go",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            result["events"] = [x for x in r.iter_lines() if x.startswith("data:")]
            result["done"] = time.monotonic()

    try:
        t = threading.Thread(target=stream)
        t.start()
        assert wait_for(lambda: server.metric("tandem_running_sequences") == 1, timeout=30)
        killed = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        t.join(timeout=30)
        assert not t.is_alive() and result["done"] - killed < 5  # the stream ends, with a reason
        assert "engine_unavailable" in result["events"][-2]
        assert wait_for(lambda: server.get("/health").status_code == 503, timeout=5)
        assert (
            server.post("/v1/completions", json={"model": server.model, "prompt": "x"}).status_code
            == 503
        )
    finally:
        assert server.stop() == 0
    assert not any(os.path.exists(f"/proc/{w}/status") and alive(w) for w in workers)
    assert wait_for(lambda: _port_free(port), timeout=5)
    with Server(models["engine"], "--tp", "2", "--kv-cache-memory", str(16 << 20)) as again:
        assert (
            again.post("/v1/completions", json={"model": again.model, "prompt": "x"}).status_code
            == 200
        )


@pytest.mark.parametrize("damage", ["truncated weights (disk full)", "missing tokenizer"])
def test_load_failure_is_a_clear_error_and_leaves_nothing(models, tmp_path, damage):
    model = tmp_path / "model"
    shutil.copytree(models["engine"], model)
    if damage.startswith("truncated"):
        weights = model / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])  # what a full disk leaves behind
        named = "model.safetensors"
    else:
        (model / "tokenizer.json").unlink()
        named = "tokenizer.json"
    port = free_port()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            "--model",
            str(model),
            "--tp",
            "2",
            "--port",
            str(port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]  # (workers print their own traceback above)
    assert last.startswith("tandem serve: cannot start") and named in last, done.stderr
    assert _port_free(port)
