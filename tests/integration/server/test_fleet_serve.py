"""`tandem serve --data-parallel-size 2`: one HTTP front over two replicas. The `openai`
client streams through it, requests spread over the replicas, the RL controls reach every
replica, a push over HTTP updates both, and a replica killed under it is quarantined (`/health`
names it), requests go to the other, and it comes back healed from its peer."""

import json
import os
import signal
import threading
import time

import openai
import pytest
import torch
import transformers

from support.serving import ADMIN_KEY, Server, greedy, push, wait_for, worker_of, workers_of
from tandem import LLM, SamplingParams
from tandem.exchange import WeightSender

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def server(llama_dir):
    s = Server(llama_dir, "--data-parallel-size", "2", "--admin-key", ADMIN_KEY)
    try:
        yield s
    finally:
        s.stop()


def _prompts(n: int) -> list[list[int]]:
    return [[10 * k + i for i in range(12)] for k in range(1, n + 1)]


def test_streams_match_one_engine_and_spread_over_replicas(server, llama_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = _prompts(6)
    streamed = []
    for prompt in prompts:
        ids = []
        for chunk in client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            ids += chunk.choices[0].token_ids or []
        streamed.append(ids)
    with LLM(llama_dir) as llm:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        assert streamed == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tokens = [
        server.metric("tandem_replica_generation_tokens_total", replica=str(r)) for r in range(2)
    ]
    assert all(t > 0 for t in tokens) and sum(tokens) == 30, tokens
    health = server.get("/health").json()
    assert [r["replica"] for r in health["replicas"]] == [0, 1]
    assert all(r["status"] == "ok" and r["load"] == 0 for r in health["replicas"])


def test_controls_reach_every_replica(server):
    assert server.admin("POST", "/pause", params={"mode": "keep"}).status_code == 200
    assert server.admin("GET", "/is_paused").json()["is_paused"] is True
    assert server.admin("POST", "/resume").status_code == 200
    assert server.admin("POST", "/sleep", params={"level": 1}).status_code == 200
    states = [r["engine"] for r in server.get("/health").json()["replicas"]]
    assert states == ["sleeping", "sleeping"]
    assert server.admin("POST", "/wake_up").status_code == 200
    assert [r["engine"] for r in server.get("/health").json()["replicas"]] == ["running"] * 2
    assert greedy(server)[0]


def test_a_push_over_http_updates_both_replicas(server, model_factory):
    trainer_dir = model_factory("llama", seed=1)
    done = push(server, trainer_dir, "dist")
    assert done.returncode == 0, done.stdout + done.stderr
    health = server.get("/health").json()
    assert [r["version"] for r in health["replicas"]] == [1, 1]
    assert server.metric("tandem_replica_weight_version", replica="1") == 1
    with LLM(trainer_dir) as llm:  # both replicas now serve the trainer's weights
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in llm.generate(_prompts(4), params)]
    r = server.post(
        "/v1/completions",
        json={
            "model": server.model,
            "prompt": _prompts(4),
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert got == want


def test_a_killed_replica_is_quarantined_and_healed_while_the_front_serves(llama_dir):
    server = Server(llama_dir, "--data-parallel-size", "2")
    try:
        want = greedy(server)[0]
        workers = workers_of(server.proc.pid)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)

        def one_down():
            body = server.get("/health").json()
            return [r["status"] for r in body["replicas"]].count("unavailable") == 1

        assert wait_for(one_down, timeout=20)
        r = server.get("/health")
        assert r.status_code == 200  # the other replica serves: nothing is refused
        down = [x for x in r.json()["replicas"] if x["status"] != "ok"]
        assert down[0]["state"] in ("quarantined", "joining"), down
        for _ in range(3):
            assert greedy(server)[0] == want  # answered by the live replica meanwhile

        def healed():
            return [s["state"] for s in server.get("/fleet_state").json()] == ["serving"] * 2

        assert wait_for(healed, timeout=60)  # restarted, filled from the live replica
        assert len(workers_of(server.proc.pid)) == 2
        assert all(greedy(server)[0] == want for _ in range(4))
        tokens = [
            server.metric("tandem_replica_generation_tokens_total", replica=str(r))
            for r in range(2)
        ]
        assert all(t > 0 for t in tokens), tokens
    finally:
        server.stop()


def test_requests_lost_with_a_replica_run_again_or_end_naming_it(llama_dir):
    """A replica dies while a stream it serves has sent tokens and while other requests on it
    have sent none (the fleet is paused with ``keep``): the stream ends with an error naming
    the replica; the others run again on the other replica and are answered in full."""
    server = Server(llama_dir, "--data-parallel-size", "2", "--admin-key", ADMIN_KEY)
    try:
        events: list[str] = []

        def stream() -> None:
            body = {
                "model": server.model,
                "prompt": _prompts(1)[0],
                "max_tokens": 480,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with server.client.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert wait_for(lambda: len(events) > 3, timeout=30)  # tokens went out
        assert server.admin("POST", "/pause", params={"mode": "keep"}).status_code == 200
        loads = [r["load"] for r in server.get("/health").json()["replicas"]]
        lost = loads.index(max(loads))  # the stream's replica
        answers: list = []

        def one(k: int) -> None:
            body = {
                "model": server.model,
                "prompt": _prompts(8)[k],
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            }
            answers.append(server.post("/v1/completions", json=body))

        waiting = [threading.Thread(target=one, args=(k,)) for k in range(1, 7)]
        for t in waiting:
            t.start()
        assert wait_for(
            lambda: (
                server.get("/health").json()["replicas"][1 - lost]["load"] > 0
                and server.get("/health").json()["replicas"][lost]["load"] > 480
            ),
            20,
        )
        os.kill(worker_of(server.proc.pid, lost), signal.SIGKILL)

        def quarantined():
            states = server.get("/fleet_state").json()
            return states[lost]["state"] in ("quarantined", "joining")

        assert wait_for(quarantined, timeout=20)
        streaming.join(30)
        assert not streaming.is_alive()
        errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors and f"replica {lost} was lost" in errors[-1]["error"]["message"], events[-2:]
        assert server.admin("POST", "/resume").status_code == 200
        for t in waiting:
            t.join(60)
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        assert all(len(a.json()["choices"][0]["token_ids"]) == 8 for a in answers)
        assert wait_for(
            lambda: [s["state"] for s in server.get("/fleet_state").json()] == ["serving"] * 2,
            timeout=60,
        )
    finally:
        server.stop()


def test_a_rolling_push_under_load_answers_every_request_on_one_version(llama_dir, model_factory):
    """Clients keep calling while a trainer pushes with ``policy="rolling"`` into a server of
    two replicas started with ``--max-staleness 0``: no 5xx, no response spans two versions
    (waves drain), and none that started after a replica served the new version ran the old."""
    server = Server(
        llama_dir, "--data-parallel-size", "2", "--admin-key", ADMIN_KEY, "--max-staleness", "0"
    )
    try:
        answers: list[tuple[float, int, list[int]]] = []
        stop = threading.Event()

        def client(c: int) -> None:
            body = {
                "model": server.model,
                "prompt": _prompts(4)[c],
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            }
            while not stop.is_set():
                start = time.monotonic()
                r = server.post("/v1/completions", json=body)
                versions = r.json().get("weight_versions", []) if r.status_code == 200 else []
                answers.append((start, r.status_code, versions))

        first_new: list[float] = []

        def watch() -> None:
            while not stop.is_set() and not first_new:
                if any(s["version"] == 1 for s in server.get("/fleet_state").json()):
                    first_new.append(time.monotonic())
                time.sleep(0.005)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(3)]
        threads.append(threading.Thread(target=watch))
        for t in threads:
            t.start()
        time.sleep(1.0)
        trainer = transformers.AutoModelForCausalLM.from_pretrained(
            model_factory("llama", seed=1), dtype=torch.float32
        )
        stats = WeightSender(trainer, server.url, admin_key=ADMIN_KEY).push(
            version=1, policy="rolling", max_unavailable=1
        )
        assert [r.state for r in stats.replicas] == ["rolling", "rolling"]
        assert wait_for(
            lambda: [s["version"] for s in server.get("/fleet_state").json()] == [1, 1], timeout=60
        )
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
        assert {status for _, status, _ in answers} == {200}, answers  # no 5xx, nothing refused
        assert all(len(v) == 1 for _, _, v in answers), answers  # none mixes versions
        assert first_new and any(v == [1] for _, _, v in answers)
        late = [v for start, _, v in answers if start > first_new[0]]
        assert late and all(v == [1] for v in late), late  # max_staleness=0
    finally:
        server.stop()
