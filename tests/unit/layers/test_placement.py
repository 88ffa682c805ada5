"""Placement pieces of the parallel layers, checked against hand-computed layouts."""

import torch

from tandem.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, Section
from tandem.layers.placement import Piece
from tandem.parallel import TPGroup


def _layout(param):
    return [(p.name, p.box, p.offset, p.transposed) for p in param.pieces]


def test_qkv_with_fewer_kv_heads_than_ranks_replicates_kv():
    # 4 q heads, 1 kv head, head_dim 2, hidden 8, tp=2: each rank 2 q heads and the single kv head.
    names = ("q", "k", "v")
    for rank in range(2):
        layer = QKVParallelLinear(8, 2, 4, 1, names, bias=True, tp=TPGroup(rank, 2))
        assert layer.weight.shape == (4 + 2 + 2, 8)
        assert _layout(layer.weight) == [
            ("q.weight", ((4 * rank, 4 * rank + 4), (0, 8)), (0, 0), False),
            ("k.weight", ((0, 2), (0, 8)), (4, 0), False),
            ("v.weight", ((0, 2), (0, 8)), (6, 0), False),
        ]
        assert _layout(layer.bias)[0] == ("q.bias", ((4 * rank, 4 * rank + 4),), (0,), False)


def test_qkv_gqa_splits_kv_heads_across_ranks():
    # 8 q heads, 4 kv heads, head_dim 4, tp=2: rank 1 holds q rows 16..32 and kv rows 8..16.
    layer = QKVParallelLinear(32, 4, 8, 4, ("q", "k", "v"), bias=False, tp=TPGroup(1, 2))
    assert [p.box[0] for p in layer.weight.pieces] == [(16, 32), (8, 16), (8, 16)]
    assert [p.offset[0] for p in layer.weight.pieces] == [0, 16, 24]


def test_fused_gate_up_interleaves_per_rank_and_row_parallel_splits_columns():
    gate_up = ColumnParallelLinear(
        6, [Section("gate", None, 10), Section("up", None, 10)], TPGroup(1, 2)
    )
    assert _layout(gate_up.weight) == [
        ("gate", ((5, 10), (0, 6)), (0, 0), False),
        ("up", ((5, 10), (0, 6)), (5, 0), False),
    ]
    down = RowParallelLinear(10, 6, "down", "down.bias", TPGroup(1, 2))
    assert _layout(down.weight) == [("down", ((0, 6), (5, 10)), (0, 0), False)]
    assert _layout(down.bias) == [("down.bias", ((0, 6),), (0,), False)]


def test_gpt2_fused_c_attn_is_three_column_boxes_of_one_conv1d_tensor():
    h = 8
    sections = [Section("c_attn.weight", None, h, start=i * h, total=3 * h) for i in range(3)]
    layer = ColumnParallelLinear(h, sections, TPGroup(1, 2), conv1d=True)
    assert _layout(layer.weight) == [
        ("c_attn.weight", ((0, 8), (4, 8)), (0, 0), True),
        ("c_attn.weight", ((0, 8), (12, 16)), (4, 0), True),
        ("c_attn.weight", ((0, 8), (20, 24)), (8, 0), True),
    ]


def test_uneven_vocab_shards_and_tied_head():
    # vocab 10 over 3 ranks: 4 + 4 + 2 real rows, each rank padded to 4.
    shards = [VocabParallelEmbedding(10, 3, "emb", TPGroup(r, 3)) for r in range(3)]
    assert [tuple(s.weight.shape) for s in shards] == [(4, 3)] * 3
    assert [_layout(s.weight)[0][1] for s in shards] == [
        ((0, 4), (0, 3)),
        ((4, 8), (0, 3)),
        ((8, 10), (0, 3)),
    ]
    head = ParallelLMHead(10, 3, "lm_head", TPGroup(2, 3), tied_to=shards[2])
    assert head.weight is shards[2].weight


def test_piece_write_fills_only_its_region():
    param = torch.zeros(3, 4)
    piece = Piece("w", (4, 3), ((1, 3), (0, 3)), (0, 1), transposed=True)
    canonical = torch.arange(12.0).view(4, 3)
    piece.write(param, canonical[piece.box_slices()])
    assert torch.equal(param[:, 1:3], canonical[1:3].t())
    assert param[:, 0].abs().sum() == 0 and param[:, 3].abs().sum() == 0
