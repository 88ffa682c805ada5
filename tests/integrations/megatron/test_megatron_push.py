"""Real megatron-core trainers (TP and PP over gloo, on CPU) push into tandem engines; the
engine then decodes what Megatron's own forward decodes, with the same log-probs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.paths import SUPPORT, rendezvous
from support.trainers import start_rank, wait_ranks
from tandem import LLM, SamplingParams
from tandem.exchange.layout import LayoutMismatch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 9, 33, 2, 17, 100, 3, 8]
SCRIPT = SUPPORT / "megatron_trainer.py"
MEGATRON = ("megatron.core.models.gpt", "megatron.core.parallel_state", "tandem.exchange")


def _train_and_push(
    model_dir: str, llm, tp: int, pp: int, version: int, out: Path, *extra: str
) -> dict:
    world = tp * pp
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    args = [
        rendezvous(),
        str(tp),
        str(pp),
        model_dir,
        llm.exchange_address,
        str(version),
        str(out),
        ",".join(map(str, PROMPT)),
        *extra,
    ]
    procs = [start_rank(SCRIPT, [str(r), str(world), *args], env, MEGATRON) for r in range(world)]
    assert wait_ranks(procs, 240) == [0] * world
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    ("family", "tp", "pp", "engine"),
    [
        ("llama", 2, 1, {"tensor_parallel_size": 2}),
        ("llama", 2, 1, {"pipeline_parallel_size": 2}),
        ("llama", 2, 2, {"tensor_parallel_size": 2}),
        ("qwen2", 2, 1, {"tensor_parallel_size": 2}),  # QKV bias, tied output
        ("qwen3", 2, 1, {"tensor_parallel_size": 2}),  # QK-norm, head_dim != hidden / heads, tied
        ("gpt2", 2, 1, {"tensor_parallel_size": 2}),
    ],  # learned positions, LayerNorm, GELU, biases
)
def test_megatron_trainer_pushes_and_the_engine_decodes_what_megatron_does(
    model_factory, tmp_path, family, tp, pp, engine
):
    model_dir = model_factory(family, vocab_size=500)  # Megatron pads its vocab to 512
    with LLM(model_dir, **engine) as llm:
        expected = _train_and_push(model_dir, llm, tp, pp, 3, tmp_path / "megatron.json")
        assert llm.weight_version == 3
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
        got = llm.generate([PROMPT], params)[0].outputs[0]
    assert got.token_ids == expected["tokens"]
    assert max(abs(a - b) for a, b in zip(got.logprobs, expected["logprobs"], strict=True)) <= 1e-4


@pytest.mark.parametrize("engine", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_megatron_trainer_pushes_a_delta_and_the_engine_decodes_what_megatron_does(
    model_factory, tmp_path, engine
):
    """Version 3 dense, then an SGD step and version 4 as a delta (Megatron's fused QKV and
    gate/up boxes, TP-sharded and vocab-padded, encoded per box: the embedding's untouched
    rows leave it sparse); the engine then decodes what Megatron's forward does."""
    model_dir = model_factory("llama", vocab_size=500)
    with LLM(model_dir, **engine) as llm:
        out = tmp_path / "megatron.json"
        expected = _train_and_push(model_dir, llm, 2, 1, 3, out, "delta")
        assert llm.weight_version == 4
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
        got = llm.generate([PROMPT], params)[0].outputs[0]
    assert got.token_ids == expected["tokens"]
    assert max(abs(a - b) for a, b in zip(got.logprobs, expected["logprobs"], strict=True)) <= 1e-4


def test_a_megatron_layout_that_disagrees_fails_before_any_byte_moves(model_factory):
    """A Megatron stage missing a layer, and one with the wrong head count, are refused by
    name by the engine's planner; nothing is sent and the old weights serve."""
    from tandem.exchange.adapters.megatron import MegatronLlamaConfig, megatron_layout
    from tandem.exchange.plan import plan_transfers

    model_dir = model_factory("llama", vocab_size=500)
    cfg = MegatronLlamaConfig(
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=176,
        vocab=500,
        padded_vocab=512,
        layers=2,
    )
    shapes = {
        "embedding.word_embeddings.weight": (512, 64),
        "decoder.layers.0.input_layernorm.weight": (64,),
        "decoder.layers.0.self_attention.linear_qkv.weight": (128, 64),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 64),
        "decoder.layers.0.pre_mlp_layernorm.weight": (64,),
        "decoder.layers.0.mlp.linear_fc1.weight": (352, 64),
        "decoder.layers.0.mlp.linear_fc2.weight": (64, 176),
        "decoder.final_layernorm.weight": (64,),
        "output_layer.weight": (512, 64),
    }  # one layer of two: layer 1 is missing
    with LLM(model_dir) as llm:
        with pytest.raises(LayoutMismatch, match="model.layers.1.self_attn.q_proj.weight"):
            layouts = llm.engine.target.weight_layouts()
            plan_transfers([megatron_layout(shapes, cfg, 0, 1, 0)], layouts)
        wrong_heads = MegatronLlamaConfig(
            hidden=64,
            heads=4,
            kv_heads=1,
            head_dim=16,
            intermediate=176,
            vocab=500,
            padded_vocab=512,
            layers=2,
        )
        with pytest.raises(LayoutMismatch, match="linear_qkv.weight: local shape"):
            megatron_layout(shapes, wrong_heads, 0, 1, 0)


def test_megatron_trainer_pushes_once_into_every_replica_of_a_fleet(model_factory, tmp_path):
    model_dir = model_factory("llama", vocab_size=500)
    with LLM(model_dir, data_parallel_size=2) as llm:
        expected = _train_and_push(model_dir, llm, 2, 1, 3, tmp_path / "megatron.json")
        assert [s["version"] for s in llm.fleet_state()] == [3, 3]
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
        served = []
        for _ in range(2):
            llm.reset_prefix_cache()  # so the router sends the same prompt to the other replica
            out = llm.generate([PROMPT], params)[0]
            served.append(out.replica)
            got = out.outputs[0]
            assert got.token_ids == expected["tokens"]
            assert (
                max(abs(a - b) for a, b in zip(got.logprobs, expected["logprobs"], strict=True))
                <= 1e-4
            )
        assert served == [0, 1]
