"""`tandem router --replica URL --replica URL`: one front over two `tandem serve` instances
started apart. The `openai` client streams through it; requests spread; the controls fan out
with the admin key's rules; one push through it updates both replicas, the trainer sending one
copy; a replica that goes down is named by `/health` and skipped; a replica joins (or heals
after a restart) by pulling the fleet's weights from a live peer."""

from urllib.parse import urlsplit

import openai
import pytest
import torch
import transformers

from support.routers import Router, decodes
from support.serving import ADMIN_KEY, Server, wait_for
from tandem import LLM, SamplingParams, StaleVersionError
from tandem.exchange import WeightSender

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def replicas(llama_dir):
    servers = [Server(llama_dir, "--admin-key", ADMIN_KEY) for _ in range(2)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def router(replicas):
    r = Router(*replicas, extra=("--admin-key", ADMIN_KEY))
    try:
        assert wait_for(lambda: r.client.get("/health").json()["status"] == "ok", timeout=30)
        yield r
    finally:
        r.stop()


def _prompts(n: int) -> list[list[int]]:
    return [[10 * k + i for i in range(40)] for k in range(1, n + 1)]


def test_streams_through_the_router_equal_one_engine_and_spread(router, replicas, llama_dir):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model == replicas[0].model
    streamed = []
    for prompt in _prompts(6):
        ids = []
        for chunk in client.completions.create(
            model=model,
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
        assert streamed == [o.outputs[0].token_ids for o in llm.generate(_prompts(6), params)]
    tokens = [s.metric("tandem_generation_tokens_total") for s in replicas]
    assert all(t > 0 for t in tokens), tokens  # both replicas served some
    routed = [r["requests"] for r in router.client.get("/health").json()["replicas"]]
    assert sum(routed) >= 6 and min(routed) > 0


def test_the_same_prompt_prefix_goes_to_the_replica_that_cached_it(router):
    prompt = [7] * 200  # three full text-blocks' worth of tokens, the same each time
    before = [r["requests"] for r in router.client.get("/health").json()["replicas"]]
    for _ in range(3):
        r = router.client.post(
            "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2}
        )
        assert r.status_code in (200, 404), r.text  # 404: the model name; routing happened
    after = [r["requests"] for r in router.client.get("/health").json()["replicas"]]
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 3]


def test_controls_fan_out_under_the_admin_key(router, replicas):
    assert router.client.post("/pause").status_code == 401
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = router.client.post("/pause", params={"mode": "keep"}, headers=headers)
    assert r.status_code == 200 and len(r.json()["replicas"]) == 2
    assert all(s.admin("GET", "/is_paused").json()["is_paused"] for s in replicas)
    assert router.client.post("/resume", headers=headers).status_code == 200
    assert not any(s.admin("GET", "/is_paused").json()["is_paused"] for s in replicas)


@pytest.mark.parametrize(("transport", "version"), [("dist", 1), ("shm", 2)])
def test_one_push_through_the_router_updates_every_replica(
    router, replicas, model_factory, transport, version
):
    trainer_dir = model_factory("llama", seed=1)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    with torch.no_grad():  # each push carries weights the replicas do not hold yet
        for p in trainer.parameters():
            p.mul_(1.0 + 0.1 * version)
    sender = WeightSender(trainer, router.url, admin_key=ADMIN_KEY, transport=transport)
    stats = sender.push(version=version)
    sender.close()
    assert stats.bytes_moved == stats.bytes_needed  # the trainer sent one copy (counted)
    assert [r.bytes_in for r in stats.replicas] == [stats.bytes_needed] * 2
    relayed = [r.bytes_relayed for r in stats.replicas]
    assert relayed == ([stats.bytes_needed, 0] if transport == "dist" else [0, 0])
    assert [s.get("/health").json()["weight_version"] for s in replicas] == [version] * 2
    for server in replicas:  # each replica now decodes what transformers does on those weights
        decodes(server, trainer)


def test_deltas_through_the_router_reach_every_replica_holding_their_base(
    router, replicas, model_factory
):
    """A delta through the router reaches both replicas (dist: sent once, relayed). A replica
    whose weights came from another push is left out of the next delta and heals from its
    peer (taking that push's weights, and so its base): the delta after reaches it again."""
    trainer = transformers.AutoModelForCausalLM.from_pretrained(
        model_factory("llama", seed=2), dtype=torch.float32
    )
    embed = trainer.get_input_embeddings().weight

    def step() -> None:  # an update that moves a few rows
        with torch.no_grad():
            embed[:4].add_(0.5)

    sender = WeightSender(trainer, router.url, admin_key=ADMIN_KEY, transport="dist")
    try:
        first = sender.push(delta=True)
        assert not first.delta  # no base yet
        step()
        stats = sender.push(delta=True)
        assert stats.delta and stats.bytes_moved < 0.1 * first.bytes_moved
        assert [r.state for r in stats.replicas] == ["committed"] * 2
        assert stats.replicas[0].bytes_relayed == stats.bytes_moved
        for server in replicas:
            decodes(server, trainer)
        other = WeightSender(trainer, replicas[1].url, admin_key=ADMIN_KEY)
        other.push(version=stats.version, rollback=True, delta=False)  # the same weights
        other.close()
        step()
        stats = sender.push(delta=True)
        assert stats.delta and [(r.replica, r.state) for r in stats.replicas] == [(0, "committed")]

        def healed():
            state = router.client.get("/fleet_state").json()
            return [(s["state"], s["version"]) for s in state] == [("serving", stats.version)] * 2

        assert wait_for(healed, timeout=60)
        for server in replicas:
            decodes(server, trainer)
        step()
        stats = sender.push(delta=True)
        assert stats.delta and [r.state for r in stats.replicas] == ["committed"] * 2
    finally:
        sender.close()


def test_fleet_state_is_current_once_a_push_returned(llama_dir, model_factory):
    """The router's board reads the versions a push left as soon as the push returns, not at
    the next health poll (30 s away here); a push at a version not above the fleet's is
    refused, and a rollback reaches every replica. Servers of its own: the module's router
    over the shared ones heals a replica whose version is behind the other's, which a
    rollback through another router makes it, one replica at a time."""
    replicas = [Server(llama_dir, "--admin-key", ADMIN_KEY) for _ in range(2)]
    router = Router(*replicas, extra=("--admin-key", ADMIN_KEY, "--health-interval", "30"))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(
        model_factory("llama", seed=1), dtype=torch.float32
    )
    before = max(s.get("/health").json()["weight_version"] for s in replicas)
    sender = WeightSender(trainer, router.url, admin_key=ADMIN_KEY, transport="shm")
    try:
        assert wait_for(lambda: router.client.get("/health").json()["status"] == "ok", 30)
        for version in (before + 10, before + 11):
            assert sender.push(version=version).version == version
            state = router.client.get("/fleet_state").json()
            assert [(s["state"], s["version"]) for s in state] == [("serving", version)] * 2
        with pytest.raises(StaleVersionError) as caught:
            sender.push(version=before + 11)
        assert (caught.value.requested, caught.value.served) == (before + 11, before + 11)
        assert sender.push(version=before, rollback=True).version == before  # as it was
        state = router.client.get("/fleet_state").json()
        assert [(s["state"], s["version"]) for s in state] == [("serving", before)] * 2
    finally:
        sender.close()
        router.stop()
        for server in replicas:
            server.stop()


def test_a_replica_joins_through_the_router_and_a_restarted_one_heals(llama_dir, model_factory):
    """`POST /admin/replicas` grows the fleet: the new server pulls the pushed weights from a
    live peer (it holds the checkpoint's); a server restarted on its port comes back at the
    checkpoint's version, is held out, and heals from a peer the same way."""
    servers = [Server(llama_dir, "--admin-key", ADMIN_KEY) for _ in range(2)]
    router = Router(*servers, extra=("--admin-key", ADMIN_KEY))
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        assert wait_for(lambda: router.client.get("/health").json()["status"] == "ok", 30)
        trainer = transformers.AutoModelForCausalLM.from_pretrained(
            model_factory("llama", seed=1), dtype=torch.float32
        )
        sender = WeightSender(trainer, router.url, admin_key=ADMIN_KEY, transport="shm")
        sender.push(version=3)
        sender.close()
        servers.append(Server(llama_dir, "--admin-key", ADMIN_KEY))
        join = {"url": servers[2].url}
        assert router.client.post("/admin/replicas", json=join).status_code == 401
        r = router.client.post("/admin/replicas", json=join, headers=admin)
        assert r.status_code == 200 and r.json()["version"] == 3, r.text
        state = router.client.get("/fleet_state").json()
        assert [(s["state"], s["version"]) for s in state] == [("serving", 3)] * 3
        decodes(servers[2], trainer)
        port = urlsplit(servers[1].url).port
        servers[1].stop()
        servers[1] = Server(llama_dir, "--admin-key", ADMIN_KEY, "--port", str(port))

        def healed():
            state = router.client.get("/fleet_state").json()
            return [(s["state"], s["version"]) for s in state] == [("serving", 3)] * 3

        assert wait_for(healed, timeout=60)
        assert servers[1].get("/health").json()["weight_version"] == 3
        decodes(servers[1], trainer)
    finally:
        router.stop()
        for s in servers:
            s.stop()


def test_health_names_the_replica_that_is_down_and_requests_avoid_it(llama_dir):
    servers = [Server(llama_dir) for _ in range(2)]
    router = Router(*servers)
    try:
        assert router.client.post("/pause").status_code == 403  # no --admin-key: disabled
        assert wait_for(lambda: router.client.get("/health").json()["status"] == "ok", 30)
        down_url = servers[1].url
        servers[1].stop()

        def degraded():
            return router.client.get("/health").json()["status"] == "degraded"

        assert wait_for(degraded, timeout=20)
        body = router.client.get("/health").json()
        assert down_url in body["reason"]
        assert [r["status"] for r in body["replicas"]] == ["ok", "unavailable"]
        for prompt in _prompts(4):  # all go to the replica that is up
            r = router.client.post(
                "/v1/completions",
                json={"model": servers[0].model, "prompt": prompt, "max_tokens": 2},
            )
            assert r.status_code == 200, r.text
        servers[0].stop()
        assert wait_for(lambda: router.client.get("/health").status_code == 503, timeout=20)
        r = router.client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    finally:
        router.stop()
        for s in servers:
            s.stop()


def test_embeddings_go_through_the_router(model_factory):
    bert = model_factory("bert", architectures=["BertModel"])
    server = Server(bert, "--task", "embed")
    router = Router(server)
    try:
        assert wait_for(lambda: router.client.get("/health").json()["status"] == "ok", 30)
        body = {"model": server.model, "input": [[5, 6, 7], [8, 9]]}
        direct = server.post("/v1/embeddings", json=body).json()
        routed = router.client.post("/v1/embeddings", json=body)
        assert routed.status_code == 200, routed.text
        assert [d["embedding"] for d in routed.json()["data"]] == [
            d["embedding"] for d in direct["data"]
        ]
    finally:
        router.stop()
        server.stop()
