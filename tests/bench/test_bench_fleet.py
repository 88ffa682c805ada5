"""`tandem bench fleet --quick`: the documented shape, and the counted bytes at their targets
(the trainers send one copy whatever the number of replicas; each replica takes in its own)."""

from __future__ import annotations

import json
import math

import pytest

from tandem.bench.fleet import FLEETS, run
from tandem.bench.sync_baselines import REPEATS


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.slow  # 80 s; the rolling bench's quick run below stays in make test
@pytest.mark.timeout(400)
def test_quick_fleet_bench_shape_and_counted_bytes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the models are cached under ./.tandem
    result = run(quick=True)
    json.dumps(result)
    assert result["benchmark"] == "fleet" and result["quick"] is True
    fleets = result["push"]["fleets"]
    assert sorted(fleets) == sorted(f"dp{r}_tp{t}" for r, t in FLEETS)
    for f in fleets.values():
        for mode in ("shm", "dist"):
            push = f[mode]
            assert push["transport"] == mode and _positive(push["seconds"])
            assert push["trainer_egress_over_needed"] == 1.0  # counted by the transports
            assert push["ingress_over_needed"] == [1.0] * f["replicas"]  # counted per replica
            assert _positive(push["predicted_seconds"])  # the link model of this host
            assert push["predicted_over_measured"] == pytest.approx(
                push["predicted_seconds"] / push["seconds"], abs=1e-3
            )
            # dist: trainers into replica 0, then every relay hop; shm: no stream at all
            assert ("deliver" in push["predicted_phases"]) and "commit" in push["predicted_phases"]
        relayed = f["dist"]["bytes_relayed"]  # the chain: every replica but the last passes on
        assert relayed == [f["dist"]["bytes_needed"]] * (f["replicas"] - 1) + [0]
        assert _positive(f["naive"]["seconds"]) and f["naive"]["send"] in ("broadcast", "isend")
        assert len(f["naive"]["checked_pieces"]) == f["replicas"] * f["tensor_parallel_size"]
    model = result["push"]["link_model"]
    assert _positive(model["stream_Bps"]) and _positive(model["checked_copy_one_Bps"])
    checks = result["push"]["checks"]
    assert checks["pushes_checked"] >= len(FLEETS) * 2 * 2
    assert checks["max_abs_logprob_error"] <= checks["tolerance"]
    routing = result["routing"]
    for name in ("grpo", "mixed"):
        entry = routing[name]
        assert _positive(entry["dp1_tokens_per_s"]) and _positive(entry["dp2_tokens_per_s"])
        assert sum(entry["dp2_engine"]["requests_per_replica"]) == entry["requests"] * REPEATS
        assert min(entry["dp2_engine"]["requests_per_replica"]) > 0  # both replicas served
    assert set(result["ratios"]) == {
        "fleet_vs_naive",
        "fleet_gloo_vs_naive",
        "dp2_vs_dp1",
        "dp2_vs_dp1_mixed",
    }
    assert all(_positive(v) for v in result["ratios"].values())


@pytest.mark.timeout(300)
def test_quick_rolling_bench_shape_and_fault_figures(tmp_path, monkeypatch):
    from tandem.bench.fleet_rolling import REPLICAS
    from tandem.bench.fleet_rolling import run as rolling

    monkeypatch.chdir(tmp_path)
    result = rolling(quick=True)
    json.dumps(result)
    assert result["benchmark"] == "fleet-rolling" and result["replicas"] == REPLICAS
    assert all(_positive(v) for v in result["tokens_per_s"].values())
    assert result["pushes"]["all"] >= 1 and result["pushes"]["rolling"] >= 1
    assert result["failed_requests"] == 0, result["failures"]  # nothing refused under pushes
    fault = result["fault"]  # the killed replica left the push, the others committed
    assert fault["committed"] == list(range(REPLICAS - 1))
    assert list(fault["failed"]) == [REPLICAS - 1]
    assert fault["quarantined_s"] is not None and fault["quarantined_s"] < 5
    assert fault["rejoined_equal"] is True
    assert set(result["ratios"]) == {"rolling_vs_steady", "all_vs_steady", "rolling_vs_all"}
