"""`tandem serve --data-parallel-size 2`: one HTTP front over two replicas. The `openai`
client streams through it, requests spread over the replicas, the RL controls reach every
replica, a push over HTTP updates both, and a replica killed under it is quarantined (`/health`
names it), requests go to the other, and it comes back healed from its peer."""

import os
import signal

import openai
import pytest

from serving import ADMIN_KEY, Server, children, greedy, push, wait_for
from tandem import LLM, SamplingParams

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
        for chunk in client.completions.create(model=server.model, prompt=prompt, max_tokens=5,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):  # fmt: skip
            ids += chunk.choices[0].token_ids or []
        streamed.append(ids)
    with LLM(llama_dir) as llm:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        assert streamed == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tokens = [server.metric("tandem_replica_generation_tokens_total", replica=str(r))
              for r in range(2)]  # fmt: skip
    assert all(t > 0 for t in tokens) and sum(tokens) == 30, tokens
    health = server.get("/health").json()
    assert [r["replica"] for r in health["replicas"]] == [0, 1]
    assert all(r["status"] == "ok" and r["load"] == 0 for r in health["replicas"])


def test_controls_reach_every_replica(server):
    assert server.admin("POST", "/pause", params={"mode": "keep"}).status_code == 200
    assert server.admin("GET", "/is_paused").json()["is_paused"] is True
    assert server.admin("POST", "/resume").status_code == 200
    assert server.admin("POST", "/sleep", params={"level": 1}).status_code == 200
    states = [r["state"] for r in server.get("/health").json()["replicas"]]
    assert states == ["sleeping", "sleeping"]
    assert server.admin("POST", "/wake_up").status_code == 200
    assert [r["state"] for r in server.get("/health").json()["replicas"]] == ["running"] * 2
    assert greedy(server)[0]


def test_a_push_over_http_updates_both_replicas(server, model_factory):
    trainer_dir = model_factory("llama", seed=1)
    done = push(server, trainer_dir, "dist")
    assert done.returncode == 0, done.stdout + done.stderr
    health = server.get("/health").json()
    assert [r["weight_version"] for r in health["replicas"]] == [1, 1]
    assert server.metric("tandem_replica_weight_version", replica="1") == 1
    with LLM(trainer_dir) as llm:  # both replicas now serve the trainer's weights
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in llm.generate(_prompts(4), params)]
    r = server.post("/v1/completions", json={"model": server.model, "prompt": _prompts(4),
                                             "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True})  # fmt: skip
    got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert got == want


def test_a_killed_replica_is_quarantined_and_healed_while_the_front_serves(llama_dir):
    server = Server(llama_dir, "--data-parallel-size", "2")
    try:
        want = greedy(server)[0]
        workers = children(server.proc.pid)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)

        def one_down():
            body = server.get("/health").json()
            return [r["status"] for r in body["replicas"]].count("unavailable") == 1

        assert wait_for(one_down, timeout=20)
        r = server.get("/health")
        assert r.status_code == 200  # the other replica serves: nothing is refused
        down = [x for x in r.json()["replicas"] if x["status"] != "ok"]
        assert down[0]["fleet_state"] in ("quarantined", "joining"), down
        for _ in range(3):
            assert greedy(server)[0] == want  # answered by the live replica meanwhile

        def healed():
            return [s["state"] for s in server.get("/fleet_state").json()] == ["serving"] * 2

        assert wait_for(healed, timeout=60)  # restarted, filled from the live replica
        assert len(children(server.proc.pid)) == 2
        assert all(greedy(server)[0] == want for _ in range(4))
        tokens = [server.metric("tandem_replica_generation_tokens_total", replica=str(r))
                  for r in range(2)]  # fmt: skip
        assert all(t > 0 for t in tokens), tokens
    finally:
        server.stop()
