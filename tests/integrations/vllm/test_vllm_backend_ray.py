"""vLLM's Ray client drives the ``tandem`` backend: an offline ``vllm.LLM`` made with
``weight_transfer_config={"backend": "tandem"}`` lives in a Ray actor (``ray.remote(vllm.LLM)``,
as vLLM's RLHF examples hold one), and a trainer in this process pushes through vLLM's trainer
API with ``RayVLLMWeightSyncClient(handle)``. The actor then generates what transformers does on
the pushed weights, after each of two pushes: the backend resets the actor's prefix cache
through the handle, so prompts cached on the old weights are not served from their old KV.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there).
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

import torch  # noqa: E402
import transformers  # noqa: E402
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient  # noqa: E402

from support.vllm_models import MODEL, assert_generates_like, train_step  # noqa: E402
from tandem.integrations.vllm import TandemTrainerInitInfo  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# the engine core and its one worker in the actor's process; vLLM's CI switch: no compile
ACTOR_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_CI_ENV": "1"}
BLOCK = 32  # the actor's KV block: the long prompt fills three, cached from its first run
LONG = [list(range(7, 7 + 3 * BLOCK + 2))]


class RemoteLLM:
    """The actor's ``generate`` as a local call (what `assert_generates_like` calls)."""

    def __init__(self, handle):
        self.handle = handle

    def generate(self, *args, **kwargs):
        return ray.get(self.handle.generate.remote(*args, **kwargs), timeout=120)


@pytest.fixture(scope="module")
def actor(model_factory):
    model_dir = model_factory("llama", vocab_size=500, **MODEL)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": ACTOR_ENV},
    )
    try:
        handle = (
            ray.remote(num_cpus=0)(vllm.LLM)
            .options(max_concurrency=2)
            .remote(
                model_dir,
                dtype="float32",
                max_model_len=128,
                kv_cache_memory_bytes=8 << 20,
                enforce_eager=True,
                seed=0,
                block_size=BLOCK,
                enable_prefix_caching=True,
                weight_transfer_config={"backend": "tandem"},
            )
        )
        yield handle, model_dir
    finally:
        ray.shutdown()


def test_pushes_through_vllms_ray_client_land_in_the_actor_and_it_generates_them(actor):
    handle, model_dir = actor
    remote = RemoteLLM(handle)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert_generates_like(remote, model, prompts=LONG)  # now in the actor's prefix cache
    engine = WeightTransferTrainerFactory.trainer_init(
        TandemTrainerInitInfo(rank=0),
        client=RayVLLMWeightSyncClient(handle),
        source=ModuleSource(model),
    )
    try:
        for version, seed in ((1, 11), (2, 12)):
            train_step(model, seed)
            stats = engine.send_weights(version=version)
            assert stats.version == version and stats.bytes_moved == stats.bytes_needed
            assert engine.weight_state() == {"version": version, "torn": None}
            assert_generates_like(remote, model.eval(), prompts=LONG)
    finally:
        engine.shutdown()
