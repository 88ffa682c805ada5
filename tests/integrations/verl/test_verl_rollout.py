"""verl's own classes drive tandem on CPU: after ``import verl`` its registries give tandem's
replica and ServerAdapter for ``rollout.name=tandem`` (the ``verl.plugins`` entry point);
verl's `LLMServerManager` launches a TP=2 replica over a CPU Ray resource pool (hybrid mode,
as verl's trainer does), verl's client (`LLMServerClient`, through its load balancer)
generates; verl's weight-sync sequence (sleep, ``resume(["weights"])``, ``update_weights``
from a trained model's parameters, ``resume(["kv_cache"])``) lands the trained weights, and
the next generation equals transformers on them: greedy tokens, and at temperature 0.7 the
log-probs verl's trainer recomputes (``log_softmax(logits / T)``) within 1e-4.

Runs in verl's venv (``.venv-verl``: verl pins transformers<5.11); ``make test`` runs
``tests/integrations/verl`` there.
"""

from __future__ import annotations

import asyncio
import os

import pytest

verl = pytest.importorskip("verl")

import ray  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402
from verl.single_controller.base.worker import Worker  # noqa: E402
from verl.single_controller.ray import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402
from verl.workers.rollout.replica import get_rollout_replica_class  # noqa: E402

pytestmark = pytest.mark.timeout(420)

PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]


def _config(model_dir: str):
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer")
    rollout = config.actor_rollout_ref.rollout
    with open_dict(config):
        rollout.name = "tandem"
        rollout.tensor_model_parallel_size = 2
        rollout.n_gpus_per_node = 2
        rollout.prompt_length = 16
        rollout.response_length = 6
        rollout.dtype = "float32"
        rollout.calculate_log_probs = True
        rollout.engine_kwargs["tandem"] = {"kv_cache_memory": 16 << 20}
        rollout.checkpoint_engine.update_weights_bucket_megabytes = 1
        config.actor_rollout_ref.model.path = model_dir
    return config


def _trained(model_dir: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def _logprobs(model, prompt: list[int], tokens: list[int], temperature: float):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    scaled = torch.log_softmax(logits / temperature, -1)
    return logits.argmax(-1).tolist(), scaled[torch.arange(len(tokens)), tokens]


@pytest.fixture
def cluster():
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def test_the_entry_point_registers_tandem_in_verl():
    from tandem.integrations.verl.adapter import TandemServerAdapter
    from tandem.integrations.verl.replica import TandemReplica

    assert get_rollout_replica_class("tandem") is TandemReplica
    assert get_rollout_class("tandem", "async") is TandemServerAdapter


def test_verl_generates_through_tandem_and_update_weights_lands(cluster, model_factory):
    from tandem.integrations.verl.adapter import TandemServerAdapter

    model_dir = model_factory("llama", seed=0)
    config = _config(model_dir)
    trained = _trained(model_dir)

    async def run():
        pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
        # verl's base worker stands in for its actor/rollout workers: the hybrid replica
        # takes its node from them
        group = RayWorkerGroup(
            pool, RayClassWithInitArgs(cls=ray.remote(Worker)), name_prefix="tandem_test"
        )
        manager = await LLMServerManager.create(config=config, worker_group=group)
        (replica,) = manager.get_replicas()
        client = manager.get_client()
        greedy = {
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "repetition_penalty": 1.0,
            "logprobs": True,
        }
        before = [
            await client.generate(request_id=f"a{i}", prompt_ids=p, sampling_params=dict(greedy))
            for i, p in enumerate(PROMPTS)
        ]
        assert all(len(o.token_ids) == 6 and o.stop_reason == "completed" for o in before)

        # verl's weight sync (ActorRolloutRefWorker.update_weights, naive backend)
        adapter = TandemServerAdapter(
            config=config.actor_rollout_ref.rollout,
            model_config=config.actor_rollout_ref.model,
            device_mesh=None,
            replica_rank=0,
        )
        await replica.sleep()
        await adapter.resume(tags=["weights"])
        await adapter.update_weights(
            trained.named_parameters(), global_steps=3, peft_config=None, base_sync_done=True
        )
        await adapter.resume(tags=["kv_cache"])

        after = [
            await client.generate(request_id=f"b{i}", prompt_ids=p, sampling_params=dict(greedy))
            for i, p in enumerate(PROMPTS)
        ]
        sampled = await client.generate(
            request_id="c", prompt_ids=PROMPTS[0], sampling_params=dict(greedy, temperature=0.7)
        )
        # verl's partial-rollout controls: after abort_all_requests generation is blocked, a
        # new request waits, and resume_generation lets it run
        assert await replica.abort_all_requests() is None
        held = asyncio.ensure_future(
            client.generate(request_id="d", prompt_ids=PROMPTS[1], sampling_params=dict(greedy))
        )
        await asyncio.sleep(1.0)
        assert not held.done()
        await replica.resume_generation()
        assert (await held).token_ids == after[1].token_ids
        await replica.shutdown()
        return before, after, sampled

    before, after, sampled = asyncio.run(run())
    for prompt, new in zip(PROMPTS, after, strict=True):
        expected, logprobs = _logprobs(trained, prompt, new.token_ids, 1.0)
        assert new.token_ids == expected  # the trained model's greedy tokens
        assert torch.allclose(torch.tensor(new.log_probs), logprobs, atol=1e-4)
        assert new.extra_fields["global_steps"] == 3
    assert [o.token_ids for o in before] != [o.token_ids for o in after]
    _, logprobs = _logprobs(trained, PROMPTS[0], sampled.token_ids, 0.7)  # verl's recompute
    assert torch.allclose(torch.tensor(sampled.log_probs), logprobs, atol=1e-4)
