"""tandem's copy kernels (tandem.kernels.copy) against torch's copy_ and zlib's CRC32: every
byte lands where torch's ``copy_`` puts it, and the CRC32 is zlib's of the source as read, for
boxes that are contiguous or rows apart on either side, at unaligned addresses, of sizes that
end mid-page and mid-vector, stored through the cache and past it."""

import zlib

import pytest
import torch

from tandem.kernels import copy as kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler here")


def _zlib(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _bytes(n: int, offset: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n + offset,), dtype=torch.uint8, generator=g)[offset:]


SHAPES = {  # (rows, row bytes): a page and a bit, vectors and a tail, a box past STREAM_BYTES
    "small": (3, 4096 + 37),
    "tail": (17, 200),
    "large": (300, 4096 + 512 + 3),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("src_layout", ["contiguous", "rows"])
@pytest.mark.parametrize("dst_layout", ["contiguous", "rows"])
@pytest.mark.parametrize("offset", [0, 5])
def test_crc_copy_lands_every_byte_and_checksums_the_source(shape, src_layout, dst_layout, offset):
    rows, width = SHAPES[shape]

    def box(layout, seed):
        pad = 0 if layout == "contiguous" else 77
        flat = _bytes(rows * (width + pad), offset, seed)
        return flat.view(rows, width + pad)[:, :width]

    src, dst = box(src_layout, 1), box(dst_layout, 2)
    before = dst.clone()
    crc = kernels.crc_copy(src, dst, value=0)
    assert torch.equal(dst, src)
    assert crc == _zlib(src) == kernels.crc(src) == kernels.crc(dst)
    assert not torch.equal(before, dst)
    for stream in (True, False):
        out = torch.zeros_like(src)
        kernels.copy(src, out, stream=stream)
        assert torch.equal(out, src)


def test_crcs_continue_a_value_as_zlib_does():
    a, b = _bytes(5000, 0, 3), _bytes(9000, 1, 4)
    assert kernels.crc(b, kernels.crc(a)) == zlib.crc32(b.numpy().tobytes(), _zlib(a))
    dst = torch.empty_like(b)
    assert kernels.crc_copy(b, dst, value=_zlib(a)) == kernels.crc(b, _zlib(a))


def test_crc_copy_never_reads_the_destination():
    """The CRC32 is of the bytes read from the source: a page that lands wrong afterwards
    shows up only in a CRC32 of the destination."""
    src = _bytes(3 << 20, 0, 5)
    dst = torch.empty_like(src)
    crc = kernels.crc_copy(src, dst)
    dst[(2 << 20) + 11] ^= 1
    assert crc == _zlib(src) != kernels.crc(dst)


def test_what_the_kernels_do_not_take_is_said():
    t = torch.zeros(4, 5, 6)[:, 1:4, 2:5]  # three dimensions, none contiguous with the next
    assert not kernels.served(t)
    assert kernels.served(torch.zeros(4, 6)[:, 1:5])
    assert not kernels.served(torch.zeros(1, 6).expand(4, 6))  # rows lying on one another
    with pytest.raises(ValueError, match="cannot copy"):
        kernels.copy(torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.float64))
