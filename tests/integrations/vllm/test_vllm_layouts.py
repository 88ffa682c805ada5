"""The declared layouts of vLLM's parameters (`tandem.integrations.vllm.layouts`), checked
against boxes worked out by hand and against a transformers model's own tensors (no vLLM
needed: the layouts are plain data)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tandem.integrations.vllm.layouts import Shapes, Split, worker_layout

SHAPES = Shapes(hidden=8, intermediate=8, heads=4, kv_heads=2, head_dim=2, vocab=100)


def vllm_names(layers: int, *, bias: bool = False, qk_norm: bool = False) -> list[str]:
    """The parameter names vLLM's Llama/Qwen2/Qwen3 classes register (untied head)."""
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        p = f"model.layers.{i}"
        names += [
            f"{p}.{n}.weight"
            for n in (
                "self_attn.qkv_proj",
                "self_attn.o_proj",
                "mlp.gate_up_proj",
                "mlp.down_proj",
                "input_layernorm",
                "post_attention_layernorm",
            )
        ]
        names += [f"{p}.self_attn.qkv_proj.bias"] if bias else []
        names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"] if qk_norm else []
    return names + ["model.norm.weight", "lm_head.weight"]


def pieces(layout, key):
    return [(r.piece.name, r.piece.box, r.piece.offset) for r in layout.regions if r.key == key]


def test_qkv_rows_of_rank_1_of_2_by_hand():
    layout = worker_layout("LlamaForCausalLM", vllm_names(1), SHAPES, Split(1, 2), 1, "float32")
    key = "model.layers.0.self_attn.qkv_proj.weight"
    # 4 heads of 2 -> q rows 8; rank 1 holds q heads 2,3 = rows [4, 8); kv heads 2 -> one each
    assert layout.local_shapes[key] == (4 + 2 + 2, 8)
    assert pieces(layout, key) == [
        ("model.layers.0.self_attn.q_proj.weight", ((4, 8), (0, 8)), (0, 0)),
        ("model.layers.0.self_attn.k_proj.weight", ((2, 4), (0, 8)), (4, 0)),
        ("model.layers.0.self_attn.v_proj.weight", ((2, 4), (0, 8)), (6, 0)),
    ]
    o = "model.layers.0.self_attn.o_proj.weight"
    assert pieces(layout, o) == [(o, ((0, 8), (4, 8)), (0, 0))]
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    assert layout.local_shapes[gate_up] == (8, 8)
    assert pieces(layout, gate_up) == [
        ("model.layers.0.mlp.gate_proj.weight", ((4, 8), (0, 8)), (0, 0)),
        ("model.layers.0.mlp.up_proj.weight", ((4, 8), (0, 8)), (4, 0)),
    ]


def test_kv_heads_replicated_when_ranks_outnumber_them():
    # 4 ranks, 2 kv heads: ranks 0,1 hold kv head 0 and ranks 2,3 kv head 1 (vLLM's replicas)
    for rank, head in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        layout = worker_layout(
            "LlamaForCausalLM", vllm_names(1), SHAPES, Split(rank, 4), rank, "float32"
        )
        k = pieces(layout, "model.layers.0.self_attn.qkv_proj.weight")[1]
        assert k[1][0] == (2 * head, 2 * head + 2) and k[2] == (2, 0)


def test_vocab_padded_to_64_then_split():
    # 100 rows padded to 128: rank 0 rows [0, 64), rank 1 rows [64, 100) (28 padding rows)
    got = []
    for rank in range(2):
        layout = worker_layout(
            "LlamaForCausalLM", vllm_names(0), SHAPES, Split(rank, 2), rank, "float32"
        )
        assert layout.local_shapes["lm_head.weight"] == (64, 8)
        got.append(pieces(layout, "lm_head.weight")[0][1][0])
    assert got == [(0, 64), (64, 100)]


def test_expert_boxes_of_rank_1_of_2_by_hand():
    """vLLM's fused experts in checkpoint format: w13 [E, 2 I/tp, H] as [E * 2 I/tp, H] (per
    expert this rank's gate rows, then its up rows), w2 [E, H, I/tp] as [E * H, I/tp]."""
    moe = Shapes(
        hidden=8,
        intermediate=8,
        heads=4,
        kv_heads=2,
        head_dim=2,
        vocab=100,
        experts=3,
        expert_intermediate=4,
    )
    p = "model.layers.0.mlp.experts"
    names = [
        f"{p}.routed_experts.w13_weight",
        f"{p}.routed_experts.w2_weight",
        "model.layers.0.mlp.gate.weight",
    ]
    layout = worker_layout("Qwen3MoeForCausalLM", names, moe, Split(1, 2), 1, "float32")
    w13, w2 = names[:2]
    assert layout.local_shapes[w13] == (3 * 2 * 2, 8) and layout.local_shapes[w2] == (3 * 8, 2)
    assert pieces(layout, w13)[2:4] == [
        (f"{p}.1.gate_proj.weight", ((2, 4), (0, 8)), (4, 0)),
        (f"{p}.1.up_proj.weight", ((2, 4), (0, 8)), (6, 0)),
    ]
    assert pieces(layout, w2)[2] == (f"{p}.2.down_proj.weight", ((0, 8), (2, 4)), (16, 0))
    assert pieces(layout, names[2]) == [(names[2], ((0, 3), (0, 8)), (0, 0))]


def test_a_parameter_no_rule_names_is_an_error():
    names = vllm_names(1) + ["model.layers.0.self_attn.rotary.inv_freq"]
    with pytest.raises(ValueError, match="no layout rule for parameters.*rotary.inv_freq"):
        worker_layout("LlamaForCausalLM", names, SHAPES, Split(0, 1), 0, "float32")
    with pytest.raises(ValueError, match="no tandem layout table.*GPT2LMHeadModel"):
        worker_layout("GPT2LMHeadModel", names, SHAPES, Split(0, 1), 0, "float32")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_rank_together_holds_every_tensor_of_the_hf_model(family, tp):
    """Each canonical element is held by as many ranks as vLLM keeps copies of it: once for a
    split tensor, ``tp`` times for a replicated one (norms; kv heads when ranks outnumber
    them), and the names and shapes are transformers' own."""
    cls, cfg, model_class = {
        "llama": (LlamaForCausalLM, LlamaConfig, "LlamaForCausalLM"),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config, "Qwen2ForCausalLM"),
    }[family]
    config = cfg(
        hidden_size=8,
        intermediate_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=100,
        tie_word_embeddings=False,
    )
    hf = {n: tuple(t.shape) for n, t in cls(config).state_dict().items()}
    names = vllm_names(2, bias=family == "qwen2")
    copies: dict[str, torch.Tensor] = {n: torch.zeros(s, dtype=torch.int32) for n, s in hf.items()}
    for rank in range(tp):
        layout = worker_layout(
            model_class, names, Shapes.of(config), Split(rank, tp), rank, "float32"
        )
        assert layout.canonical_shapes().items() <= hf.items()
        for region in layout.regions:
            copies[region.piece.name][region.piece.box_slices()] += 1
            local = region.piece.region().view(torch.empty(layout.local_shapes[region.key]))
            assert tuple(local.shape) == region.piece.box_shape
    for name, count in copies.items():
        if "norm" in name:
            expected = tp
        elif tp > 2 and ("k_proj" in name or "v_proj" in name):  # 2 kv heads
            expected = tp // 2
        else:
            expected = 1
        assert (count == expected).all(), name
