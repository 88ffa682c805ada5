"""A TP=2 `tandem serve`: weights pushed by a separate trainer process, a dead worker, SIGTERM."""

import os
import signal
import threading

import httpx
import pytest

from support.serving import (
    ADMIN_KEY,
    ID_PROMPTS,
    Server,
    alive,
    descendants,
    greedy,
    push,
    wait_for,
    workers_of,
)
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_push_into_server_then_worker_death_then_sigterm(model_factory):
    engine_dir = model_factory("llama", seed=0)
    trainer_dir = model_factory("llama", seed=1)  # same shapes, other weights
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(trainer_dir, kv_cache_memory=16 << 20) as ref:
        expected = [o.outputs[0].token_ids for o in ref.generate(ID_PROMPTS, params)]

    server = Server(
        engine_dir, "--tp", "2", "--admin-key", ADMIN_KEY, "--kv-cache-memory", str(16 << 20)
    )
    try:
        before, body = greedy(server, 8)
        assert body["weight_version"] == 0 and before != expected
        workers = workers_of(server.proc.pid)
        assert len(workers) == 2

        refused = push(server, trainer_dir, "shm", key="wrong-key-wrong-key")
        assert refused.returncode != 0 and "401" in refused.stderr

        for version, transport in ((1, "shm"), (2, "dist")):
            done = push(
                server,
                trainer_dir,
                transport,
                url=server.url.removeprefix("http://") if transport == "dist" else server.url,
            )  # both spellings
            assert done.returncode == 0, done.stdout + done.stderr
            assert f"pushed version {version}" in done.stdout
            after, body = greedy(server, 8)
            assert after == expected  # the trainer's weights are being served
            assert body["weight_version"] == version and body["weight_versions"] == [version]
        assert server.metric("tandem_weight_version") == 2
        assert server.metric("tandem_weight_sync_seconds_count", outcome="ok") == 2

        # a worker dies: requests get 503, /health says so within 5 s; the server stays up
        os.kill(workers[1], signal.SIGKILL)
        assert wait_for(lambda: server.get("/health").status_code == 503, timeout=5)
        r = server.post("/v1/completions", json={"model": server.model, "prompt": "x"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable"
        assert server.get("/health").json()["reason"]
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.output
    assert "tandem serve: stopped" in server.output
    assert wait_for(
        lambda: (
            not descendants(server.proc.pid)
            and not any(os.path.exists(f"/proc/{w}") and alive(w) for w in workers)
        ),
        timeout=10,
    )


def test_sigterm_cancels_in_flight_requests_with_a_clear_status(model_factory, tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text(
        f'model = "{model_factory("llama", seed=0)}"\ntp = 2\n'
        "shutdown_timeout_s = 1.0\n[engine]\nkv_cache_memory = 16777216\n"
    )
    server = Server("", config=str(config))
    workers = workers_of(server.proc.pid)
    results = {}

    def stream():
        body = {
            "model": server.model,
            "prompt": "A story",
            "ignore_eos": True,
            "max_tokens": 500,
            "stream": True,
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            results["events"] = [line for line in r.iter_lines() if line.startswith("data:")]

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert wait_for(lambda: server.metric("tandem_running_sequences") == 1, timeout=30)
        server.proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        assert not t.is_alive()
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop(signal.SIGKILL)
    events = results["events"]
    assert events[-1] == "data: [DONE]"
    # the grace period (1 s) ends before the 500 tokens: a clear status, not a dropped connection
    assert "the server is shutting down" in events[-2], events[-2]
    assert not any(alive(w) for w in workers)
