"""A box's CRC32 (what sender and receiver compare) equals zlib's CRC32 of the box's bytes in C
order, whatever the strides, chunking or dtype conversion on the way."""

import zlib

import pytest
import torch

from tandem.exchange import checksum
from tandem.exchange.checksum import copy_with_crc32, tensor_crc32


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
def test_copy_with_crc32_writes_the_box_and_checksums_the_bytes_as_written(name, dtype,
                                                                           dst_layout):  # fmt: skip
    box = _boxes()[name]
    if dst_layout == "transposed" and box.dim() == 2:
        dst = torch.zeros(box.shape[::-1], dtype=dtype).t()
    else:
        dst = torch.zeros(box.shape, dtype=dtype)
    crc = copy_with_crc32(box, dst, verify=True)
    assert torch.equal(dst, box.to(dtype))
    assert crc == (_reference(dst) if box.numel() else 0)
    assert copy_with_crc32(box, torch.zeros_like(dst), verify=False) is None
