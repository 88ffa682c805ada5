"""Layouts of Megatron-core GPT checkpoints (tensor-parallel ranks), as boxes of HF Llama tensors.

The map is a table: each Megatron name template (``{i}`` for the layer) maps to one kind of
layout, a small dataclass that knows its local shape and pieces on TP rank ``r`` of ``T``. Keys
are matched exactly (the layer number is the only variable part); unknown keys are errors. A
new trainer is one more table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from tandem.exchange.adapters.hf import dtype_name
from tandem.exchange.layout import LayoutMismatch, RankLayout
from tandem.layers.placement import Piece, cols, rows, whole


@dataclass(frozen=True, slots=True)
class MegatronLlamaConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    padded_vocab: int  # rows of the embedding and output layer (vocab rounded up)
    layers: int
    positions: int = 0  # learned absolute position embeddings (GPT-2 style), else 0

    @property
    def attention(self) -> int:
        """Features of all heads together (q_proj's rows, o_proj's columns)."""
        return self.heads * self.head_dim

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) not a multiple of kv_heads ({self.kv_heads})")
        if self.padded_vocab < self.vocab:
            raise ValueError(f"padded_vocab ({self.padded_vocab}) < vocab ({self.vocab})")


@dataclass(frozen=True, slots=True)
class TPRank:
    """Which TP rank this is, with the checked per-rank sizes."""

    cfg: MegatronLlamaConfig
    rank: int
    size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} outside [0, {self.size})")

    def split(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what} ({total}) not divisible by tensor parallel size {self.size}")
        return total // self.size


Layout = tuple[tuple[int, ...], list[Piece]]  # (local shape, pieces)


class Kind(Protocol):
    """One table entry: the local shape and pieces of a Megatron tensor on a TP rank (None for
    entries that are not weights)."""

    def layout(self, s: TPRank, layer: int | None) -> Layout | None: ...


@dataclass(frozen=True, slots=True)
class Whole:
    """Replicated on every TP rank (norm weights); ``size`` names the config field of its length."""

    name: str
    size: str = "hidden"

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        shape = (getattr(s.cfg, self.size),)
        return shape, [whole(_fmt(self.name, layer), shape)]


@dataclass(frozen=True, slots=True)
class VocabRows:
    """Padded vocab rows split evenly; rows past the real vocab hold nothing canonical."""

    name: str

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        per_rank = s.split(s.cfg.padded_vocab, "padded_vocab")
        start = s.rank * per_rank
        stop = min(start + per_rank, s.cfg.vocab)
        full = (s.cfg.vocab, s.cfg.hidden)
        pieces = [rows(_fmt(self.name, layer), full, start, stop)] if start < stop else []
        return (per_rank, s.cfg.hidden), pieces


@dataclass(frozen=True, slots=True)
class GroupedQKV:
    """Fused q/k/v grouped by kv head: for each local kv group g, [its q heads; k head g; v
    head g]. Weights are rows of [*, hidden]; with ``bias`` the tensors are 1-D."""

    q: str
    k: str
    v: str
    bias: bool = False

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        c = s.cfg
        kv_per_rank = s.split(c.kv_heads, "kv_heads")
        q_per_group = c.heads // c.kv_heads
        trailing = () if self.bias else (c.hidden,)
        q_full = (c.heads * c.head_dim, *trailing)
        kv_full = (c.kv_heads * c.head_dim, *trailing)
        q, k, v = (_fmt(n, layer) for n in (self.q, self.k, self.v))
        pieces, at = [], 0
        for g in range(kv_per_rank):
            head = s.rank * kv_per_rank + g
            q0 = head * q_per_group * c.head_dim
            q_rows = q_per_group * c.head_dim
            pieces.append(rows(q, q_full, q0, q0 + q_rows, at))
            at += q_rows
            for name in (k, v):
                pieces.append(rows(name, kv_full, head * c.head_dim, (head + 1) * c.head_dim, at))
                at += c.head_dim
        return (at, *trailing), pieces


@dataclass(frozen=True, slots=True)
class StackedRows:
    """Column-parallel fused outputs: this rank's shard of each name in turn ([gate_r; up_r]).
    Each name has ``size`` rows (a config field); weights have ``hidden`` columns, biases none."""

    names: tuple[str, ...]
    size: str = "intermediate"
    bias: bool = False

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        total = getattr(s.cfg, self.size)
        local = s.split(total, self.size)
        trailing = () if self.bias else (s.cfg.hidden,)
        pieces = [
            rows(
                _fmt(n, layer), (total, *trailing), s.rank * local, (s.rank + 1) * local, i * local
            )
            for i, n in enumerate(self.names)
        ]
        return (local * len(self.names), *trailing), pieces


@dataclass(frozen=True, slots=True)
class InputColumns:
    """Row-parallel weight [hidden, in]: input columns split; ``size`` names ``in``."""

    name: str
    size: str

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        total = getattr(s.cfg, self.size)
        local = s.split(total, self.size)
        piece = cols(
            _fmt(self.name, layer), (s.cfg.hidden, total), s.rank * local, (s.rank + 1) * local
        )
        return (s.cfg.hidden, local), [piece]


@dataclass(frozen=True, slots=True)
class Skip:
    """Not a weight (Transformer Engine's ``_extra_state``)."""

    def layout(self, s: TPRank, layer: int | None) -> None:
        return None


@dataclass(frozen=True, slots=True)
class WholeMatrix:
    """A 2-D tensor replicated on every TP rank (learned position embeddings); its shape is
    two config fields."""

    name: str
    rows: str
    cols: str

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        shape = (getattr(s.cfg, self.rows), getattr(s.cfg, self.cols))
        return shape, [whole(_fmt(self.name, layer), shape)]


@dataclass(frozen=True, slots=True)
class FusedQKVColumns:
    """Megatron's fused qkv (rows [q_h; k_h; v_h] per local head, MHA) against a canonical
    GPT-2 ``c_attn`` that holds q | k | v as column blocks of one [hidden, 3 * hidden] Conv1D
    weight (the local rows are that box transposed), or of one bias vector."""

    name: str
    bias: bool = False

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        c = s.cfg
        if c.kv_heads != c.heads:
            raise ValueError(f"fused c_attn needs one kv head per head, got {c.kv_heads}")
        heads = s.split(c.heads, "heads")
        name, width = _fmt(self.name, layer), c.attention
        full = (3 * width,) if self.bias else (c.hidden, 3 * width)
        pieces, at = [], 0
        for g in range(heads):
            head = s.rank * heads + g
            for block in range(3):  # q, k, v of this head
                c0 = block * width + head * c.head_dim
                if self.bias:
                    pieces.append(rows(name, full, c0, c0 + c.head_dim, at))
                else:
                    box = ((0, c.hidden), (c0, c0 + c.head_dim))
                    pieces.append(Piece(name, full, box, (at, 0), transposed=True))
                at += c.head_dim
        return ((at,) if self.bias else (at, c.hidden)), pieces


@dataclass(frozen=True, slots=True)
class Conv1DShard:
    """A GPT-2 ``Conv1D`` weight, stored [in, out] in the canonical tensor and [out, in] in
    Megatron: the local tensor is this rank's box, transposed. ``split``: ``out`` (column
    parallel) or ``in`` (row parallel); ``inp`` / ``out`` name the config fields."""

    name: str
    inp: str
    out: str
    split: str

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        n_in, n_out = getattr(s.cfg, self.inp), getattr(s.cfg, self.out)
        if self.split == "out":
            local = s.split(n_out, self.out)
            box, shape = ((0, n_in), (s.rank * local, (s.rank + 1) * local)), (local, n_in)
        else:
            local = s.split(n_in, self.inp)
            box, shape = ((s.rank * local, (s.rank + 1) * local), (0, n_out)), (n_out, local)
        return shape, [Piece(_fmt(self.name, layer), (n_in, n_out), box, (0, 0), True)]


@dataclass(frozen=True, slots=True)
class SplitVector:
    """A column-parallel bias: this rank's rows of a ``size`` vector."""

    name: str
    size: str

    def layout(self, s: TPRank, layer: int | None) -> Layout:
        total = getattr(s.cfg, self.size)
        local = s.split(total, self.size)
        piece = rows(_fmt(self.name, layer), (total,), s.rank * local, (s.rank + 1) * local)
        return (local,), [piece]


def _fmt(name: str, layer: int | None) -> str:
    return name if layer is None else name.format(i=layer)


_L = "decoder.layers.{i}"
_HF = "model.layers.{i}"

GPT_TO_LLAMA: dict[str, Kind] = {
    "embedding.word_embeddings.weight": VocabRows("model.embed_tokens.weight"),
    f"{_L}.self_attention.linear_qkv.weight": GroupedQKV(
        f"{_HF}.self_attn.q_proj.weight",
        f"{_HF}.self_attn.k_proj.weight",
        f"{_HF}.self_attn.v_proj.weight",
    ),
    f"{_L}.self_attention.linear_qkv.bias": GroupedQKV(
        f"{_HF}.self_attn.q_proj.bias",
        f"{_HF}.self_attn.k_proj.bias",
        f"{_HF}.self_attn.v_proj.bias",
        bias=True,
    ),
    f"{_L}.self_attention.linear_qkv.layer_norm_weight": Whole(f"{_HF}.input_layernorm.weight"),
    f"{_L}.input_layernorm.weight": Whole(f"{_HF}.input_layernorm.weight"),
    f"{_L}.self_attention.q_layernorm.weight": Whole(f"{_HF}.self_attn.q_norm.weight", "head_dim"),
    f"{_L}.self_attention.k_layernorm.weight": Whole(f"{_HF}.self_attn.k_norm.weight", "head_dim"),
    f"{_L}.self_attention.linear_proj.weight": InputColumns(
        f"{_HF}.self_attn.o_proj.weight", "attention"
    ),
    f"{_L}.self_attention.linear_proj.bias": Whole(f"{_HF}.self_attn.o_proj.bias"),
    f"{_L}.mlp.linear_fc1.weight": StackedRows(
        (f"{_HF}.mlp.gate_proj.weight", f"{_HF}.mlp.up_proj.weight")
    ),
    f"{_L}.mlp.linear_fc1.bias": StackedRows(
        (f"{_HF}.mlp.gate_proj.bias", f"{_HF}.mlp.up_proj.bias"), bias=True
    ),
    f"{_L}.mlp.linear_fc1.layer_norm_weight": Whole(f"{_HF}.post_attention_layernorm.weight"),
    f"{_L}.pre_mlp_layernorm.weight": Whole(f"{_HF}.post_attention_layernorm.weight"),
    f"{_L}.mlp.linear_fc2.weight": InputColumns(f"{_HF}.mlp.down_proj.weight", "intermediate"),
    f"{_L}.mlp.linear_fc2.bias": Whole(f"{_HF}.mlp.down_proj.bias"),
    f"{_L}.self_attention.linear_qkv._extra_state": Skip(),
    f"{_L}.self_attention.linear_proj._extra_state": Skip(),
    f"{_L}.self_attention.core_attention._extra_state": Skip(),
    f"{_L}.mlp.linear_fc1._extra_state": Skip(),
    f"{_L}.mlp.linear_fc2._extra_state": Skip(),
    "decoder.final_layernorm.weight": Whole("model.norm.weight"),
    "output_layer.weight": VocabRows("lm_head.weight"),
}


_G = "transformer.h.{i}"

# GPT-2 style: learned absolute positions, LayerNorm with bias, plain GELU MLP, biases
# everywhere, HF Conv1D weights ([in, out]), output tied to the embedding.
GPT_TO_GPT2: dict[str, Kind] = {
    "embedding.word_embeddings.weight": VocabRows("transformer.wte.weight"),
    "embedding.position_embeddings.weight": WholeMatrix(
        "transformer.wpe.weight", "positions", "hidden"
    ),
    f"{_L}.input_layernorm.weight": Whole(f"{_G}.ln_1.weight"),
    f"{_L}.input_layernorm.bias": Whole(f"{_G}.ln_1.bias"),
    f"{_L}.self_attention.linear_qkv.layer_norm_weight": Whole(f"{_G}.ln_1.weight"),
    f"{_L}.self_attention.linear_qkv.layer_norm_bias": Whole(f"{_G}.ln_1.bias"),
    f"{_L}.self_attention.linear_qkv.weight": FusedQKVColumns(f"{_G}.attn.c_attn.weight"),
    f"{_L}.self_attention.linear_qkv.bias": FusedQKVColumns(f"{_G}.attn.c_attn.bias", bias=True),
    f"{_L}.self_attention.linear_proj.weight": Conv1DShard(
        f"{_G}.attn.c_proj.weight", "attention", "hidden", "in"
    ),
    f"{_L}.self_attention.linear_proj.bias": Whole(f"{_G}.attn.c_proj.bias"),
    f"{_L}.pre_mlp_layernorm.weight": Whole(f"{_G}.ln_2.weight"),
    f"{_L}.pre_mlp_layernorm.bias": Whole(f"{_G}.ln_2.bias"),
    f"{_L}.mlp.linear_fc1.layer_norm_weight": Whole(f"{_G}.ln_2.weight"),
    f"{_L}.mlp.linear_fc1.layer_norm_bias": Whole(f"{_G}.ln_2.bias"),
    f"{_L}.mlp.linear_fc1.weight": Conv1DShard(
        f"{_G}.mlp.c_fc.weight", "hidden", "intermediate", "out"
    ),
    f"{_L}.mlp.linear_fc1.bias": SplitVector(f"{_G}.mlp.c_fc.bias", "intermediate"),
    f"{_L}.mlp.linear_fc2.weight": Conv1DShard(
        f"{_G}.mlp.c_proj.weight", "intermediate", "hidden", "in"
    ),
    f"{_L}.mlp.linear_fc2.bias": Whole(f"{_G}.mlp.c_proj.bias"),
    **{k: v for k, v in GPT_TO_LLAMA.items() if isinstance(v, Skip)},
    "decoder.final_layernorm.weight": Whole("transformer.ln_f.weight"),
    "decoder.final_layernorm.bias": Whole("transformer.ln_f.bias"),
}


def megatron_layout(
    state_dict_shapes: Mapping[str, tuple[int, ...] | None],
    cfg: MegatronLlamaConfig,
    tp_rank: int,
    tp_size: int,
    rank: int,
    *,
    layer_offset: int = 0,
    dtype: str = "bfloat16",
    table: Mapping[str, Kind] = GPT_TO_LLAMA,
) -> RankLayout:
    """The boxes TP rank ``tp_rank`` of ``tp_size`` holds, as sender ``rank`` of the plan.

    Keys are the Megatron names with their local shapes (checked against the config). On a
    pipeline stage, local layer ``j`` is canonical layer ``layer_offset + j``. Every unknown
    key and every shape problem is listed in one `LayoutMismatch`."""
    shard = TPRank(cfg, tp_rank, tp_size)
    layout = RankLayout(rank, dtype=dtype)
    unknown, problems = [], []
    for key, shape in state_dict_shapes.items():
        template, layer = _template(key)
        kind = table.get(template)
        if kind is None:
            unknown.append(key)
            continue
        if layer is not None:
            layer += layer_offset
            if not 0 <= layer < cfg.layers:
                problems.append(f"{key}: layer {layer} outside the model's {cfg.layers}")
                continue
        made = kind.layout(shard, layer)
        if made is None:
            continue
        local_shape, pieces = made
        if shape is None or tuple(shape) != local_shape:
            problems.append(f"{key}: local shape {shape}, config expects {local_shape}")
            continue
        layout.add(key, local_shape, pieces)
    if unknown:
        problems.insert(0, f"unknown Megatron tensors {unknown}; known: {sorted(table)}")
    if problems:
        raise LayoutMismatch(problems)
    return layout


def _template(key: str) -> tuple[str, int | None]:
    """``decoder.layers.3.mlp...`` -> (``decoder.layers.{i}.mlp...``, 3)."""
    parts = key.split(".")
    numbers = [i for i, p in enumerate(parts) if p.isdigit()]
    if len(numbers) != 1:
        return key, None
    (at,) = numbers
    return ".".join(parts[:at] + ["{i}"] + parts[at + 1 :]), int(parts[at])


def is_megatron_module(model) -> bool:
    """A megatron-core model, possibly wrapped (DDP, Float16Module: ``.module``)."""
    return type(unwrap_megatron(model)).__module__.startswith("megatron.core")


def unwrap_megatron(model):
    """The model inside DDP / Float16Module-style wrappers (each keeps it as ``.module``)."""
    while not type(model).__module__.startswith("megatron.core.models") and hasattr(
        model, "module"
    ):
        model = model.module
    return model


def megatron_module_layout(
    model, rank: int, *, vocab_size: int | None = None, table: Mapping[str, Kind] | None = None
) -> tuple[RankLayout, dict]:
    """(this rank's layout, its local tensors by layout key) for a live megatron-core
    ``GPTModel`` (wrapped or not): its TP rank and size come from
    ``megatron.core.parallel_state``, its pipeline stage's first global layer from its layers'
    ``layer_number``, the sizes from its ``TransformerConfig``. ``vocab_size`` is the real
    vocabulary (default: the model's, i.e. unpadded); rows past it are never sent. A tied output
    layer is not sent (it is the embedding). ``table`` defaults by architecture: `GPT_TO_GPT2`
    for learned absolute positions, else `GPT_TO_LLAMA`."""
    from megatron.core import parallel_state

    module = unwrap_megatron(model)
    c = module.config
    padded = module.vocab_size
    cfg = MegatronLlamaConfig(
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        kv_heads=c.num_query_groups or c.num_attention_heads,
        head_dim=c.kv_channels or c.hidden_size // c.num_attention_heads,
        intermediate=c.ffn_hidden_size,
        vocab=padded if vocab_size is None else vocab_size,
        padded_vocab=padded,
        layers=c.num_layers,
        positions=module.max_sequence_length,
    )
    if table is None:
        learned = getattr(module, "position_embedding_type", None) == "learned_absolute"
        table = GPT_TO_GPT2 if learned else GPT_TO_LLAMA
    layers = module.decoder.layers
    offset = layers[0].layer_number - 1 if len(layers) else 0
    tensors = dict(module.named_parameters())
    if getattr(module, "share_embeddings_and_output_weights", False):
        tensors.pop("output_layer.weight", None)  # a copy of the embedding on the last stage
    dtype = dtype_name(list(tensors.items()))
    layout = megatron_layout(
        {k: tuple(t.shape) for k, t in tensors.items()},
        cfg,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        rank,
        layer_offset=offset,
        dtype=dtype,
        table=table,
    )
    return layout, tensors
