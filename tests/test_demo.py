"""The RL demo, shortened, in each mode: it learns the task (held-out accuracy and reward rise),
every push changes what the engine serves, the engine agrees with the trainer on sampled tokens
and on whole next-token distributions, async mode sees staleness, and the outputs are written."""

import json
import subprocess
import sys

import pytest

from tandem.rl import report
from tandem.rl.loop import DemoConfig, run

SHORT = dict(steps=20, prompts_per_step=32, eval_every=5)


def _check(result: dict, config: DemoConfig, tol: float = 1e-4) -> dict:
    """``tol``: the sampled-token log-prob agreement. It is float32 rounding, which grows as the
    policy sharpens and samples rarer tokens (1e-6 at the start, 1.2e-5 after 20 steps, up to
    6e-5 after 150); a wrong or missing push moves log-probs by far more (the test fails on
    the version check, the probe change or this one). The whole-distribution KL stays ~2.5e-7."""
    steps, evals = result["steps"], result["evals"]
    base = 1 if config.warmup_steps else 0  # the warm-up pushes once
    assert [s["version"] for s in steps] == list(range(base + 1, base + config.steps + 1))
    for s in steps:
        trainer_version = s["version"] - 1  # what the trainers held when they took the batch
        staleness = [trainer_version - min(v) for v in s["sample_versions"]]
        assert s["staleness_max"] == max(staleness)
        assert s["staleness_mean"] == pytest.approx(sum(staleness) / len(staleness))
        if config.async_staleness is None:
            assert staleness == [0] * len(staleness)
            # the engine served exactly the trainer's weights: same log-probs for every token
            assert s["logprob_mismatch"] <= tol
        else:
            assert max(staleness) <= config.async_staleness
    assert result["final_check"]["version"] == base + config.steps
    assert result["final_check"]["logprob_mismatch"] <= tol
    # eval points: before the warm-up, after it, every eval_every RL steps
    points = sorted({*range(config.eval_every, config.steps + 1, config.eval_every), config.steps})
    assert [(e["phase"], e["step"]) for e in evals] == [("init", 0), ("start", 0)] + [
        ("rl", k) for k in points
    ]
    for e in evals:
        # whole next-token distributions at the probe positions: engine == trainer
        assert e["kl_max"] <= 1e-5 and e["logprob_gap_max"] <= 1e-4, e
    for e in evals[1:]:  # every version between two eval points changed what the engine serves
        assert e["probe_change"] > 1e-2, e
    summary = report.summary(result)
    # it learns: sampled reward and held-out greedy accuracy both rise
    assert summary["reward_end"] > summary["reward_start"] + 0.1, summary
    assert summary["eval_end"] > summary["eval_start"] + 0.05, summary
    assert summary["eval_start"] > summary["eval_init"]  # the warm-up taught the format
    assert summary["constant_policy_reward"] < 0.2
    return summary


@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["colocate", "disaggregated"])
def test_short_sync_demo_learns(placement, llama_dir, tmp_path):
    config = DemoConfig(model_dir=llama_dir, out_dir=str(tmp_path), placement=placement, **SHORT)
    result = run(config)
    result["summary"] = _check(result, config)
    log_path, plot_path = report.write(result, tmp_path)
    assert json.loads(log_path.read_text())["summary"]["max_logprob_mismatch"] <= 1e-4
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_short_async_demo_through_the_cli_sees_staleness_and_learns(llama_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "demo", "--async", "1", "--steps", "20",
         "--model-dir", llama_dir, "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step  20/20" in done.stdout and "held-out greedy accuracy" in done.stdout
    result = json.loads((tmp_path / "demo.json").read_text())
    config = DemoConfig(**result["config"])
    assert config.async_staleness == 1 and config.placement == "colocate"
    summary = _check(result, config)
    assert summary["staleness_max"] == 1  # rollouts really ran a version behind the trainer
    assert result["summary"] == summary
    assert (tmp_path / "demo.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_full_demo_meets_its_targets(tmp_path):
    config = DemoConfig(model_dir=str(tmp_path / "model"), out_dir=str(tmp_path))
    summary = _check(run(config), config, tol=3e-4)
    assert summary["eval_end"] - summary["eval_start"] >= 0.4, summary
    assert summary["eval_end"] >= summary["constant_policy_reward"] + 0.3, summary
