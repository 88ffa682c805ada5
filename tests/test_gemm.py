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
    monkeypatch.setattr(gemm, "_single", request.param)
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


def test_grad_and_other_dtypes_take_f_linear(monkeypatch):
    """float32 without autograd goes to oneDNN's inner product, and bfloat16 where oneDNN
    runs it natively; autograd and float16 take F.linear."""
    monkeypatch.setattr(gemm, "_chosen", "onednn")
    monkeypatch.setattr(gemm, "_single", "onednn")
    monkeypatch.setattr(gemm, "_bf16", False)
    calls = []
    monkeypatch.setattr(gemm, "_onednn", lambda *a: calls.append(a) or F.linear(*a))
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with torch.inference_mode():
        gemm.linear(x.bfloat16(), w.bfloat16())  # no native bf16 (as patched)
        gemm.linear(x.half(), w.half())
    gemm.linear(x, w)  # grad mode on
    assert calls == []
    with torch.inference_mode():
        gemm.linear(x, w)
        monkeypatch.setattr(gemm, "_bf16", True)
        gemm.linear(x.bfloat16(), w.bfloat16())
    assert [a[0].dtype for a in calls] == [torch.float32, torch.bfloat16]


BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(not BF16, reason="oneDNN has no native bfloat16 on this CPU")
@pytest.mark.parametrize("rows", [1, 7, 96, 300])
def test_bfloat16_packed_copy_equals_f_linear(rows):
    """Packed bfloat16 accumulates in float32 and rounds once, as F.linear does: equal."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(80, 96, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16()
    packed = gemm.PackedWeight()
    with torch.inference_mode():
        got = gemm.linear(x, w, b, packed)
    assert packed.held
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=2**-7, atol=1e-6)
    assert (got == F.linear(x, w, b)).float().mean() >= 0.99


def test_choose_keeps_onednn_unless_f_linear_is_clearly_faster():
    assert gemm.choose({"onednn": 1.0, "torch": 2.0}) == "onednn"
    assert gemm.choose({"onednn": 1.05, "torch": 1.0}) == "onednn"  # within the margin
    assert gemm.choose({"onednn": 2.0, "torch": 1.0}) == "torch"


def test_probe_times_both(monkeypatch):
    for rows in (1, gemm.PROBE_SHAPE[0]):
        seconds = gemm.probe(rows)
        assert set(seconds) == set(gemm.KERNELS)
        assert all(0 < s < 1 for s in seconds.values())


def test_one_row_and_batches_take_their_own_probed_kernel(monkeypatch):
    """A lone decode row runs the kernel probed at one row, every other count the batch's."""
    monkeypatch.setattr(gemm, "_chosen", "onednn")
    monkeypatch.setattr(gemm, "_single", "torch")
    calls = []
    monkeypatch.setattr(gemm, "_onednn", lambda *a: calls.append(a) or F.linear(*a))
    w = torch.randn(4, 8)
    with torch.inference_mode():
        gemm.linear(torch.randn(1, 8), w)
        gemm.linear(torch.randn(1, 1, 8), w)
        gemm.linear(torch.randn(2, 8), w)
    assert [a[0].shape[0] for a in calls] == [2]
    monkeypatch.setattr(gemm, "_single", None)
    monkeypatch.setattr(gemm, "probe", lambda rows: {"onednn": 2.0, "torch": 1.0})
    monkeypatch.delenv("TANDEM_GEMM", raising=False)
    assert gemm.kernel(1) == "torch" and gemm.kernel(5) == "onednn"


def test_forced_kernel_and_bad_value(monkeypatch):
    monkeypatch.setenv("TANDEM_GEMM", "torch")
    assert gemm._kernel() == "torch"
    monkeypatch.setenv("TANDEM_GEMM", "mkl")
    with pytest.raises(ValueError, match="TANDEM_GEMM"):
        gemm._kernel()


@pytest.mark.parametrize("rows", [1, 7, 96, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_copy_matches_f_linear(kernel, rows, bias):
    """The blocked copy serves every row count (it is packed for PACK_ROWS), 2-D and 3-D."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(80, 96, generator=gen)
    b = torch.randn(80, generator=gen) if bias else None
    packed = gemm.PackedWeight()
    with torch.inference_mode():
        got = gemm.linear(x, w, b, packed)
        got_3d = gemm.linear(x.view(1, rows, 96), w, b, packed)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_3d[0], got)
    assert packed.held == (kernel == "onednn")


def test_packed_copy_follows_torch_writes(kernel):
    """An in-place torch write bumps the weight's version counter: the next call repacks."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 64, generator=gen), torch.randn(32, 64, generator=gen)
    packed = gemm.PackedWeight()
    with torch.inference_mode():
        gemm.linear(x, w, packed=packed)
        w[3:9].mul_(-2.0)  # a push's box written through a view of the live weight
        got = gemm.linear(x, w, packed=packed)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_writes_torch_cannot_see_need_drop_packed(kernel):
    """A write through another mapping (the shared arena a trainer writes) leaves torch's
    version counter alone: the copy stays stale until `drop_packed`, which the engine's
    receiver and weight memory call."""
    if kernel != "onednn":
        pytest.skip("F.linear keeps no copy")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=gen)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(32, 64, generator=gen), requires_grad=False)
    layer.packed = gemm.PackedWeight()
    with torch.inference_mode():
        before = gemm.linear(x, layer.weight, packed=layer.packed)
        layer.weight.numpy()[:] *= -1.0  # no torch op: the version counter does not move
        stale = gemm.linear(x, layer.weight, packed=layer.packed)
        gemm.drop_packed(layer)
        assert not layer.packed.held
        fresh = gemm.linear(x, layer.weight, packed=layer.packed)
    torch.testing.assert_close(stale, before)  # why drop_packed exists
    torch.testing.assert_close(fresh, -before, rtol=1e-5, atol=1e-5)


def test_disable_packing_keeps_no_copy(kernel):
    layer = torch.nn.Linear(64, 32)
    layer.packed = gemm.PackedWeight()
    model = torch.nn.Sequential(layer)
    gemm.disable_packing(model)
    assert layer.packed is None and gemm.packed_weights(model) == []


def test_a_weight_onednn_will_not_reorder_runs_unpacked(kernel, monkeypatch):
    if kernel != "onednn":
        pytest.skip("F.linear keeps no copy")

    def refuse(weight, rows):
        raise RuntimeError("unsupported layout")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 32, generator=gen), torch.randn(16, 32, generator=gen)
    packed = gemm.PackedWeight()
    with torch.inference_mode():
        got = gemm.linear(x, w, packed=packed)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert not packed.held and packed.get(w) is w
