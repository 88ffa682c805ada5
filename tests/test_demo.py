"""The RL demo, shortened, in each mode: versions, log-prob agreement, staleness, outputs."""

import json
import subprocess
import sys

import pytest

from tandem.rl import report
from tandem.rl.loop import DemoConfig, run

SHORT = dict(steps=3, prompts_per_step=4, group_size=4, max_tokens=8)


def _check(result: dict, config: DemoConfig) -> None:
    steps = result["steps"]
    assert [s["version"] for s in steps] == list(range(1, config.steps + 1))  # one push a step
    for s in steps:
        trainer_version = s["version"] - 1  # what the trainers held when they took the batch
        staleness = [trainer_version - min(v) for v in s["sample_versions"]]
        assert s["staleness_max"] == max(staleness)
        assert s["staleness_mean"] == pytest.approx(sum(staleness) / len(staleness))
        if config.async_staleness is None:
            assert staleness == [0] * len(staleness)
            # the engine served exactly the trainer's weights: same log-probs for every token
            assert s["logprob_mismatch"] <= 1e-5
        else:
            assert max(staleness) <= config.async_staleness
    assert result["final_check"]["version"] == config.steps
    assert result["final_check"]["logprob_mismatch"] <= 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["colocate", "disaggregated"])
def test_short_sync_demo(placement, llama_dir, tmp_path):
    config = DemoConfig(model_dir=llama_dir, out_dir=str(tmp_path), placement=placement, **SHORT)
    result = run(config)
    _check(result, config)
    result["summary"] = report.summary(result)
    log_path, plot_path = report.write(result, tmp_path)
    assert json.loads(log_path.read_text())["summary"]["max_logprob_mismatch"] <= 1e-5
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_short_async_demo_through_the_cli(llama_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "demo", "--async", "1", "--steps", "4",
         "--model-dir", llama_dir, "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step   4/4" in done.stdout and "reward" in done.stdout
    result = json.loads((tmp_path / "demo.json").read_text())
    config = DemoConfig(**result["config"])
    assert config.async_staleness == 1 and config.placement == "colocate"
    _check(result, config)
    assert (tmp_path / "demo.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_full_demo_reward_rises(tmp_path):
    config = DemoConfig(model_dir=str(tmp_path / "model"), out_dir=str(tmp_path))
    result = run(config)
    summary = report.summary(result)
    assert summary["reward_end"] > summary["reward_start"] + 0.5, summary
    assert summary["max_logprob_mismatch"] <= 1e-5
