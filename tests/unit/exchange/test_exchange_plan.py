"""The weight-exchange planner and the trainer layout adapters, against hand-computed plans.

CPU only, no processes: layouts come from meta-device models, shape tables and DTensors on
device meshes built without a process group; one test moves real data through the plan.
"""

import itertools

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from tandem.exchange import LayoutMismatch, PlanCache, RankLayout, plan_transfers
from tandem.exchange.adapters import (
    MegatronLlamaConfig,
    dtensor_layout,
    engine_layout,
    megatron_layout,
    module_layout,
    shard_box,
)
from tandem.layers.placement import LocalRegion, Piece
from tandem.models.gpt2 import GPT2Config, GPT2LMHeadModel
from tandem.models.llama import LlamaConfig, LlamaForCausalLM
from tandem.models.stages import prune_to_stage, split_layers
from tandem.parallel import TPGroup

# 4 heads of 2, 2 kv heads, vocab 11 (uneven over TP2: rows 0..6 and 6..11)
CFG = LlamaConfig(
    vocab_size=11,
    hidden_size=8,
    intermediate_size=12,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# Megatron TP4 example: 8 heads, 4 kv heads (1 per TP4 rank, 2 per TP2 rank), head_dim 2
MCFG = MegatronLlamaConfig(
    hidden=16, heads=8, kv_heads=4, head_dim=2, intermediate=8, vocab=11, padded_vocab=12, layers=1
)
MLLAMA = LlamaConfig(
    vocab_size=11,
    hidden_size=16,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=4,
)
QKV0 = "layers.0.self_attn.qkv_proj.weight"
MQKV0 = "decoder.layers.0.self_attention.linear_qkv.weight"


GPT2 = GPT2Config(vocab_size=11, n_embd=8, n_layer=1, n_head=2, n_positions=4)


def engine(tp_rank: int, tp_size: int, *, cfg=CFG, rank=None, stage=None) -> RankLayout:
    cls = GPT2LMHeadModel if isinstance(cfg, GPT2Config) else LlamaForCausalLM
    with torch.device("meta"):
        model = cls(cfg, TPGroup(tp_rank, tp_size))
    if stage is not None:
        prune_to_stage(model, stage)
    return engine_layout(model, tp_rank if rank is None else rank)


def canonical_shapes(cfg=CFG) -> dict[str, tuple[int, ...]]:
    return engine(0, 1, cfg=cfg).canonical_shapes()


def moves(plan, dst: int, dst_key: str, name: str) -> list[tuple]:
    """(src, src key, canonical box, src local slices, dst local slices), sorted."""
    out = [
        (
            t.src,
            t.src_key,
            t.box,
            _spans(_local_slices(t.src_piece, t.box)),
            _spans(_local_slices(t.dst_piece, t.box)),
        )
        for t in plan.transfers
        if t.dst == dst and t.dst_key == dst_key and t.name == name
    ]
    return sorted(out)


def _spans(slices) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in slices)


def _volume(box) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def _overlap(a, b) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b, strict=True))


def _inside(inner, outer) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer, strict=True))


def assert_exact_cover(plan, senders: list[RankLayout], receivers: list[RankLayout]) -> None:
    """Every receiver region is tiled by its transfers' boxes: inside it, disjoint, and summing
    to its volume; each transfer reads from a region its sender really has."""
    have = {(lay.rank, r.key, r.piece) for lay in senders for r in lay.regions}
    by_region: dict[tuple, list] = {}
    for t in plan.transfers:
        assert (t.src, t.src_key, t.src_piece) in have
        assert t.src_piece.name == t.dst_piece.name == t.name
        assert _inside(t.box, t.src_piece.box) and _inside(t.box, t.dst_piece.box)
        by_region.setdefault((t.dst, t.dst_key, t.dst_piece), []).append(t.box)
    regions = {(lay.rank, r.key, r.piece) for lay in receivers for r in lay.regions}
    assert set(by_region) <= regions
    for region in regions:
        boxes = by_region.get(region, [])
        for a, b in itertools.combinations(boxes, 2):
            assert not _overlap(a, b), (region, a, b)
        assert sum(map(_volume, boxes)) == _volume(region[2].box), region


# --- data movement: cut full tensors into locals, run the plan with plain indexing -----------


def full_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in sorted(shapes.items())}


def cut(layout: RankLayout, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The local tensors of ``layout`` as the loader would fill them (padding stays zero)."""
    local = {key: torch.zeros(shape) for key, shape in layout.local_shapes.items()}
    for r in layout.regions:
        r.piece.write(local[r.key], full[r.piece.name][r.piece.box_slices()])
    return local


def execute(plan, src: dict[int, dict[str, torch.Tensor]], receivers: list[RankLayout]):
    """Run ``plan`` from the senders' local tensors ``src`` (rank -> key -> tensor)."""
    dst = {lay.rank: {k: torch.zeros(s) for k, s in lay.local_shapes.items()} for lay in receivers}
    for t in plan.transfers:
        value = t.src_piece.region(t.box).view(src[t.src][t.src_key])  # canonical orientation
        t.dst_piece.region(t.box).view(dst[t.dst][t.dst_key]).copy_(value)
    return dst


def _local_slices(piece: Piece, box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in piece.region(box).slices)


def megatron_shapes(cfg: MegatronLlamaConfig, tp: int) -> dict[str, tuple[int, ...] | None]:
    """A TE-style Megatron-core GPT state dict's local shapes on one of ``tp`` ranks."""
    h, d = cfg.hidden, cfg.head_dim
    qkv_rows = (cfg.heads + 2 * cfg.kv_heads) * d // tp
    shapes: dict[str, tuple[int, ...] | None] = {
        "embedding.word_embeddings.weight": (cfg.padded_vocab // tp, h)
    }
    for i in range(cfg.layers):
        p = f"decoder.layers.{i}"
        shapes |= {
            f"{p}.self_attention.linear_qkv.weight": (qkv_rows, h),
            f"{p}.self_attention.linear_qkv.layer_norm_weight": (h,),
            f"{p}.self_attention.linear_qkv._extra_state": None,
            f"{p}.self_attention.linear_proj.weight": (h, cfg.heads * d // tp),
            f"{p}.mlp.linear_fc1.weight": (2 * cfg.intermediate // tp, h),
            f"{p}.mlp.linear_fc1.layer_norm_weight": (h,),
            f"{p}.mlp.linear_fc2.weight": (h, cfg.intermediate // tp),
        }
    shapes["decoder.final_layernorm.weight"] = (h,)
    shapes["output_layer.weight"] = (cfg.padded_vocab // tp, h)
    return shapes


def hf_meta_tensors(cfg) -> dict[str, torch.Tensor]:
    """An HF model's state dict, as shapes only."""
    return {n: torch.empty(s, device="meta") for n, s in canonical_shapes(cfg).items()}


def megatron(tp: int) -> list[RankLayout]:
    return [megatron_layout(megatron_shapes(MCFG, tp), MCFG, r, tp, r) for r in range(tp)]


def mesh(shape: tuple[int, ...], rank: int) -> DeviceMesh:
    """A device mesh seen from ``rank``, without any process group."""
    ranks = torch.arange(torch.Size(shape).numel()).reshape(shape)
    return DeviceMesh("cpu", ranks, _init_backend=False, _rank=rank)


def fsdp_state_dict(cfg, world: int, rank: int) -> dict[str, DTensor]:
    """FSDP2's view of an HF-named model: every parameter Shard(0) over ``world`` ranks."""
    m = mesh((world,), rank)
    out = {}
    for name, shape in canonical_shapes(cfg).items():
        (start, stop), *_ = shard_box(shape, [Shard(0)], (world,), (rank,))
        local = torch.empty((stop - start, *shape[1:]), device="meta")
        stride = torch.empty(shape, device="meta").stride()
        out[name] = DTensor.from_local(
            local, m, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    return out


def fsdp(cfg, world: int, first_rank: int = 0) -> list[RankLayout]:
    return [dtensor_layout(fsdp_state_dict(cfg, world, r), first_rank + r) for r in range(world)]


# --- tandem TP resharding ---------------------------------------------------------------------


def test_tp2_to_tp1_gathers_each_shard_from_its_rank():
    senders, receivers = [engine(0, 2), engine(1, 2)], [engine(0, 1)]
    plan = plan_transfers(senders, receivers)
    assert_exact_cover(plan, senders, receivers)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert moves(plan, 0, QKV0, q) == [
        (0, QKV0, ((0, 4), (0, 8)), ((0, 4), (0, 8)), ((0, 4), (0, 8))),
        (1, QKV0, ((4, 8), (0, 8)), ((0, 4), (0, 8)), ((4, 8), (0, 8))),
    ]
    assert moves(plan, 0, QKV0, k) == [  # k rows sit after q's 4 local rows on each sender
        (0, QKV0, ((0, 2), (0, 8)), ((4, 6), (0, 8)), ((8, 10), (0, 8))),
        (1, QKV0, ((2, 4), (0, 8)), ((4, 6), (0, 8)), ((10, 12), (0, 8))),
    ]
    o = "layers.0.self_attn.o_proj.weight"
    assert moves(plan, 0, o, "model.layers.0.self_attn.o_proj.weight") == [
        (0, o, ((0, 8), (0, 4)), ((0, 8), (0, 4)), ((0, 8), (0, 4))),
        (1, o, ((0, 8), (4, 8)), ((0, 8), (0, 4)), ((0, 8), (4, 8))),
    ]
    emb = "embed_tokens.weight"
    assert moves(plan, 0, emb, "model.embed_tokens.weight") == [
        (0, emb, ((0, 6), (0, 8)), ((0, 6), (0, 8)), ((0, 6), (0, 8))),
        (1, emb, ((6, 11), (0, 8)), ((0, 5), (0, 8)), ((6, 11), (0, 8))),
    ]
    # a replicated norm comes once, whole (it is small), from one of the two senders
    norm = [t for t in plan.transfers if t.name == "model.norm.weight"]
    assert [(t.box, t.dst_key) for t in norm] == [(((0, 8),), "norm.weight")]
    # with bands allowed down to one element it is shared by both senders
    banded = plan_transfers(senders, receivers, min_band_numel=1)
    norm = [t for t in banded.transfers if t.name == "model.norm.weight"]
    assert [(t.src, t.box) for t in sorted(norm, key=lambda t: t.box)] in (
        [(0, ((0, 4),)), (1, ((4, 8),))],
        [(1, ((0, 4),)), (0, ((4, 8),))],
    )
    assert plan.total_numel == sum(_volume(r.piece.box) for r in receivers[0].regions)


def test_tp1_to_tp2_scatters_rows_of_one_sender():
    senders, receivers = [engine(0, 1)], [engine(0, 2), engine(1, 2)]
    plan = plan_transfers(senders, receivers)
    assert_exact_cover(plan, senders, receivers)
    assert {t.src for t in plan.transfers} == {0}
    assert moves(plan, 1, QKV0, "model.layers.0.self_attn.q_proj.weight") == [
        (0, QKV0, ((4, 8), (0, 8)), ((4, 8), (0, 8)), ((0, 4), (0, 8))),
    ]
    assert moves(plan, 1, QKV0, "model.layers.0.self_attn.v_proj.weight") == [
        (0, QKV0, ((2, 4), (0, 8)), ((14, 16), (0, 8)), ((6, 8), (0, 8))),
    ]
    gu = "layers.1.mlp.gate_up_proj.weight"
    assert moves(plan, 1, gu, "model.layers.1.mlp.up_proj.weight") == [
        (0, gu, ((6, 12), (0, 8)), ((18, 24), (0, 8)), ((6, 12), (0, 8))),
    ]
    emb = "embed_tokens.weight"  # receiver 1 holds rows 6..11 in local rows 0..5 (row 5 padding)
    assert moves(plan, 1, emb, "model.embed_tokens.weight") == [
        (0, emb, ((6, 11), (0, 8)), ((6, 11), (0, 8)), ((0, 5), (0, 8))),
    ]


def test_pipeline_stages_into_one_receiver():
    stages = split_layers(2, 2)
    senders = [engine(0, 1, stage=s, rank=s.index) for s in stages]
    receivers = [engine(0, 1)]
    assert "lm_head.weight" not in senders[0].local_shapes
    assert "layers.0.mlp.down_proj.weight" not in senders[1].local_shapes
    plan = plan_transfers(senders, receivers)
    assert_exact_cover(plan, senders, receivers)
    got = sorted((t.src, t.dst_key, t.name) for t in plan.transfers)
    layer = [  # (local key, canonical names) of one decoder layer
        ("input_layernorm.weight", ["input_layernorm.weight"]),
        ("self_attn.qkv_proj.weight", [f"self_attn.{p}_proj.weight" for p in "qkv"]),
        ("self_attn.o_proj.weight", ["self_attn.o_proj.weight"]),
        ("post_attention_layernorm.weight", ["post_attention_layernorm.weight"]),
        ("mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
        ("mlp.down_proj.weight", ["mlp.down_proj.weight"]),
    ]
    expected = [(0, "embed_tokens.weight", "model.embed_tokens.weight")]
    expected += [(1, "norm.weight", "model.norm.weight"), (1, "lm_head.weight", "lm_head.weight")]
    for i in range(2):
        for key, names in layer:
            expected += [(i, f"layers.{i}.{key}", f"model.layers.{i}.{n}") for n in names]
    assert got == sorted(expected)
    assert all(t.src_key == t.dst_key and t.box == t.dst_piece.box for t in plan.transfers)


# --- Megatron-core -----------------------------------------------------------------------------


def test_megatron_qkv_is_grouped_by_kv_head():
    # TP2 of 4 kv heads: rank 1 holds groups of kv heads 2 and 3, each [2 q heads; k; v]
    shapes = megatron_shapes(MCFG, 2) | {MQKV0.replace("weight", "bias"): (16,)}
    layout = megatron_layout(shapes, MCFG, 1, 2, 7)
    pieces = [
        (r.piece.name.split(".")[-2], r.piece.box[0], r.piece.offset[0])
        for r in layout.regions
        if r.key == MQKV0
    ]
    assert pieces == [
        ("q_proj", (8, 12), 0),
        ("k_proj", (4, 6), 4),
        ("v_proj", (4, 6), 6),
        ("q_proj", (12, 16), 8),
        ("k_proj", (6, 8), 12),
        ("v_proj", (6, 8), 14),
    ]
    assert layout.rank == 7 and layout.local_shapes[MQKV0] == (16, 16)
    bias = [
        (r.piece.name, r.piece.box, r.piece.offset)
        for r in layout.regions
        if r.key == "decoder.layers.0.self_attention.linear_qkv.bias"
    ][:3]
    assert bias == [
        ("model.layers.0.self_attn.q_proj.bias", ((8, 12),), (0,)),
        ("model.layers.0.self_attn.k_proj.bias", ((4, 6),), (4,)),
        ("model.layers.0.self_attn.v_proj.bias", ((4, 6),), (6,)),
    ]
    fc1 = [
        (r.piece.name, r.piece.box, r.piece.offset)
        for r in layout.regions
        if r.key == "decoder.layers.0.mlp.linear_fc1.weight"
    ]
    assert fc1 == [
        ("model.layers.0.mlp.gate_proj.weight", ((4, 8), (0, 16)), (0, 0)),
        ("model.layers.0.mlp.up_proj.weight", ((4, 8), (0, 16)), (4, 0)),
    ]
    fc2 = [r.piece for r in layout.regions if r.key == "decoder.layers.0.mlp.linear_fc2.weight"]
    assert [(p.name, p.box) for p in fc2] == [
        ("model.layers.0.mlp.down_proj.weight", ((0, 16), (4, 8)))
    ]


def test_megatron_padded_vocab_rows_have_no_piece():
    cfg = MegatronLlamaConfig(16, 8, 4, 2, 8, vocab=11, padded_vocab=16, layers=1)
    boxes = []
    for r in range(4):
        shapes = megatron_shapes(cfg, 4)
        layout = megatron_layout(shapes, cfg, r, 4, r)
        assert layout.local_shapes["output_layer.weight"] == (4, 16)
        boxes.append([g.piece.box[0] for g in layout.regions if g.key == "output_layer.weight"])
    assert boxes == [[(0, 4)], [(4, 8)], [(8, 11)], []]


def test_megatron_pipeline_stage_numbers_layers_from_its_offset():
    cfg = MegatronLlamaConfig(16, 8, 4, 2, 8, vocab=11, padded_vocab=12, layers=2)
    fc2 = {"decoder.layers.0.mlp.linear_fc2.weight": (16, 4)}
    (region,) = megatron_layout(fc2, cfg, 1, 2, 3, layer_offset=1).regions
    assert (region.piece.name, region.piece.box) == (
        "model.layers.1.mlp.down_proj.weight",
        ((0, 16), (4, 8)),
    )
    with pytest.raises(LayoutMismatch, match="layer 2 outside the model's 2"):
        megatron_layout(fc2, cfg, 1, 2, 3, layer_offset=2)


def test_megatron_tp4_to_tandem_tp2_q_k_v_sources():
    senders, receivers = megatron(4), [engine(r, 2, cfg=MLLAMA) for r in range(2)]
    plan = plan_transfers(senders, receivers)
    assert_exact_cover(plan, senders, receivers)
    prefix = "model.layers.0.self_attn"
    # receiver 0: q heads 0..3 (rows 0..8), kv heads 0..1 (rows 0..4) -> Megatron ranks 0 and 1,
    # whose local rows are [q 0..4; k 4..6; v 6..8]
    assert moves(plan, 0, QKV0, f"{prefix}.q_proj.weight") == [
        (0, MQKV0, ((0, 4), (0, 16)), ((0, 4), (0, 16)), ((0, 4), (0, 16))),
        (1, MQKV0, ((4, 8), (0, 16)), ((0, 4), (0, 16)), ((4, 8), (0, 16))),
    ]
    assert moves(plan, 0, QKV0, f"{prefix}.k_proj.weight") == [
        (0, MQKV0, ((0, 2), (0, 16)), ((4, 6), (0, 16)), ((8, 10), (0, 16))),
        (1, MQKV0, ((2, 4), (0, 16)), ((4, 6), (0, 16)), ((10, 12), (0, 16))),
    ]
    assert moves(plan, 0, QKV0, f"{prefix}.v_proj.weight") == [
        (0, MQKV0, ((0, 2), (0, 16)), ((6, 8), (0, 16)), ((12, 14), (0, 16))),
        (1, MQKV0, ((2, 4), (0, 16)), ((6, 8), (0, 16)), ((14, 16), (0, 16))),
    ]
    # receiver 1's lm_head rows 6..11 span Megatron ranks 2 (rows 6..9) and 3 (9..11 of 9..12)
    assert moves(plan, 1, "lm_head.weight", "lm_head.weight") == [
        (2, "output_layer.weight", ((6, 9), (0, 16)), ((0, 3), (0, 16)), ((0, 3), (0, 16))),
        (3, "output_layer.weight", ((9, 11), (0, 16)), ((0, 2), (0, 16)), ((3, 5), (0, 16))),
    ]


def test_megatron_unknown_keys_and_bad_shapes_are_listed_together():
    shapes = megatron_shapes(MCFG, 4)
    shapes["decoder.layers.0.self_attention.linear_qkv.weight"] = (9, 16)
    shapes["decoder.layers.0.mlp.router.weight"] = (4, 16)
    shapes["decoder.layers.0.self_attention.linear_qkv.weights"] = (8, 16)
    with pytest.raises(LayoutMismatch) as err:
        megatron_layout(shapes, MCFG, 0, 4, 0)
    problems = err.value.problems
    assert len(problems) == 2
    assert problems[0].startswith(
        "unknown Megatron tensors ['decoder.layers.0.mlp.router.weight', "
        "'decoder.layers.0.self_attention.linear_qkv.weights']"
    )
    assert problems[1] == (
        "decoder.layers.0.self_attention.linear_qkv.weight: local shape (9, 16), "
        "config expects (8, 16)"
    )


# --- FSDP2 / DTensor ---------------------------------------------------------------------------


def test_shard_box_uneven_chunks():
    assert [shard_box((5, 8), [Shard(0)], (2,), (i,)) for i in range(2)] == [
        ((0, 3), (0, 8)),
        ((3, 5), (0, 8)),
    ]
    assert [shard_box((4,), [Shard(0)], (3,), (i,)) for i in range(3)] == [
        ((0, 2),),
        ((2, 4),),
        ((4, 4),),
    ]
    assert shard_box((4, 6), [Replicate()], (3,), (2,)) == ((0, 4), (0, 6))
    # TP x FSDP on a (dp=2, tp=2) mesh, FSDP2's strided placement: TP splits 7 rows first
    # (0..4, 4..7), then FSDP splits rank (dp 1, tp 1)'s three rows: 6..7
    assert shard_box((7, 3), [_StridedShard(0, split_factor=2), Shard(0)], (2, 2), (1, 1)) == (
        (6, 7),
        (0, 3),
    )
    # row-parallel weight: FSDP on rows, TP on columns
    assert shard_box((4, 6), [Shard(0), Shard(1)], (2, 2), (1, 0)) == ((2, 4), (0, 3))
    with pytest.raises(ValueError, match="partial"):
        shard_box((4,), [Partial()], (2,), (0,))


def test_shard_box_agrees_with_dtensor():
    cases = [
        ((7, 5), (2, 3), [Shard(0), Shard(0)]),
        ((7, 5), (2, 3), [Shard(0), Shard(1)]),
        ((5, 9), (2, 3), [Replicate(), Shard(1)]),
        ((7, 5), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
        ((12, 4), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),
        ((3, 4), (4,), [Shard(0)]),
    ]
    for full, shape, placements in cases:
        for rank in range(torch.Size(shape).numel()):
            m = mesh(shape, rank)
            local, offset = compute_local_shape_and_global_offset(full, m, placements)
            box = shard_box(full, placements, shape, m.get_coordinate())
            assert tuple(stop - start for start, stop in box) == local, (full, placements, rank)
            if 0 not in local:  # an empty shard's offset means nothing
                assert tuple(start for start, _ in box) == offset, (full, placements, rank)


def test_dtensor_layout_reads_mesh_and_rejects_partial():
    layouts = fsdp(CFG, 3)
    k = "model.layers.0.self_attn.k_proj.weight"  # 4 rows over 3 ranks: 0..2, 2..4, none
    assert [lay.local_shapes[k] for lay in layouts] == [(2, 8), (2, 8), (0, 8)]
    assert [[r.piece.box for r in lay.regions if r.key == k] for lay in layouts] == [
        [((0, 2), (0, 8))],
        [((2, 4), (0, 8))],
        [],
    ]
    m = mesh((2,), 1)
    partial = [
        DTensor.from_local(
            torch.zeros(4), m, [Partial()], run_check=False, shape=torch.Size([4]), stride=(1,)
        )
        for _ in range(2)
    ]
    with pytest.raises(LayoutMismatch) as err:
        dtensor_layout({"a": partial[0], "b": partial[1], "c": torch.zeros(2)}, 1)
    assert [p.split(":")[0] for p in err.value.problems] == ["a", "b"]
    # an explicit coordinate overrides the mesh's own; the local shape must fit the shard
    last_rows = DTensor.from_local(
        torch.zeros(3, 8),
        mesh((3,), 0),
        [Shard(0)],
        run_check=False,
        shape=torch.Size([11, 8]),
        stride=(8, 1),
    )
    (region,) = dtensor_layout({"emb": last_rows}, 2, coordinate=(2,)).regions
    assert region.piece.box == ((8, 11), (0, 8))
    with pytest.raises(LayoutMismatch, match=r"emb: local tensor \(3, 8\) is not its shard"):
        dtensor_layout({"emb": last_rows}, 0)


def test_fsdp_uneven_to_tandem_tp2():
    cfg = CFG.model_copy(update={"vocab_size": 5})
    senders, receivers = fsdp(cfg, 3), [engine(r, 2, cfg=cfg) for r in range(2)]
    plan = plan_transfers(senders, receivers)
    assert_exact_cover(plan, senders, receivers)
    emb, name = "embed_tokens.weight", "model.embed_tokens.weight"
    # FSDP rows 0..2, 2..4, 4..5; TP2 rows 0..3 and 3..5
    assert moves(plan, 0, emb, name) == [
        (0, name, ((0, 2), (0, 8)), ((0, 2), (0, 8)), ((0, 2), (0, 8))),
        (1, name, ((2, 3), (0, 8)), ((0, 1), (0, 8)), ((2, 3), (0, 8))),
    ]
    assert moves(plan, 1, emb, name) == [
        (1, name, ((3, 4), (0, 8)), ((1, 2), (0, 8)), ((0, 1), (0, 8))),
        (2, name, ((4, 5), (0, 8)), ((0, 1), (0, 8)), ((1, 2), (0, 8))),
    ]
    k = "model.layers.1.self_attn.k_proj.weight"  # FSDP rank 2 holds none of its 4 rows
    assert moves(plan, 1, "layers.1.self_attn.qkv_proj.weight", k) == [
        (1, k, ((2, 4), (0, 8)), ((0, 2), (0, 8)), ((4, 6), (0, 8))),
    ]
    o = "model.layers.0.self_attn.o_proj.weight"  # FSDP rows x TP columns
    assert moves(plan, 1, "layers.0.self_attn.o_proj.weight", o) == [
        (0, o, ((0, 3), (4, 8)), ((0, 3), (4, 8)), ((0, 3), (0, 4))),
        (1, o, ((3, 6), (4, 8)), ((0, 3), (4, 8)), ((3, 6), (0, 4))),
        (2, o, ((6, 8), (4, 8)), ((0, 2), (4, 8)), ((6, 8), (0, 4))),
    ]


def test_data_parallel_replicas_share_the_sending():
    # a large cell the replicas all hold is cut into one band per replica (here every cell
    # counts as large), so even a model whose embedding dominates spreads evenly
    cfg = CFG.model_copy(update={"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2})
    base = fsdp(cfg, 2)
    senders = [
        RankLayout(2 * replica + lay.rank, lay.regions, lay.local_shapes, lay.dtype)
        for replica in range(4)
        for lay in base
    ]
    receivers = [engine(r, 2, cfg=cfg) for r in range(2)]
    whole_cells = plan_transfers(senders, receivers)  # small cells go whole, still spread
    assert all(n > 0 for n in whole_cells.sender_numel), whole_cells.sender_numel
    plan = plan_transfers(senders, receivers, min_band_numel=1)
    assert_exact_cover(plan, senders, receivers)
    assert plan.num_senders == 8
    assert all(n > 0 for n in plan.sender_numel), plan.sender_numel
    assert plan.sender_max_over_mean <= 1.1, plan.sender_numel


# --- errors ------------------------------------------------------------------------------------


def test_mismatches_are_reported_all_at_once():
    half = RankLayout(1)
    half.add("e", (2,), [Piece("e", (4,), ((0, 2),), (0,))])
    senders = [
        module_layout({"a": torch.zeros(4, 2), "b": torch.zeros(9), "d": torch.zeros(1)}),
        half,
    ]
    receivers = [
        module_layout(
            {"a": torch.zeros(4, 2), "b": torch.zeros(8), "c": torch.zeros(3), "e": torch.zeros(4)}
        ),
        module_layout({"a": torch.zeros(5, 2)}, rank=1),
    ]
    with pytest.raises(LayoutMismatch) as err:
        plan_transfers(senders, receivers)
    assert err.value.problems == [
        "a: receivers disagree on its shape ((4, 2) vs (5, 2))",
        "b: senders have shape (9,), receivers (8,)",
        "receivers need c (3,), no sender has it",
        "senders have d, which the receivers do not know",
        "no sender holds e box ((2, 4),) (receiver 0)",
        "no sender holds a box ((4, 5), (0, 2)) (receiver 1)",
    ]
    plan_transfers(senders[:1], [module_layout({"a": torch.zeros(4, 2)})], ignore={"b", "d"})


def test_a_box_no_sender_holds_is_reported():
    half = RankLayout(0)
    half.add("a", (2,), [Piece("a", (4,), ((0, 2),), (0,))])
    with pytest.raises(LayoutMismatch) as err:
        plan_transfers([half], [module_layout({"a": torch.zeros(4)})])
    assert err.value.problems == ["no sender holds a box ((2, 4),) (receiver 0)"]


# --- the small pieces --------------------------------------------------------------------------


def test_piece_regions_of_transposed_and_fused_pieces():
    full = torch.arange(8 * 24.0).reshape(8, 24)
    # GPT-2 Conv1D c_attn [in 8, out 24], TP2 rank 1's k section: columns 12..16, stored
    # transposed from local row 4
    k = Piece("c_attn.weight", (8, 24), ((0, 8), (12, 16)), (4, 0), transposed=True)
    local = torch.zeros(12, 8)
    k.write(local, full[k.box_slices()])
    box = ((2, 5), (13, 16))
    assert k.region(box) == LocalRegion(((5, 8), (2, 5)), transposed=True)
    assert torch.equal(local[5:8, 2:5], full[2:5, 13:16].t())
    assert torch.equal(k.region(box).view(local), full[2:5, 13:16])  # canonical orientation
    # a fused qkv's k rows 2..4 stored from local row 4
    kk = Piece("k_proj.weight", (4, 8), ((2, 4), (0, 8)), (4, 0))
    assert kk.region(((3, 4), (2, 8))) == LocalRegion(((5, 6), (2, 8)))


def test_module_layout_dedups_tied_tensors():
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"embed": emb, "head": head})
    assert module_layout(model).local_shapes == {"embed.weight": (5, 3)}
    sd = model.state_dict()
    assert list(sd) == ["embed.weight", "head.weight"]
    layout = module_layout(sd, rank=3)
    assert (layout.rank, layout.local_shapes) == (3, {"embed.weight": (5, 3)})
    # views of one storage that are different tensors stay
    fused = torch.zeros(6, 2)
    assert list(module_layout({"q": fused[:3], "k": fused[3:]}).local_shapes) == ["q", "k"]
    with torch.device("meta"):
        assert len(module_layout({"x": torch.empty(2), "y": torch.empty(2)}).regions) == 2


def test_plan_cache_reuses_until_a_layout_changes():
    cache = PlanCache()
    plan = cache.get([engine(0, 1)], [engine(0, 2), engine(1, 2)])
    assert cache.get([engine(0, 1)], [engine(0, 2), engine(1, 2)]) is plan
    receivers = [engine(0, 2), engine(1, 2)]
    receivers[1].regions.pop()  # rank 1 no longer wants its lm_head rows
    changed = cache.get([engine(0, 1)], receivers)
    assert changed is not plan
    assert len(changed.transfers) == len(plan.transfers) - 1


# --- end to end: real data through the plan ---------------------------------------------------
# Sender tensors are built the way each trainer lays them out, not from the adapters' pieces,
# so these also check the adapters; receivers are compared with the engine's own loading.


def megatron_locals(full: dict[str, torch.Tensor], tp: int) -> dict[int, dict[str, torch.Tensor]]:
    """Megatron-core's tensors cut from HF ones: qkv grouped per kv head, vocab padded."""
    c = MCFG

    def vocab(t):
        return torch.cat([t, t.new_zeros(c.padded_vocab - c.vocab, c.hidden)]).chunk(tp)

    hf, mg = "model.layers.0", "decoder.layers.0"
    q = full[f"{hf}.self_attn.q_proj.weight"].view(c.kv_heads, -1, c.hidden)
    k = full[f"{hf}.self_attn.k_proj.weight"].view(c.kv_heads, -1, c.hidden)
    v = full[f"{hf}.self_attn.v_proj.weight"].view(c.kv_heads, -1, c.hidden)
    qkv = torch.cat([q, k, v], dim=1).reshape(-1, c.hidden).chunk(tp)
    gate = full[f"{hf}.mlp.gate_proj.weight"].chunk(tp)
    up = full[f"{hf}.mlp.up_proj.weight"].chunk(tp)
    return {
        r: {
            "embedding.word_embeddings.weight": vocab(full["model.embed_tokens.weight"])[r],
            f"{mg}.self_attention.linear_qkv.weight": qkv[r],
            f"{mg}.self_attention.linear_qkv.layer_norm_weight": full[
                f"{hf}.input_layernorm.weight"
            ],
            f"{mg}.self_attention.linear_proj.weight": full[f"{hf}.self_attn.o_proj.weight"].chunk(
                tp, dim=1
            )[r],
            f"{mg}.mlp.linear_fc1.weight": torch.cat([gate[r], up[r]]),
            f"{mg}.mlp.linear_fc1.layer_norm_weight": full[f"{hf}.post_attention_layernorm.weight"],
            f"{mg}.mlp.linear_fc2.weight": full[f"{hf}.mlp.down_proj.weight"].chunk(tp, dim=1)[r],
            "decoder.final_layernorm.weight": full["model.norm.weight"],
            "output_layer.weight": vocab(full["lm_head.weight"])[r],
        }
        for r in range(tp)
    }


def fsdp_locals(full: dict[str, torch.Tensor], world: int) -> dict[int, dict[str, torch.Tensor]]:
    """FSDP2's unpadded shards: torch.chunk on dim 0, missing chunks empty."""
    out = {r: {} for r in range(world)}
    for name, t in full.items():
        chunks = t.chunk(world)
        for r in range(world):
            out[r][name] = chunks[r] if r < len(chunks) else t[t.shape[0] :]
    return out


CASES = {  # senders, their local tensors from the full ones, receivers, canonical shapes
    "tp1-to-tp2": (
        lambda: [engine(0, 1)],
        lambda full: {0: cut(engine(0, 1), full)},  # the loader's path, as on the engine
        lambda: [engine(r, 2) for r in range(2)],
        CFG,
    ),
    "pp2-tp2-to-tp1": (
        lambda: [engine(r % 2, 2, stage=split_layers(2, 2)[r // 2], rank=r) for r in range(4)],
        lambda full: {
            r: cut(engine(r % 2, 2, stage=split_layers(2, 2)[r // 2]), full) for r in range(4)
        },
        lambda: [engine(0, 1)],
        CFG,
    ),
    "megatron-tp4-to-tp2": (
        lambda: megatron(4),
        lambda full: megatron_locals(full, 4),
        lambda: [engine(r, 2, cfg=MLLAMA) for r in range(2)],
        MLLAMA,
    ),
    "fsdp3-to-tp2": (
        lambda: fsdp(CFG, 3),
        lambda full: fsdp_locals(full, 3),
        lambda: [engine(r, 2) for r in range(2)],
        CFG,
    ),
    "hf-gpt2-to-tp2": (  # HF Conv1D [in, out] tensors into transposed tandem shards
        lambda: [module_layout(hf_meta_tensors(GPT2))],
        lambda full: {0: full},
        lambda: [engine(r, 2, cfg=GPT2) for r in range(2)],
        GPT2,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_data_moved_by_the_plan_matches_direct_loading(case):
    make_senders, make_locals, make_receivers, cfg = CASES[case]
    senders, receivers = make_senders(), make_receivers()
    full = full_tensors(canonical_shapes(cfg))
    src = make_locals(full)
    for layout in senders:
        assert {k: tuple(t.shape) for k, t in src[layout.rank].items()} == layout.local_shapes
    got = execute(plan_transfers(senders, receivers), src, receivers)
    for layout in receivers:
        expected = cut(layout, full)
        assert got[layout.rank].keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(got[layout.rank][key], tensor), (layout.rank, key)
