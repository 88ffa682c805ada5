"""The engine's GEMM (tandem.layers.gemm): every float32 kernel computes x W^T + b as F.linear
does (to float32 rounding), calls go to the kernel chosen for their regime of rows, and the
choice (tandem.layers.gemm_choice) follows the timings it is given."""

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import gemv
from tandem.layers import gemm, gemm_choice

REGIMES = ("one", "few", "batch")


def force(
    monkeypatch,
    one: str,
    few: str | None = None,
    batch: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """``dtype`` calls run ``one`` at a row, ``few`` at 2..MAX_ROWS, ``batch`` past that."""
    chosen = dict(zip(REGIMES, (one, few or one, batch or one), strict=True))
    monkeypatch.setattr(gemm_choice, "_chosen", {(dtype, r): k for r, k in chosen.items()})


@pytest.fixture(params=gemm_choice.KERNELS)
def kernel(request, monkeypatch):
    """Every float32 regime on one kernel (GEMV: batches on oneDNN, it takes at most a few)."""
    if request.param == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    if request.param == "gemv" and not gemv.available():
        pytest.skip("the GEMV kernel does not build here")
    force(monkeypatch, request.param, batch="onednn" if request.param == "gemv" else None)
    return request.param


def batch_kernel(kernel: str) -> str:
    return "onednn" if kernel == "gemv" else kernel


@pytest.mark.parametrize("rows", [1, 3, 7, 96])
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
    for rows in (1, 4):
        x = torch.randn(5, rows, 32, generator=gen).transpose(0, 1).flatten(1)[:, :64]
        w = torch.randn(48, 128, generator=gen)[:, ::2]
        with torch.inference_mode():
            got = gemm.linear(x, w)
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_grad_and_other_dtypes_take_f_linear(monkeypatch):
    """float32 batches without autograd go to oneDNN's inner product, and bfloat16 batches
    where oneDNN runs it natively; autograd and float16 take F.linear."""
    force(monkeypatch, "onednn")
    monkeypatch.setattr(gemm_choice, "_bf16", False)
    calls = []
    monkeypatch.setattr(gemm, "onednn", lambda *a: calls.append(a) or F.linear(*a))
    x, w = torch.randn(6, 8), torch.randn(4, 8)
    with torch.inference_mode():
        gemm.linear(x.bfloat16(), w.bfloat16())  # no native bf16 (as patched)
        gemm.linear(x.half(), w.half())
    gemm.linear(x, w)  # grad mode on
    assert calls == []
    with torch.inference_mode():
        gemm.linear(x, w)
        monkeypatch.setattr(gemm_choice, "_bf16", True)
        del gemm_choice._chosen[torch.bfloat16, "batch"]  # decided once a process: decide again
        gemm.linear(x.bfloat16(), w.bfloat16())
    assert [a[0].dtype for a in calls] == [torch.float32, torch.bfloat16]


BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.skipif(not BF16, reason="oneDNN has no native bfloat16 on this CPU")
@pytest.mark.parametrize("rows", [1, 7, 96, 300])
def test_bfloat16_packed_copy_equals_f_linear(rows, monkeypatch):
    """Packed bfloat16 accumulates in float32 and rounds once, as F.linear does: equal (every
    regime on oneDNN: the probe may give one or a few rows to another kernel)."""
    force(monkeypatch, "onednn", dtype=torch.bfloat16)
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


def test_choose_keeps_the_preferred_kernel_unless_another_is_clearly_faster():
    choose = gemm_choice.choose
    assert choose({"onednn": 1.0, "torch": 2.0}, "onednn") == "onednn"
    assert choose({"onednn": 1.05, "torch": 1.0}, "onednn") == "onednn"  # within the margin
    assert choose({"onednn": 2.0, "torch": 1.0}, "onednn") == "torch"
    assert choose({"onednn": 1.0, "torch": 2.0, "gemv": 1.05}, "gemv") == "gemv"
    assert choose({"onednn": 1.0, "torch": 2.0, "gemv": 1.5}, "gemv") == "onednn"
    assert choose({"torch": 1.0, "gemv": 3.0}, "onednn") == "torch"  # not a candidate
    by = gemm_choice.STACK_MARGIN  # where the decode stack serves: GEMV holds against more
    assert choose({"onednn": 1.0, "gemv": 1.2}, "gemv", by) == "gemv"
    assert choose({"onednn": 1.0, "gemv": 1.5}, "gemv", by) == "onednn"
    assert gemm_choice.margin("batch") == gemm_choice.MARGIN


def test_regimes_by_rows():
    assert gemm_choice.regime(1) == "one"
    assert [gemm_choice.regime(r) for r in range(2, gemv.MAX_ROWS + 1)] == ["few"] * (
        gemv.MAX_ROWS - 1
    )
    assert gemm_choice.regime(gemv.MAX_ROWS + 1) == "batch"


def test_probe_times_every_candidate_past_the_cache(monkeypatch):
    """The one/few regimes cycle through a working set past the last-level cache."""
    assert gemm_choice.last_level_cache_bytes() > 0
    ws = gemm_choice.working_set_bytes()
    assert gemm_choice.MIN_WORKING_SET <= ws <= gemm_choice.MAX_WORKING_SET
    assert ws >= min(2 * gemm_choice.last_level_cache_bytes(), gemm_choice.MAX_WORKING_SET)
    monkeypatch.setattr(gemm_choice, "working_set_bytes", lambda: 8 << 20)  # a fast test
    for where in REGIMES:
        seconds = gemm_choice.probe(torch.float32, where)
        assert set(seconds) == set(gemm_choice.candidates(torch.float32, where))
        assert all(0 < s < 1 for s in seconds.values())
    assert "gemv" not in gemm_choice.candidates(torch.float32, "batch")
    assert "gemv" in gemm_choice.candidates(torch.float32, "one") or not gemv.available()


def test_each_regime_runs_its_own_kernel(monkeypatch):
    """A lone decode row, a few rows and a batch each run the kernel chosen for them."""
    if not gemv.available():
        pytest.skip("the GEMV kernel does not build here")
    force(monkeypatch, "gemv", few="torch", batch="onednn")
    calls = []
    monkeypatch.setattr(gemm, "onednn", lambda *a: calls.append(("onednn", len(a[0]))))
    monkeypatch.setattr(gemv, "gemv", lambda *a: calls.append(("gemv", len(a[0]))))
    monkeypatch.setattr(gemm.F, "linear", lambda *a: calls.append(("torch", len(a[0]))))
    w = torch.randn(4, 8)
    with torch.inference_mode():
        for rows in (1, 2, gemv.MAX_ROWS, gemv.MAX_ROWS + 1):
            gemm.linear(torch.randn(rows, 8), w)
    assert calls == [("gemv", 1), ("torch", 2), ("torch", gemv.MAX_ROWS), ("onednn", 5)]


def test_choice_is_probed_once_per_dtype_and_regime(monkeypatch):
    monkeypatch.setattr(gemm_choice, "_chosen", {})
    monkeypatch.delenv("TANDEM_GEMM", raising=False)
    probed = []

    def probe(dtype, where):
        probed.append((dtype, where))
        return {
            k: {"onednn": 2.0, "torch": 1.0, "gemv": 3.0}[k]
            for k in gemm_choice.candidates(dtype, where)
        }

    monkeypatch.setattr(gemm_choice, "probe", probe)
    assert gemm_choice.kernel(torch.float32, 1) == "torch"
    assert gemm_choice.kernel(torch.float32, 1) == "torch"
    assert gemm_choice.kernel(torch.float32, 3) == "torch"
    assert gemm_choice.kernel(torch.float32, 64) == "torch"
    assert probed == [(torch.float32, "one"), (torch.float32, "few"), (torch.float32, "batch")]


def test_forced_kernel_and_bad_value(monkeypatch):
    monkeypatch.setattr(gemm_choice, "_chosen", {})
    monkeypatch.setattr(gemm_choice, "probe", lambda *a: pytest.fail("forced: no probe"))
    monkeypatch.setenv("TANDEM_GEMM", "torch")
    assert gemm_choice.kernel(torch.float32, 1) == "torch"
    assert gemm_choice.kernel(torch.float32, 64) == "torch"
    monkeypatch.setenv("TANDEM_GEMM", "mkl")
    monkeypatch.setattr(gemm_choice, "_chosen", {})
    with pytest.raises(ValueError, match="TANDEM_GEMM"):
        gemm_choice.kernel(torch.float32, 1)


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
    ran = batch_kernel(kernel) if rows > gemv.MAX_ROWS else kernel
    assert packed.held == (ran == "onednn")


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
    if batch_kernel(kernel) != "onednn":
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
    if batch_kernel(kernel) != "onednn":
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
