"""The engine's GEMM (tandem.layers.gemm): both float32 kernels compute x W^T + b as F.linear
does (to float32 rounding), and the probe's choice follows the timings it is given."""

import pytest
import torch
import torch.nn.functional as F

from tandem.layers import gemm


@pytest.fixture(params=gemm.KERNELS)
def kernel(request, monkeypatch):
    if request.param == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(gemm, "_chosen", request.param)
    return request.param


@pytest.mark.parametrize("rows", [1, 7, 96])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(kernel, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(80, 96, generator=gen)
    b = torch.randn(80, generator=gen) if bias else None
    with torch.inference_mode():
        got = gemm.linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_takes_views(kernel):
    """Attention hands the output projection a flattened view; TP ranks hold slices."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 32, generator=gen).transpose(0, 1).flatten(1)[:, :64]
    w = torch.randn(48, 128, generator=gen)[:, ::2]
    with torch.inference_mode():
        got = gemm.linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_bfloat16_and_grad_take_f_linear(monkeypatch):
    """Only float32 without autograd goes to oneDNN's inner product."""
    monkeypatch.setattr(gemm, "_chosen", "onednn")
    calls = []
    monkeypatch.setattr(gemm, "_onednn", lambda *a: calls.append(a) or F.linear(*a))
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with torch.inference_mode():
        gemm.linear(x.bfloat16(), w.bfloat16())
    gemm.linear(x, w)  # grad mode on
    assert calls == []
    with torch.inference_mode():
        gemm.linear(x, w)
    assert len(calls) == 1


def test_choose_keeps_onednn_unless_f_linear_is_clearly_faster():
    assert gemm.choose({"onednn": 1.0, "torch": 2.0}) == "onednn"
    assert gemm.choose({"onednn": 1.05, "torch": 1.0}) == "onednn"  # within the margin
    assert gemm.choose({"onednn": 2.0, "torch": 1.0}) == "torch"


def test_probe_times_both(monkeypatch):
    seconds = gemm.probe()
    assert set(seconds) == set(gemm.KERNELS)
    assert all(0 < s < 1 for s in seconds.values())


def test_forced_kernel_and_bad_value(monkeypatch):
    monkeypatch.setenv("TANDEM_GEMM", "torch")
    assert gemm._kernel() == "torch"
    monkeypatch.setenv("TANDEM_GEMM", "mkl")
    with pytest.raises(ValueError, match="TANDEM_GEMM"):
        gemm._kernel()
