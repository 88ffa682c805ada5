"""Metadata-only layouts of a 1T-parameter MoE for the planner benchmark (no tensors).

Trainer: PP x EP (Megatron-style), experts grouped per EP rank, dense tensors replicated on a
stage's EP ranks. Engine: experts EP x expert-TP, attention TP x DP, vocab rows split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.exchange.layout import RankLayout
from tandem.layers.placement import Piece, cols, rows, whole


@dataclass(frozen=True, slots=True)
class MoEShape:
    """A DeepSeek/Kimi-like MoE, as metadata only.

    Trainer: ``pp`` pipeline stages x ``ep`` expert-parallel ranks (rank = stage * ep + ep
    rank, no tensor parallelism, Megatron-style). A stage holds a contiguous run of layers
    (stage 0 the embedding too, the last stage the final norm and the LM head); its dense
    tensors (attention, norms, router) are replicated on its ``ep`` ranks (they are the data
    parallel ranks of the dense layers); ep rank e holds experts [e * E / ep, (e + 1) * E / ep)
    of each of its layers as two grouped local tensors, ``w13`` ([gate_j; up_j] stacked) and
    ``w2`` (down_j side by side), as Megatron's grouped MLP does.

    Engine: ``experts * expert_tp`` ranks, one model instance with every layer on every rank.
    Experts: rank r holds half r % expert_tp of the intermediate dim of expert r // expert_tp
    (fused gate_up rows, down columns). Attention: tensor parallel over ``attn_tp`` ranks (q, k,
    v rows by heads in one fused qkv tensor; o_proj columns), repeated over ranks / attn_tp
    data-parallel groups; embedding and LM head vocab rows split the same way; norms and the
    router replicated on every rank."""

    layers: int = 61
    experts: int = 256
    hidden: int = 7168
    expert_intermediate: int = 3072
    heads: int = 56
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 163840
    pp: int = 16
    ep: int = 64
    expert_tp: int = 2
    attn_tp: int = 8

    @property
    def trainer_ranks(self) -> int:
        return self.pp * self.ep

    @property
    def engine_ranks(self) -> int:
        return self.experts * self.expert_tp

    def dense(self, layer: int) -> dict[str, tuple[int, ...]]:
        p, h = f"model.layers.{layer}", self.hidden
        return {
            f"{p}.self_attn.q_proj.weight": (self.heads * self.head_dim, h),
            f"{p}.self_attn.k_proj.weight": (self.kv_heads * self.head_dim, h),
            f"{p}.self_attn.v_proj.weight": (self.kv_heads * self.head_dim, h),
            f"{p}.self_attn.o_proj.weight": (h, self.heads * self.head_dim),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate.weight": (self.experts, h),
        }

    def expert(self, layer: int, x: int) -> dict[str, tuple[int, int]]:
        p, h, i = f"model.layers.{layer}.mlp.experts.{x}", self.hidden, self.expert_intermediate
        return {
            f"{p}.gate_proj.weight": (i, h),
            f"{p}.up_proj.weight": (i, h),
            f"{p}.down_proj.weight": (h, i),
        }

    def params(self) -> int:
        per_layer = sum(math.prod(s) for s in self.dense(0).values())
        per_expert = 3 * self.hidden * self.expert_intermediate
        embeddings = 2 * self.vocab * self.hidden + self.hidden  # embedding, LM head, final norm
        return self.layers * (per_layer + self.experts * per_expert) + embeddings

    def stages(self) -> list[range]:
        base, extra = divmod(self.layers, self.pp)
        out, at = [], 0
        for stage in range(self.pp):
            n = base + (stage < extra)
            out.append(range(at, at + n))
            at += n
        return out


FULL_MOE = MoEShape()
QUICK_MOE = MoEShape(
    layers=4,
    experts=16,
    hidden=512,
    expert_intermediate=256,
    heads=8,
    kv_heads=4,
    head_dim=64,
    vocab=4096,
    pp=2,
    ep=4,
    expert_tp=2,
    attn_tp=4,
)


def moe_layouts(m: MoEShape) -> tuple[list[RankLayout], list[RankLayout]]:
    """(trainer layouts, engine layouts) of ``m``: `RankLayout`s of `Piece`s, no tensors."""
    if m.experts % m.ep or m.expert_intermediate % m.expert_tp or m.heads % m.attn_tp:
        raise ValueError(f"{m}: experts, intermediate or heads do not divide")
    if m.kv_heads % m.attn_tp or m.vocab % m.attn_tp or m.engine_ranks % m.attn_tp:
        raise ValueError(f"{m}: kv heads, vocab or engine ranks do not divide by attn_tp")
    h, i = m.hidden, m.expert_intermediate
    per_ep = m.experts // m.ep
    stages = m.stages()
    senders = []
    for stage, layers in enumerate(stages):
        for e in range(m.ep):
            lay = RankLayout(stage * m.ep + e, dtype="bfloat16")
            for layer in layers:
                for name, shape in m.dense(layer).items():
                    lay.add(name, shape, [whole(name, shape)])
                w13, w2 = [], []
                for j in range(per_ep):
                    gate, up, down = m.expert(layer, e * per_ep + j)
                    w13 += [
                        rows(gate, (i, h), 0, i, 2 * i * j),
                        rows(up, (i, h), 0, i, 2 * i * j + i),
                    ]
                    w2.append(Piece(down, (h, i), ((0, h), (0, i)), (0, i * j)))
                lay.add(f"decoder.layers.{layer}.mlp.experts.w13", (2 * i * per_ep, h), w13)
                lay.add(f"decoder.layers.{layer}.mlp.experts.w2", (h, i * per_ep), w2)
            if stage == 0:
                lay.add(
                    "model.embed_tokens.weight",
                    (m.vocab, h),
                    [whole("model.embed_tokens.weight", (m.vocab, h))],
                )
            if stage == m.pp - 1:
                lay.add("model.norm.weight", (h,), [whole("model.norm.weight", (h,))])
                lay.add("lm_head.weight", (m.vocab, h), [whole("lm_head.weight", (m.vocab, h))])
            senders.append(lay)
    receivers = []
    q_rows, kv_rows = m.heads * m.head_dim // m.attn_tp, m.kv_heads * m.head_dim // m.attn_tp
    half, vocab_rows = i // m.expert_tp, m.vocab // m.attn_tp
    for r in range(m.engine_ranks):
        lay = RankLayout(r, dtype="bfloat16")
        t = r % m.attn_tp
        x, part = divmod(r, m.expert_tp)
        for layer in range(m.layers):
            p = f"model.layers.{layer}"
            q, k, v, o, n1, n2, router = m.dense(layer).items()
            lay.add(
                f"{p}.self_attn.qkv_proj.weight",
                (q_rows + 2 * kv_rows, h),
                [
                    rows(q[0], q[1], t * q_rows, (t + 1) * q_rows, 0),
                    rows(k[0], k[1], t * kv_rows, (t + 1) * kv_rows, q_rows),
                    rows(v[0], v[1], t * kv_rows, (t + 1) * kv_rows, q_rows + kv_rows),
                ],
            )
            lay.add(o[0], (h, q_rows), [cols(o[0], o[1], t * q_rows, (t + 1) * q_rows)])
            for name, shape in (n1, n2, router):
                lay.add(name, shape, [whole(name, shape)])
            gate, up, down = m.expert(layer, x)
            lay.add(
                f"{p}.mlp.experts.gate_up_proj.weight",
                (2 * half, h),
                [
                    rows(gate, (i, h), part * half, (part + 1) * half, 0),
                    rows(up, (i, h), part * half, (part + 1) * half, half),
                ],
            )
            lay.add(
                f"{p}.mlp.experts.down_proj.weight",
                (h, half),
                [cols(down, (h, i), part * half, (part + 1) * half)],
            )
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            lay.add(
                name,
                (vocab_rows, h),
                [rows(name, (m.vocab, h), t * vocab_rows, (t + 1) * vocab_rows)],
            )
        lay.add("model.norm.weight", (h,), [whole("model.norm.weight", (h,))])
        receivers.append(lay)
    return senders, receivers
