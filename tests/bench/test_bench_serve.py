"""`tandem bench serve --quick --json`: the result has the documented shape, every request
completed, and the servers are gone afterwards. No speed assertion: speed is for benchmarks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tandem.bench.serve import MODES, SETUPS
from tandem.bench.serve_load import poisson_offsets

FIGURES = (
    "tokens_per_s",
    "requests_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "latency_p50_s",
    "latency_p99_s",
)


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.timeout(300)
def test_quick_serve_bench(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "serve", "--quick", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # stdout is the JSON alone: the servers' output is not on it
    setup = SETUPS[True]
    assert result["benchmark"] == "serve" and result["quick"] is True
    assert (tmp_path / setup.model_dir / "config.json").is_file()
    assert all(_positive(result["model"][k]) for k in ("params", "hidden", "layers", "vocab"))
    assert result["server"]["max_num_seqs"] == setup.max_num_seqs
    workload = result["workload"]
    assert workload["requests"] == setup.requests
    lo, hi = setup.max_tokens
    assert lo * setup.requests <= workload["output_tokens"] <= hi * setup.requests
    assert [e["rate_rps"] for e in result["sweep"]] == [*setup.rates_rps, None]
    assert result["sweep"][-1]["arrivals"] == "burst"
    for entry in result["sweep"]:
        for mode in MODES:
            m = entry[mode]
            assert (m["completed"], m["failed"], m["errors"]) == (setup.requests, 0, []), m
            assert m["tokens"] == workload["output_tokens"]  # every request got max_tokens
            assert all(_positive(m[k]) for k in FIGURES), m
            assert m["ttft_p50_s"] <= m["ttft_p99_s"] and m["latency_p50_s"] <= m["latency_p99_s"]
            assert m["ttft_p99_s"] <= m["latency_p99_s"]
        assert _positive(entry["continuous_vs_fifo"]) and _positive(entry["continuous_lof_vs_fifo"])
    assert set(result["ratios"]) == {"continuous_vs_fifo", "continuous_lof_vs_fifo"}
    for name, ratio in result["ratios"].items():
        assert ratio == result["sweep"][-1][name]
    assert set(result["peak_rss_bytes"]) == set(MODES)
    rss = result["peak_rss_bytes"].values()
    assert all(v is None or _positive(v) for v in rss)
    assert result["exit_codes"] == {mode: 0 for mode in MODES}  # clean SIGTERM shutdowns
    assert _processes_in(tmp_path) == []  # every server is gone


def _processes_in(cwd) -> list[int]:
    """Live processes whose working directory is ``cwd`` (the servers ran there)."""
    found = []
    if not os.path.isdir("/proc"):
        return found
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/cwd") == str(cwd):
                found.append(int(entry))
        except OSError:
            continue  # gone meanwhile, or not ours
    return found


def test_poisson_offsets():
    burst = poisson_offsets(5, None, seed=1)
    assert burst == [0.0] * 5
    slow, fast = poisson_offsets(200, 1.0, seed=1), poisson_offsets(200, 4.0, seed=1)
    assert slow[0] == 0.0 and slow == sorted(slow)
    assert fast == pytest.approx([t / 4 for t in slow])  # same gaps, scaled by the rate
    assert 150 < slow[-1] < 250  # mean gap 1 s
