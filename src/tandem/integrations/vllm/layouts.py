"""What each vLLM worker holds, as canonical (Hugging Face) boxes: one declared table per vLLM
model class.

vLLM keeps its parameters in its own layouts: q, k and v fused into ``qkv_proj``, gate and up
into ``gate_up_proj``, every column-parallel weight split by rows over its tensor-parallel
ranks and every row-parallel one by columns, fewer kv heads than ranks replicated, the
vocabulary padded to a multiple of 64 and then split. A `Rule` says, for one vLLM parameter
name, which canonical boxes a rank holds and where they sit in its local tensor (in the
checkpoint format vLLM's weight loaders fill; its CPU build repacks linear weights after
that). `worker_layout` applies a class's rules to a worker's parameters: a parameter no rule
names is an error, so a vLLM model class that grows a parameter cannot be half-updated
silently.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tandem.exchange.layout import RankLayout
from tandem.layers.placement import Piece, cols, rows, whole

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)


@dataclass(frozen=True, slots=True)
class Shapes:
    """The model's sizes a layout needs, read from its Hugging Face config."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    expert_intermediate: int = 0

    @classmethod
    def of(cls, hf_config) -> Shapes:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(
            hf_config.hidden_size,
            hf_config.intermediate_size,
            heads,
            getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim,
            hf_config.vocab_size,
            getattr(hf_config, "num_experts", None) or 0,
            getattr(hf_config, "moe_intermediate_size", None) or 0,
        )


@dataclass(frozen=True, slots=True)
class Split:
    """One worker's place in its tensor-parallel group."""

    rank: int
    size: int


# (canonical name prefix, shapes, split) -> (local shape, pieces)
Builder = Callable[[str, Shapes, Split], tuple[tuple[int, ...], list[Piece]]]


@dataclass(frozen=True, slots=True)
class Rule:
    """vLLM parameters matching ``pattern`` (a regex over the full name, whose groups fill
    ``canonical``'s ``{}``) hold the boxes ``build`` declares."""

    pattern: str
    canonical: str
    build: Builder


def _kv_heads(s: Shapes, tp: Split) -> tuple[int, int]:
    """(kv heads on this rank, the first one): vLLM replicates kv heads when the group has more
    ranks than kv heads (QKVParallelLinear: ``num_kv_head_replicas``)."""
    if s.kv_heads >= tp.size:
        if s.kv_heads % tp.size:
            raise ValueError(
                f"num_key_value_heads ({s.kv_heads}) not divisible by "
                f"tensor_parallel_size ({tp.size})"
            )
        per = s.kv_heads // tp.size
        return per, tp.rank * per
    if tp.size % s.kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp.size}) not a multiple of num_key_value_heads ({s.kv_heads})"
        )
    return 1, tp.rank // (tp.size // s.kv_heads)


def _per_rank(total: int, tp: Split, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"{what} ({total}) not divisible by tensor_parallel_size ({tp.size})")
    return total // tp.size


def qkv(suffix: str) -> Builder:
    """``qkv_proj``: this rank's q heads, then its k heads, then its v heads, as rows."""

    def build(prefix: str, s: Shapes, tp: Split):
        q = _per_rank(s.heads, tp, "num_attention_heads") * s.head_dim
        kv_count, kv_first = _kv_heads(s, tp)
        kv = kv_count * s.head_dim
        full_q, full_kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        trailing = (s.hidden,) if suffix == "weight" else ()
        sections = [
            ("q_proj", full_q, tp.rank * q, q, 0),
            ("k_proj", full_kv, kv_first * s.head_dim, kv, q),
            ("v_proj", full_kv, kv_first * s.head_dim, kv, q + kv),
        ]
        pieces = [
            rows(f"{prefix}.{name}.{suffix}", (full, *trailing), start, start + n, at)
            for name, full, start, n, at in sections
        ]
        return (q + 2 * kv, *trailing), pieces

    return build


def merged_rows(*names: str, suffix: str = "weight") -> Builder:
    """A merged column-parallel linear (``gate_up_proj``): each canonical tensor's rows split
    over the ranks, stacked in order."""

    def build(prefix: str, s: Shapes, tp: Split):
        n = _per_rank(s.intermediate, tp, "intermediate_size")
        pieces = [
            rows(
                f"{prefix}.{name}.{suffix}",
                (s.intermediate, s.hidden),
                tp.rank * n,
                (tp.rank + 1) * n,
                i * n,
            )
            for i, name in enumerate(names)
        ]
        return (len(names) * n, s.hidden), pieces

    return build


def row_parallel(in_features: Callable[[Shapes], int]) -> Builder:
    """A row-parallel linear (``o_proj``, ``down_proj``): input columns split over the ranks."""

    def build(name: str, s: Shapes, tp: Split):
        full = in_features(s)
        n = _per_rank(full, tp, f"{name} input features")
        return (s.hidden, n), [cols(name, (s.hidden, full), tp.rank * n, (tp.rank + 1) * n)]

    return build


def vocab_rows(name: str, s: Shapes, tp: Split):
    """VocabParallelEmbedding / ParallelLMHead: the vocabulary padded to a multiple of 64,
    split evenly; the last ranks' padding rows hold no canonical box."""
    padded = -(-s.vocab // VOCAB_PADDING) * VOCAB_PADDING
    per = padded // tp.size
    start = min(tp.rank * per, s.vocab)
    stop = min(start + per, s.vocab)
    return (per, s.hidden), ([rows(name, (s.vocab, s.hidden), start, stop)] if stop > start else [])


def replicated(size: Callable[[Shapes], int]) -> Builder:
    def build(name: str, s: Shapes, tp: Split):
        shape = (size(s),)
        return shape, [whole(name, shape)]

    return build


def _hidden(s: Shapes) -> int:
    return s.hidden


def router(name: str, s: Shapes, tp: Split):
    """A MoE layer's router (``mlp.gate``, a replicated linear): whole on every rank."""
    return (s.experts, s.hidden), [whole(name, (s.experts, s.hidden))]


def expert_gate_up(prefix: str, s: Shapes, tp: Split):
    """vLLM's ``w13_weight`` [E, 2 I/tp, H] in checkpoint format, seen as [E * 2 I/tp, H]:
    per expert this rank's gate rows, then its up rows (vLLM's CPU build then pads and
    prepacks it; `tandem.integrations.vllm.receiver` does the same at commit)."""
    n = _per_rank(s.expert_intermediate, tp, "moe_intermediate_size")
    full = (s.expert_intermediate, s.hidden)
    halves = list(enumerate(("gate_proj", "up_proj")))
    pieces = [
        rows(f"{prefix}.{e}.{name}.weight", full, tp.rank * n, (tp.rank + 1) * n, (2 * e + i) * n)
        for e in range(s.experts)
        for i, name in halves
    ]
    return (s.experts * 2 * n, s.hidden), pieces


def expert_down(prefix: str, s: Shapes, tp: Split):
    """vLLM's ``w2_weight`` [E, H, I/tp] in checkpoint format, seen as [E * H, I/tp]: per
    expert this rank's input columns of ``down_proj``."""
    n = _per_rank(s.expert_intermediate, tp, "moe_intermediate_size")
    full = (s.hidden, s.expert_intermediate)
    pieces = [
        Piece(
            f"{prefix}.{e}.down_proj.weight",
            full,
            ((0, s.hidden), (tp.rank * n, (tp.rank + 1) * n)),
            (e * s.hidden, 0),
        )
        for e in range(s.experts)
    ]
    return (s.experts * s.hidden, n), pieces


LAYER = r"model\.layers\.(\d+)"
DENSE_DECODER = (
    Rule(r"model\.embed_tokens\.weight", "model.embed_tokens.weight", vocab_rows),
    Rule(LAYER + r"\.self_attn\.qkv_proj\.weight", "model.layers.{}.self_attn", qkv("weight")),
    Rule(LAYER + r"\.self_attn\.o_proj\.weight", "model.layers.{}.self_attn.o_proj.weight",
         row_parallel(lambda s: s.heads * s.head_dim)),
    Rule(LAYER + r"\.mlp\.gate_up_proj\.weight", "model.layers.{}.mlp",
         merged_rows("gate_proj", "up_proj")),
    Rule(LAYER + r"\.mlp\.down_proj\.weight", "model.layers.{}.mlp.down_proj.weight",
         row_parallel(lambda s: s.intermediate)),
    Rule(LAYER + r"\.(input_layernorm|post_attention_layernorm)\.weight",
         "model.layers.{}.{}.weight", replicated(_hidden)),
    Rule(r"model\.norm\.weight", "model.norm.weight", replicated(_hidden)),
    Rule(r"lm_head\.weight", "lm_head.weight", vocab_rows),
)  # fmt: skip
QKV_BIAS = (Rule(LAYER + r"\.self_attn\.qkv_proj\.bias", "model.layers.{}.self_attn", qkv("bias")),)
QK_NORM = (
    Rule(
        LAYER + r"\.self_attn\.(q_norm|k_norm)\.weight",
        "model.layers.{}.self_attn.{}.weight",
        replicated(lambda s: s.head_dim),
    ),
)

# a MoE block in place of the dense MLP (vllm/model_executor/models/qwen3_moe.py)
MOE_BLOCK = (
    Rule(LAYER + r"\.mlp\.gate\.weight", "model.layers.{}.mlp.gate.weight", router),
    Rule(LAYER + r"\.mlp\.experts\.routed_experts\.w13_weight", "model.layers.{}.mlp.experts",
         expert_gate_up),
    Rule(LAYER + r"\.mlp\.experts\.routed_experts\.w2_weight", "model.layers.{}.mlp.experts",
         expert_down),
)  # fmt: skip

# vLLM model class -> its rules (vllm/model_executor/models/{llama,qwen2,qwen3,qwen3_moe}.py)
TABLES: dict[str, tuple[Rule, ...]] = {
    "LlamaForCausalLM": DENSE_DECODER,
    "Qwen2ForCausalLM": DENSE_DECODER + QKV_BIAS,
    "Qwen3ForCausalLM": DENSE_DECODER + QK_NORM,
    "Qwen3MoeForCausalLM": DENSE_DECODER + QK_NORM + MOE_BLOCK,
}


def worker_layout(
    model_class: str, names: list[str], shapes: Shapes, tp: Split, rank: int, dtype: str
) -> RankLayout:
    """The layout of one worker (``rank`` across the target) whose vLLM parameters are
    ``names``; ValueError naming every parameter the class's table does not cover."""
    rules = TABLES.get(model_class)
    if rules is None:
        raise ValueError(
            f"no tandem layout table for vLLM model class {model_class!r} "
            f"(tables: {sorted(TABLES)})"
        )
    compiled = [(re.compile(rule.pattern), rule) for rule in rules]
    layout = RankLayout(rank, dtype=dtype)
    unknown = []
    for name in names:
        for pattern, rule in compiled:
            match = pattern.fullmatch(name)
            if match:
                local_shape, pieces = rule.build(rule.canonical.format(*match.groups()), shapes, tp)
                layout.add(name, local_shape, pieces)
                break
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"vLLM {model_class}: no layout rule for parameters {unknown}")
    return layout
