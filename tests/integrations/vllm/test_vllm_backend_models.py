"""vLLM's ``tandem`` backend across model families, offline (one worker, in this process):
Qwen2 (QKV bias, tied embeddings) and Qwen3 (QK-norm, head_dim set apart, tied) and Qwen3-MoE
(experts prepacked by vLLM's CPU build) pushed through vLLM's trainer API generate what
transformers does on the pushed weights.

Runs in vLLM's venv (``make test`` runs ``tests/integrations/vllm`` there).
"""

from __future__ import annotations

import os

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")  # vLLM's own CI switch: no inductor compile
vllm = pytest.importorskip("vllm")

from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: E402

from support.vllm_models import (  # noqa: E402
    SHAPE,
    assert_generates_like,
    engine_gone,
    moved,
    offline_llm,
)
from tandem.exchange import WeightSyncError  # noqa: E402
from tandem.integrations.vllm import TandemTrainerInitInfo  # noqa: E402
from tandem.integrations.vllm.receiver import VllmReceiver  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def in_engine(model_dir: str, body, tp: int = 1) -> None:
    """``body(llm)`` on a fresh offline vLLM engine with the tandem backend, which is gone
    (collected) on return: the next in-process engine sets vLLM's parallel state up anew, and
    a late collection would tear that down. ``tp`` 2: its workers are processes (a core each)."""
    llm = offline_llm(model_dir, tp, weight_transfer_config={"backend": "tandem"})
    try:
        body(llm)
    finally:
        del llm
        engine_gone()


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
        assert_generates_like(llm, model, logprobs=False)

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
        assert_generates_like(llm, model, logprobs=False)

    in_engine(model_dir, push_and_generate, tp)
