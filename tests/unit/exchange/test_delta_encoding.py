"""A delta payload (`tandem.exchange.delta`) against hand-made boxes: each encoding is chosen
where it is the smallest, decodes to exactly the changed elements and values, and applies to a
box wherever it lies in its parameter (strided, transposed), with an undo that restores it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.exchange import delta
from tandem.exchange.checksum import tensor_crc32
from tandem.exchange.delta import apply_box, decode, dense_values, encode_box, undo_box
from tandem.kernels.delta import changed


def _changed(old: torch.Tensor, count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``old`` (float32) with ``count`` elements moved by more than a bfloat16 step."""
    g = torch.Generator().manual_seed(seed)
    new = old.clone(memory_format=torch.contiguous_format)
    at = torch.randperm(old.numel(), generator=g)[:count]
    new.view(-1)[at] += 1.0
    return new, at.sort().values


@pytest.mark.parametrize(
    ("count", "encoding"), [(0, "indices"), (3, "indices"), (300, "bitmap"), (1000, "dense")]
)
def test_the_smallest_encoding_is_chosen_and_decodes_to_the_changed_elements(count, encoding):
    old = torch.randn(40, 25).to(torch.bfloat16)
    new, at = _changed(old.float(), count)
    enc = encode_box(new, old, verify=True)
    assert torch.equal(old, new.to(torch.bfloat16))  # the shadow now holds the new values
    assert enc.box.encoding == encoding
    assert enc.box.changed == count
    assert enc.box.crc == tensor_crc32(new.to(torch.bfloat16))
    bytes_by_hand = {  # 1,000 elements of 2 bytes: indices 4 + 2 per change, bitmap 128 bits
        "indices": max(8, -(-count * 4 // 8) * 8 + -(-count * 2 // 8) * 8),
        "bitmap": 128 + -(-count * 2 // 8) * 8,
        "dense": 2000,
    }
    assert enc.box.nbytes == enc.payload.numel() == bytes_by_hand[encoding]
    indices, values = decode(enc.payload, enc.box, old.numel(), torch.bfloat16)
    if encoding == "dense":
        assert indices is None and torch.equal(values, new.to(torch.bfloat16).view(-1))
    else:
        assert torch.equal(indices, at)
        assert torch.equal(values, new.to(torch.bfloat16).view(-1)[at])


def test_elements_compare_by_their_bits_in_the_engine_dtype():
    same = torch.ones(100)
    old = torch.cat([torch.tensor([0.0, float("nan"), 1.0, 1.0 + 2**-12]), same])
    shadow = old.to(torch.bfloat16)
    new = torch.cat([torch.tensor([-0.0, float("nan"), 1.0 + 2**-12, 1.0]), same])
    enc = encode_box(new, shadow, verify=True)
    # -0.0 differs from 0.0; NaN equals itself; 1 + 2^-12 rounds to 1.0 in bfloat16 both ways
    assert enc.box.changed == 1
    indices, _ = decode(enc.payload, enc.box, old.numel(), torch.bfloat16)
    assert indices.tolist() == [0]
    assert torch.equal(shadow.view(torch.int16), new.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("count", [5, 200])
@pytest.mark.parametrize("where", ["columns", "transposed"])
def test_a_payload_applies_to_a_strided_box_and_its_undo_restores_it(count, where):
    param = torch.randn(30, 64).to(torch.bfloat16)
    before = param.clone()
    live = param[:, 16:48] if where == "columns" else param[4:20].t()
    assert not live.is_contiguous()
    new, _ = _changed(live.float(), count, seed=1)
    enc = encode_box(new, live.contiguous(), verify=True)
    assert enc.box.encoding != "dense"
    undo = apply_box(live, enc.payload, enc.box)
    assert torch.equal(live, new.to(torch.bfloat16))
    assert tensor_crc32(live) == enc.box.crc
    outside = torch.ones_like(param, dtype=torch.bool)
    (outside[:, 16:48] if where == "columns" else outside[4:20]).fill_(False)
    assert torch.equal(param[outside], before[outside])  # nothing written outside the box
    undo_box(live, undo)
    assert torch.equal(param, before)


def test_a_dense_payload_holds_the_whole_box():
    old = torch.randn(7, 9)
    new = old + 1
    enc = encode_box(new, old, verify=False)
    assert enc.box.encoding == "dense" and enc.box.crc is None
    assert torch.equal(dense_values(enc.payload, old), new)


@pytest.mark.parametrize("count", [5, 200])
def test_a_payload_applies_to_a_contiguous_box_and_its_undo_restores_it(count):
    live = torch.randn(30, 64).to(torch.bfloat16)
    before = live.clone()
    new, _ = _changed(live.float(), count, seed=2)
    enc = encode_box(new, live.clone(), verify=True)
    undo = apply_box(live, enc.payload, enc.box)
    assert torch.equal(live, new.to(torch.bfloat16)) and tensor_crc32(live) == enc.box.crc
    undo_box(live, undo)
    assert torch.equal(live, before)


def test_a_payload_that_does_not_match_its_box_is_refused():
    live = torch.zeros(100, dtype=torch.bfloat16)
    enc = encode_box(torch.ones(100), torch.zeros(100, dtype=torch.bfloat16), verify=True)
    assert enc.box.encoding == "dense"
    few = encode_box(torch.tensor([1.0] + [0.0] * 99), torch.zeros(100, dtype=torch.bfloat16), True)
    assert few.box.encoding == "indices" and few.box.changed == 1
    past = few.payload.clone()
    past[:4].view(torch.int32)[0] = 100  # an index past the box
    with pytest.raises(ValueError, match="past|mark"):
        apply_box(live, past, few.box)
    assert torch.equal(live, torch.zeros(100, dtype=torch.bfloat16))


@pytest.mark.parametrize("chunk", [16, 1 << 19])
@pytest.mark.parametrize("cols", [slice(0, 48), slice(0, 24), slice(7, 32), slice(None)])
@pytest.mark.parametrize("count", [5, 400])
def test_a_column_slice_encodes_in_parts_as_a_copy_of_it_would(monkeypatch, chunk, cols, count):
    """A tensor-parallel shard's box (a column slice: rows contiguous, strided between them)
    is encoded in parts of whole rows, each with its CRC32 taken as it goes: the same
    payload, indices, values, shadow and CRC32 as the box copied out and compared whole."""
    monkeypatch.setattr(delta, "FUSED_CHUNK", chunk)
    full = torch.randn(300, 50) * 0.02
    box = full[:, cols]
    shadow = box.to(torch.bfloat16).contiguous()
    new, at = _changed(box, count, seed=count)
    full[:, cols] = new  # the trainer's parameter, updated in place
    enc = encode_box(full[:, cols], shadow, verify=True)
    want = new.to(torch.bfloat16)
    assert torch.equal(shadow.view(torch.int16), want.view(torch.int16))
    assert enc.box.changed == count and enc.box.crc == tensor_crc32(want)
    indices, values = decode(enc.payload, enc.box, want.numel(), torch.bfloat16)
    assert torch.equal(indices, at) and torch.equal(values, want.view(-1)[at])


@pytest.mark.parametrize("width", [np.uint8, np.uint16, np.uint32])
def test_the_kernel_finds_the_elements_numpy_finds(width):
    g = np.random.default_rng(0)
    a, b = (g.integers(0, 3, 1001).astype(width) for _ in range(2))
    want = np.flatnonzero(a != b)
    assert np.array_equal(changed(a, b, want.size), want)


@pytest.mark.parametrize("where", ["contiguous", "strided"])
@pytest.mark.parametrize("fault", ["repeated index", "bitmap short of its count"])
def test_a_malformed_payload_is_refused_before_anything_is_written(where, fault):
    param = torch.randn(16, 64).to(torch.bfloat16)
    live = param[:, :32] if where == "strided" else param[:8]
    before = param.clone()
    n = live.numel()
    new = live.float().clone(memory_format=torch.contiguous_format)
    if fault == "repeated index":
        new.view(-1)[[3, 9]] += 1.0
        enc = encode_box(new, live.clone(memory_format=torch.contiguous_format), verify=True)
        assert enc.box.encoding == "indices"
        enc.payload[:8].view(torch.int32)[1] = 3  # [3, 3]: the second write would hide the first
    else:
        new.view(-1)[: n // 4] += 1.0
        enc = encode_box(new, live.clone(memory_format=torch.contiguous_format), verify=True)
        assert enc.box.encoding == "bitmap"
        enc.payload[0] = 0  # 8 marked elements fewer than announced
    with pytest.raises(ValueError):
        apply_box(live, enc.payload, enc.box)
    assert torch.equal(param, before)
