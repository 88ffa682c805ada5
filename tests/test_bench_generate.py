"""`tandem bench generate --quick`: the result has the documented shape and counts."""

from __future__ import annotations

import json
import math

import pytest

from tandem.bench.generate import SETUPS, run


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.timeout(300)
def test_quick_generate_bench_shape(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the model is cached under ./.tandem
    result = run(quick=True)
    json.dumps(result)  # serialisable as the CLI prints it
    assert result["benchmark"] == "generate" and result["quick"] is True
    assert (tmp_path / ".tandem/bench-llama-quick/config.json").is_file()
    assert set(result["model"]) >= {"params", "hidden", "layers", "heads", "kv_heads", "vocab"}
    assert all(_positive(result["model"][k]) for k in ("params", "hidden", "layers", "vocab"))
    assert isinstance(result["threads"], int) and result["threads"] >= 1
    _, _, _, (_, batch1_new), (requests, *_) = SETUPS[True]
    assert result["batch1"]["tokens"] == batch1_new
    assert result["mixed"]["requests"] == requests
    for name in ("batch1", "mixed"):
        entry = result[name]
        assert _positive(entry["tokens"])
        assert entry["tandem_tokens_counted"] == entry["tokens"]  # every request got its count
        assert entry["transformers_tokens_counted"] == entry["tokens"]
        for side in ("tandem", "transformers"):
            assert _positive(entry[f"{side}_tokens_per_s"]), (name, side)
    assert set(result["ratios"]) == {
        "batch1_vs_transformers", "mixed_vs_transformers", "continuous_vs_static",
    }  # fmt: skip
    batching = result["batching"]
    for mode in ("continuous", "static"):
        assert batching[mode]["tokens"] == result["mixed"]["tokens"]
        assert 0 < batching[mode]["latency_mean_s"] <= batching[mode]["latency_p99_s"]
        assert _positive(batching[mode]["tokens_per_s"])
    assert all(_positive(v) for v in result["ratios"].values())
    ratio = result["batch1"]["tandem_tokens_per_s"] / result["batch1"]["transformers_tokens_per_s"]
    assert result["ratios"]["batch1_vs_transformers"] == pytest.approx(ratio, rel=1e-2)
