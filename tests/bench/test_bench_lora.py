"""`tandem bench generate --lora --quick --json` through the CLI: the documented figures and
ratios, sane (every side produced exactly the workload's tokens, every push was checked, an
adapter push needs a small fraction of a full push's bytes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("peft")

from support.paths import REPO
from tandem.bench.generate_lora import SIDES  # noqa: E402

SRC = REPO / "src"


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.timeout(240)
def test_quick_lora_bench_through_the_cli(tmp_path):
    # this checkout's tandem, whichever one the interpreter has installed
    path = [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "generate", "--lora", "--quick", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "generate_lora" and result["quick"] is True
    assert (tmp_path / ".tandem/bench-llama-quick/config.json").is_file()
    assert result["adapters"]["count"] == 4 and result["adapters"]["rank"] == 16
    assert len(result["adapters"]["targets"]) == 7
    mixed = result["mixed"]
    assert _positive(mixed["tokens"]) and _positive(mixed["requests"])
    for side in SIDES:
        assert mixed[f"{side}_tokens_counted"] == mixed["tokens"], side
        assert _positive(mixed[f"{side}_tokens_per_s"]) and _positive(mixed[f"{side}_seconds"])
    differing = mixed["warm_up_requests_differing_from_base"]
    assert differing["base_on_lora_engine"] == 0  # the base model, whatever engine serves it
    assert differing["lora_single"] > 0 and differing["lora_mixed"] > 0  # the adapters act
    pushes = result["pushes"]
    for kind in ("adapter", "full"):
        push = pushes[kind]
        assert push["bytes_needed"] == push["bytes_moved"] == push["params"] * 4  # float32
        assert 0 < push["seconds"] <= push["median_seconds"]
        assert push["checks"]["pushes_checked"] == pushes["repeats"] + 1
        assert push["checks"]["max_logprob_error"] < 1e-3
        assert _positive(push["generate_after_push_seconds"])
        assert _positive(push["generate_again_seconds"])
    # rank 16 on every projection of the quick model: about an eighth of its weights
    assert pushes["adapter"]["params"] == result["adapters"]["params_each"]
    ratios = result["ratios"]
    assert set(ratios) == {
        "lora_mixed_vs_base",
        "lora_single_vs_base",
        "base_on_lora_engine_vs_base",
        "adapter_push_bytes_vs_full",
        "adapter_push_seconds_vs_full",
    }
    assert all(_positive(v) for v in ratios.values())
    assert ratios["adapter_push_bytes_vs_full"] < 0.2
    assert ratios["adapter_push_bytes_vs_full"] == round(
        pushes["adapter"]["bytes_needed"] / pushes["full"]["bytes_needed"], 4
    )
