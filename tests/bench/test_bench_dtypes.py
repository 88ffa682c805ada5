"""`tandem bench sync --engine-dtypes --quick` and `tandem bench generate --engine-dtypes
--quick`: the documented figures, bytes as counted (a block-FP8 engine's linear layers take
about a quarter of float32's), and every push scored against the weights as each engine
holds them (the bench raises otherwise)."""

from __future__ import annotations

import json

import pytest

from tandem.bench import generate_dtypes, sync_dtypes
from tandem.bench.generate_bf16 import native_bf16_missing


@pytest.mark.slow  # the pushes into each dtype are tested in test_fp8 / test_exchange_bf16
@pytest.mark.timeout(400)
def test_quick_sync_into_each_engine_dtype(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = sync_dtypes.run(quick=True)
    json.dumps(result)
    f32, bf16, fp8 = result["float32"], result["bfloat16"], result["fp8"]
    assert bf16["bytes_needed"] * 2 == f32["bytes_needed"]
    for engine in (f32, bf16, fp8):
        for mode in ("shm", "dist"):
            push = engine[mode]
            assert push["bytes_moved"] == push["bytes_needed"] == engine["bytes_needed"]
            assert push["seconds"] > 0
        assert engine["checks"]["pushes_checked"] > 0
    linear = fp8["linear_weights"]
    assert linear["bytes"] == linear["params"] + 4 * linear["scales"]
    # the FP8 engine holds the linear layers at one byte a weight, the rest in float32; a
    # block that a TP shard boundary cuts has its scale on both ranks
    floor = f32["bytes_needed"] - 3 * linear["params"] + 4 * linear["scales"]
    assert floor <= fp8["bytes_needed"] <= floor + 4 * linear["scales"]
    assert 0.25 < result["ratios"]["fp8_linear_bytes_vs_float32"] < 0.26


@pytest.mark.timeout(300)
def test_quick_generate_on_each_engine_dtype(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = generate_dtypes.run(quick=True)
    json.dumps(result)
    expected = set(generate_dtypes.ENGINES)
    if native_bf16_missing():
        expected -= set(generate_dtypes.NEEDS_BF16)
        assert result["bf16"]["skipped"]
    assert set(result["engines"]) == expected
    for scenario in ("batch1", "grpo"):
        for name in expected:
            assert result[scenario][f"{name}_tokens_per_s"] > 0
    assert "batch1_fp8_vs_float32" in result["ratios"]
    assert "grpo_fp8_dequantize_each_call_vs_float32_unpacked" in result["ratios"]
