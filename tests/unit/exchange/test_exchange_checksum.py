"""A box's CRC32 (what sender and receiver compare) equals zlib's CRC32 of the box's bytes in C
order, whatever the strides, chunking or dtype conversion on the way."""

import zlib

import pytest
import torch

from tandem.exchange import checksum
from tandem.exchange.checksum import checked_copy, source_crc32, tensor_crc32


def _reference(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _boxes():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 40, generator=g)
    return {
        "contiguous": big,
        "rows": big[7:250],
        "columns": big[:, 5:31],
        "transposed": big.t(),
        "3d": torch.randn(4, 30, 6, generator=g)[:, 2:29, 1:5],
        "vector": torch.randn(1000, generator=g)[3:900],
        "scalar": torch.tensor(1.5),
        "empty": big[:0],
    }


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(checksum, "CHUNK_BYTES", 1024)  # many chunks per box


@pytest.mark.parametrize("name", list(_boxes()))
def test_tensor_crc32_is_zlib_crc32_of_the_elements_in_c_order(name):
    box = _boxes()[name]
    assert tensor_crc32(box) == (_reference(box) if box.numel() else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(_boxes()))
@pytest.mark.parametrize("dst_layout", ["contiguous", "transposed"])
def test_checked_copy_writes_the_box_and_checksums_the_source(name, dtype, dst_layout):
    box = _boxes()[name]
    if dst_layout == "transposed" and box.dim() == 2:
        dst = torch.zeros(box.shape[::-1], dtype=dtype).t()
    else:
        dst = torch.zeros(box.shape, dtype=dtype)
    crc = checked_copy(box, dst, verify=True)
    assert torch.equal(dst, box.to(dtype))
    assert crc == (_reference(box.to(dtype)) if box.numel() else 0)
    assert crc == source_crc32(box, dtype)
    assert checked_copy(box, torch.zeros_like(dst), verify=False) is None


def test_checked_copy_checksum_never_reads_the_destination():
    """The sender's CRC comes from the source: a destination that does not hold the copy
    (here: a write that went elsewhere) does not change it, so the receiver's CRC of the
    destination disagrees."""
    box = _boxes()["rows"]
    dst = torch.zeros_like(box)
    crc = checked_copy(box, dst, verify=True)
    dst[3, 4] += 1  # what landed differs from what was read
    assert crc == _reference(box) != tensor_crc32(dst)
