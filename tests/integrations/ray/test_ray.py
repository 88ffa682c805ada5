"""Engine ranks as Ray actors on a 2-node local Ray cluster (`ray.cluster_utils.Cluster`, all on
loopback): TP=2 spread over both nodes equals the single-process engine, a killed rank actor
makes the next call raise EngineDeadError naming it, shutdown leaves no actor and no placement
group, and a trainer actor on the other node pushes new weights."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import transformers

from support.paths import TESTS
from support.ray_actors import Trainer, Where
from tandem import LLM, SamplingParams
from tandem.engine.executor import EngineDeadError

ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install -e '.[ray]')")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
LOCAL = {"node_ip_address": "127.0.0.1", "num_cpus": 2, "include_dashboard": False}


@pytest.fixture(scope="module")
def cluster():
    c = cluster_utils.Cluster(initialize_head=True, head_node_args=dict(LOCAL))
    c.add_node(**{k: v for k, v in LOCAL.items() if k != "include_dashboard"})
    # the actors (support.ray_actors) are imported by name on the workers
    path = os.pathsep.join([str(TESTS), *sys.path])
    ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _alive_actors() -> list:
    """From the GCS actor table (the state API needs the dashboard, which is off here)."""
    from ray._private.state import actors

    return [a for a in actors(actor_state_name="ALIVE").values()]


def _placement_groups() -> list:
    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def test_tp2_ranks_spread_over_two_nodes_equal_one_process(cluster, llama_dir):
    with LLM(llama_dir) as one:
        want = one.generate(PROMPTS, GREEDY)
        want_scores = one.score(PROMPTS)
    with LLM(
        llama_dir,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        placement_strategy="STRICT_SPREAD",
    ) as llm:
        got = llm.generate(PROMPTS, GREEDY)
        for a, b in zip(want_scores, llm.score(PROMPTS), strict=True):  # the same messages
            assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5
        places = llm.worker_locations()
        assert [p["rank"] for p in places] == [0, 1]
        assert len({p["node_id"] for p in places}) == 2  # one rank per node
        assert len(_placement_groups()) == 1
    for a, b in zip(want, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-5)
    deadline = time.monotonic() + 30
    while (_alive_actors() or _placement_groups()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive_actors() and not _placement_groups()  # shutdown left nothing behind


def test_killed_rank_actor_is_an_engine_dead_error_naming_it(cluster, llama_dir):
    llm = LLM(
        llama_dir,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        placement_strategy="SPREAD",
    )
    try:
        llm.generate(PROMPTS[:1], GREEDY)
        [rank1] = [w for w in llm.worker_locations() if w["rank"] == 1]
        os.kill(rank1["pid"], signal.SIGKILL)  # the actor's process (both nodes are this host)
        with pytest.raises(EngineDeadError, match="rank 1"):
            for _ in range(50):  # the death is noticed at the next call at the latest
                llm.generate(PROMPTS[:1], GREEDY)
                time.sleep(0.1)
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 30
    while (_alive_actors() or _placement_groups()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive_actors() and not _placement_groups()


def test_trainer_actor_on_the_other_node_pushes_weights(cluster, model_factory):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(trainer_dir) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY)]
    with LLM(
        engine_dir,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        placement_strategy="STRICT_PACK",
    ) as llm:
        nodes = {p["node_id"] for p in llm.worker_locations()}
        assert len(nodes) == 1
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in nodes)
        trainer = Trainer.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False)
        ).remote()
        assert ray.get(trainer.node.remote()) == other
        assert ray.get(trainer.push.remote(trainer_dir, llm.exchange_address, 4)) == 4
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.weight_version == 4
        ray.kill(trainer)
    assert got == want


def test_launch_trainers_colocated_and_split(cluster, llama_dir):
    from tandem.integrations.ray import launch_trainers

    with LLM(
        llama_dir,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        placement_strategy="STRICT_SPREAD",
        ray_cpus_per_rank=0.5,
    ) as llm:
        engine_nodes = [p["node_id"] for p in llm.worker_locations()]
        near = launch_trainers(
            Where, 2, llm, layout="colocated", num_cpus=0.5, kwargs={"tag": "near"}
        )
        apart = launch_trainers(
            Where, 2, llm, layout="split", strategy="STRICT_SPREAD", num_cpus=0.5
        )
        try:
            got = ray.get([a.where.remote() for a in near.actors])
            assert [(r, w, t) for r, w, t, _ in got] == [(0, 2, "near"), (1, 2, "near")]
            assert [n for *_, n in got] == engine_nodes == near.nodes
            got = ray.get([a.where.remote() for a in apart.actors])
            assert len({n for *_, n in got}) == 2 and [n for *_, n in got] == apart.nodes
            with pytest.raises(ValueError, match="layout must be"):
                launch_trainers(Where, 1, llm, layout="mixed")
        finally:
            near.shutdown()
            apart.shutdown()


def test_serve_with_ray_ranks(cluster, llama_dir):
    from support.serving import Server

    with Server(
        llama_dir,
        "--tp",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--ray-address",
        cluster.address,
        "--placement-strategy",
        "STRICT_SPREAD",
        "--served-model-name",
        "tiny",
    ) as server:
        r = server.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": PROMPTS[0],
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
    with LLM(llama_dir) as one:
        want = one.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    assert r.json()["choices"][0]["token_ids"] == want


def test_a_fleet_places_each_replica_on_its_own_node_and_one_push_reaches_both(
    cluster, model_factory
):
    from tandem.exchange import WeightSender

    engine_dir, trainer_dir = model_factory("llama"), model_factory("llama", seed=1)
    with LLM(trainer_dir) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY)]
    trainer = transformers.AutoModelForCausalLM.from_pretrained(trainer_dir, dtype=torch.float32)
    with LLM(engine_dir, data_parallel_size=2, distributed_executor_backend="ray") as llm:
        places = llm.worker_locations()
        assert sorted(p["replica"] for p in places) == [0, 1]
        assert len({p["node_id"] for p in places}) == 2  # one replica per node
        assert len(_placement_groups()) == 2  # each replica its own
        stats = WeightSender(trainer, llm, transport="dist").push(version=3)
        assert stats.bytes_moved == stats.bytes_needed  # one copy left the trainer
        assert [r.bytes_in for r in stats.replicas] == [stats.bytes_needed] * 2
        outs = llm.generate(PROMPTS, GREEDY)
        assert {o.replica for o in outs} == {0, 1}  # each replica serves one prompt
        assert [o.outputs[0].token_ids for o in outs] == want
        assert [s["version"] for s in llm.fleet_state()] == [3, 3]
