"""The engine/trainer mismatch correction (`tandem.rl.grpo.correct_mismatch`) on hand-computed
tensors: TIS truncates each token's importance weight at the cap, MIS drops the tokens over it,
and without a correction the loss is the demo's loss as it always was. The demo's options for it
are checked too (`DemoConfig`, `tandem demo` flags)."""

import json
import math

import pytest
import torch

from tandem.cli import parser
from tandem.rl.config import DemoConfig
from tandem.rl.grpo import correct_mismatch, policy_loss

# the trainer's log-probs and the engine's for three sampled tokens: ratios e, 1 and 2/3
TRAINER = [[-0.5, -1.0, -2.0]]
ENGINE = [[-1.5, -1.0, -2.0 + math.log(1.5)]]


def _loss(correction: str, trainer=TRAINER, engine=ENGINE, advantages=(1.0,), mask=None):
    """(loss, d loss / d trainer log-probs, the correction) at cap 2."""
    logp = torch.tensor(trainer, requires_grad=True)
    engine_logp = torch.tensor(engine)
    mask = torch.ones_like(engine_logp) if mask is None else torch.tensor(mask)
    corr = correct_mismatch(logp, engine_logp, mask, correction, cap=2.0)
    loss, _ = policy_loss(
        logp, corr.old_logp, torch.tensor(advantages), corr.mask, is_weight=corr.weight
    )
    loss.backward()
    return loss.item(), logp.grad[0].tolist(), corr


@pytest.mark.timeout(30)
def test_tis_truncates_the_weight_at_the_cap():
    loss, grad, corr = _loss("tis")
    # weights min(e, 2) = 2, 1, 2/3; the PPO ratio against the trainer's own log-probs is 1
    assert corr.weight[0].tolist() == pytest.approx([2.0, 1.0, 2 / 3])
    assert torch.equal(corr.old_logp, torch.tensor(TRAINER))
    assert loss == pytest.approx(-(2 + 1 + 2 / 3) / 3)
    # the gradient is the policy gradient weighted per token: -w * A / tokens
    assert grad == pytest.approx([-2 / 3, -1 / 3, -2 / 9])
    assert corr.over_cap[0].tolist() == [True, False, False]
    assert corr.ratio[0].tolist() == pytest.approx([math.e, 1.0, 2 / 3])


@pytest.mark.timeout(30)
def test_mis_masks_the_tokens_over_the_cap():
    loss, grad, corr = _loss("mis")
    # the token over the cap leaves the loss and its token count; the others keep their ratio
    assert corr.mask[0].tolist() == [0.0, 1.0, 1.0]
    assert corr.weight[0].tolist() == pytest.approx([0.0, 1.0, 2 / 3])
    assert loss == pytest.approx(-(1 + 2 / 3) / 2)
    assert grad == pytest.approx([0.0, -1 / 2, -1 / 3])


@pytest.mark.timeout(30)
def test_no_correction_is_the_old_loss():
    """``"none"``: the PPO ratio against the engine's log-probs, as the demo's loss always was,
    bit for bit (value and gradient), with a negative advantage and padding too."""
    trainer = [[-0.5, -1.0, -2.0], [-0.3, -0.2, -4.0]]
    engine = [[-1.5, -1.0, -1.6], [-0.1, -0.9, 0.0]]
    mask = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    loss, grad, corr = _loss("none", trainer, engine, (1.0, -0.5), mask)
    assert corr.weight is None and torch.equal(corr.old_logp, torch.tensor(engine))
    logp = torch.tensor(trainer, requires_grad=True)
    old, _ = policy_loss(logp, torch.tensor(engine), torch.tensor([1.0, -0.5]), torch.tensor(mask))
    old.backward()
    assert loss == old.item() and grad == logp.grad[0].tolist()
    # the padded token (engine 0, trainer -4: ratio e^-4 * 0) is counted nowhere
    assert corr.ratio[1, 2] == 0.0 and not corr.over_cap[1, 2]


@pytest.mark.timeout(30)
def test_every_correction_is_the_policy_gradient_when_the_engine_agrees():
    """A float32 engine serves the trainer's log-probs: every weight is 1, nothing is over the
    cap, and the three losses give the same gradient."""
    grads = [_loss(c, TRAINER, TRAINER)[1] for c in ("none", "tis", "mis")]
    assert grads[0] == pytest.approx([-1 / 3] * 3)
    assert grads[1] == grads[0] and grads[2] == grads[0]
    assert not _loss("tis", TRAINER, TRAINER)[2].over_cap.any()


@pytest.mark.timeout(30)
def test_an_unknown_correction_is_refused():
    with pytest.raises(ValueError, match="is_correction"):
        correct_mismatch(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "clip", 2.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("field", "value"),
    [("engine_dtype", "float16"), ("is_correction", "TIS"), ("is_cap", 0.5), ("is_cap", "2")],
)
def test_demo_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        DemoConfig(**{field: value})


@pytest.mark.timeout(30)
def test_engine_options_per_dtype():
    assert DemoConfig().engine_options() == {"dtype": "float32"}
    assert DemoConfig(engine_dtype="bfloat16").engine_options() == {"dtype": "bfloat16"}
    assert DemoConfig(engine_dtype="fp8").engine_options() == {
        "dtype": "bfloat16",
        "quantization": "fp8",
    }


@pytest.mark.timeout(30)
def test_demo_flags():
    args = parser().parse_args(
        ["demo", "--engine-dtype", "bfloat16", "--is-correction", "mis", "--is-cap", "3"]
    )
    assert (args.engine_dtype, args.is_correction, args.is_cap) == ("bfloat16", "mis", 3.0)
    args = parser().parse_args(["demo"])
    assert (args.engine_dtype, args.is_correction, args.is_cap) == ("float32", "none", 2.0)


def test_the_runs_figure_plots_each_run(tmp_path):
    """`python -m tandem.rl.compare OUT DIR...` reads each run's demo.json and writes the PNG."""
    from tandem.rl import compare

    for i, dtype in enumerate(("float32", "fp8")):
        run_dir = tmp_path / dtype
        run_dir.mkdir()
        evals = [
            {"phase": "start", "step": 0, "reward": 0.3},
            {"phase": "rl", "step": 5, "reward": 0.5 + i / 10},
        ]
        steps = [
            {"step": k, "reward_mean": 0.2 + k / 10, "logprob_gap_mean": 1e-3 * (k + 1)}
            for k in range(1, 6)
        ]
        result = {
            "config": {"engine_dtype": dtype, "is_correction": "tis"},
            "evals": evals,
            "steps": steps,
        }
        (run_dir / "demo.json").write_text(json.dumps(result))
    out = tmp_path / "runs.png"
    assert compare.main([str(out), str(tmp_path / "float32"), str(tmp_path / "fp8")]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
