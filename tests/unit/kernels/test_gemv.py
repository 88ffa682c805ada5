"""tandem's GEMV kernel (tandem.kernels.gemv): a few rows times a float32 or bfloat16 weight,
checked against float64 matmuls of the same values (float32) and against the float32 sums
rounded once to bfloat16 (bfloat16), including lengths that leave vector tails, biases,
strided x rows and every row count it takes."""

import pytest
import torch

from tandem.kernels import gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason="the GEMV kernel does not build here")


def _case(rows, inp, out, seed, dtype, x_pad=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp + x_pad, generator=gen)[:, :inp].to(dtype)  # rows inp + pad apart
    w = torch.randn(out, inp, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype)
    return x, w, b


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("inp", "out"), [(512, 1280), (1280, 512), (101, 37), (7, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_equals_float64_matmul(rows, inp, out, bias):
    x, w, b = _case(rows, inp, out, rows + inp, torch.float32, x_pad=5)
    b = b if bias else None
    with torch.inference_mode():
        got = gemv.gemv(x, w, b)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * inp**0.5)


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize(("inp", "out"), [(512, 1280), (101, 37)])
def test_bfloat16_rounds_the_float32_sums_once(rows, inp, out):
    """bfloat16 products are exact in float32: the kernel's result is the float32 sum rounded
    once, as F.linear's bfloat16 result is (summation order aside: >= 99% equal)."""
    x, w, b = _case(rows, inp, out, rows, torch.bfloat16, x_pad=3)
    with torch.inference_mode():
        got = gemv.gemv(x, w, b)
    want = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert (got == want).float().mean() >= 0.99


def test_leading_dimensions_are_kept():
    x, w, _ = _case(3, 64, 24, 0, torch.float32)
    with torch.inference_mode():
        got = gemv.gemv(x.view(3, 1, 64), w, None)
    assert got.shape == (3, 1, 24)
    torch.testing.assert_close(got[:, 0], x @ w.T)


def test_bad_shapes_are_refused():
    x, w, _ = _case(gemv.MAX_ROWS + 1, 32, 8, 0, torch.float32)
    with pytest.raises(ValueError, match="at most"):
        gemv.gemv(x, w, None)
    with pytest.raises(ValueError, match="features"):
        gemv.gemv(x[:1, :16], w, None)


def test_fits_names_what_the_kernel_takes():
    x, w, _ = _case(2, 32, 8, 0, torch.float32)
    with torch.inference_mode():
        assert gemv.fits(x, w)
        assert not gemv.fits(x.double(), w.double())  # dtype
        assert not gemv.fits(x, w.T.contiguous().T)  # a strided weight (a TP slice)
        assert not gemv.fits(torch.randn(gemv.MAX_ROWS + 1, 32), w)
    assert not gemv.fits(x, w)  # autograd on
