"""The demo's task, GRPO's advantages and loss, and the KL used for the agreement check, by hand."""

import itertools
import math

import pytest
import torch

from tandem.rl.evaluate import next_token_kl
from tandem.rl.grpo import group_advantages, policy_loss
from tandem.rl.task import Problem, ReverseTask


def test_reward_is_checked_on_the_decoded_text_against_the_prompt():
    p = Problem("472")
    assert p.prompt == "Q:472\nA:" and p.answer == "274"
    assert ReverseTask.reward(p, "274") == 1.0
    assert ReverseTask.reward(p, " 274\nQ:99") == 1.0  # the first line, stripped
    assert ReverseTask.reward(p, "472") == pytest.approx(1 / 3)  # the middle digit only
    assert ReverseTask.reward(p, "27") == pytest.approx(2 / 3)
    assert ReverseTask.reward(p, "2745") == pytest.approx(3 / 4)  # extra characters cost
    assert ReverseTask.reward(p, "") == 0.0 and ReverseTask.reward(p, "  \n") == 0.0
    assert ReverseTask.reward(p, "abc") == 0.0
    assert ReverseTask.exact(p, "274\n") and not ReverseTask.exact(p, "2745")
    # the same text scores differently on another prompt: the reward depends on the prompt
    assert ReverseTask.reward(Problem("123"), "274") == 0.0


def test_held_out_problems_are_never_trained_on():
    task = ReverseTask(seed=3)
    held = {p.digits for p in task.held_out()}
    assert len(held) == 100
    seen = {
        p.digits
        for step in range(200)
        for stream in ("rl", "warmup")
        for p in task.problems(step, 64, stream)
    }
    assert not seen & held
    assert len(seen) == 900  # every other problem is drawn
    assert task.problems(5, 8) == task.problems(5, 8)  # seeded
    assert task.problems(5, 8) != task.problems(5, 8, "warmup")
    assert {p.digits for p in ReverseTask(seed=4).held_out()} != held


def test_constant_policy_reward_is_the_best_any_fixed_completion_gets():
    task = ReverseTask(seed=0, digits=2, held_out=20)
    problems = task.held_out()
    alphabet = "0123456789x"
    best = max(
        sum(task.reward(p, "".join(c)) for p in problems) / len(problems)
        for n in range(0, 4)
        for c in itertools.product(alphabet, repeat=n)
    )
    assert task.constant_policy_reward(problems) == pytest.approx(best)
    # and it is low: the demo's 3-digit held-out set
    demo = ReverseTask()
    assert demo.constant_policy_reward(demo.held_out()) < 0.2


def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5, 0.2, 0.2], group_size=2)
    assert adv[0] == pytest.approx(0.5 / (0.5 + 1e-4)) and adv[1] == pytest.approx(-adv[0])
    assert adv[2:4] == [0.0, 0.0]  # a group with one reward teaches nothing
    assert adv[4:] == [0.0, 0.0]
    r = [0.1, 0.4, 0.9, 0.2]
    mean, std = sum(r) / 4, math.sqrt(sum((x - sum(r) / 4) ** 2 for x in r) / 4)
    assert group_advantages(r, 4) == pytest.approx([(x - mean) / (std + 1e-4) for x in r])


def test_policy_loss_on_policy_is_the_policy_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[:, :4]  # any differentiable log-probs [B=3, T=4]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1.0]])
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, stats = policy_loss(logp, logp.detach(), adv, mask)
    # ratio 1 everywhere: loss = -mean over real tokens of A * ratio, gradient = -A * dlogp / n
    assert loss.item() == pytest.approx(-(3 * 1.0 + 2 * -2.0 + 4 * 0.5) / 9)
    assert stats["clip_fraction"] == 0.0 and stats["ratio_max"] == pytest.approx(1.0)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    reference = -(adv[:, None] * logp * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(reference, logits)
    assert torch.allclose(grad, expected)


def test_policy_loss_clips_stale_samples():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -0.1]])  # ratios e^1 (clipped) and e^0.1 (inside 1.2)
    loss, stats = policy_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), clip=0.2)
    assert stats["clip_fraction"] == 0.5 and stats["ratio_max"] == pytest.approx(math.e)
    assert loss.item() == pytest.approx(-(1.2 + math.exp(0.1)) / 2)
    loss.backward()
    # a positive advantage beyond 1 + clip gets no gradient; the other token does
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] == pytest.approx(-math.exp(0.1) / 2)


def test_next_token_kl_matches_torch():
    torch.manual_seed(1)
    p = torch.log_softmax(torch.randn(50, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.randn(50, dtype=torch.float64), -1)
    expected = torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum").item()
    assert next_token_kl(p.tolist(), q.tolist()) == pytest.approx(expected)
    assert next_token_kl(p.tolist(), p.tolist()) == 0.0
    with pytest.raises(ValueError, match="vocabulary sizes differ"):
        next_token_kl([0.0], [0.0, 0.0])


@pytest.mark.parametrize(
    "field, value",
    [
        ("steps", 0),
        ("group_size", 1),
        ("warmup_steps", -1),
        ("warmup_batch", 1),
        ("prompts_per_step", 1),
        ("eval_every", 0),
        ("digits", 5),
        ("lr", 0.0),
        ("placement", "remote"),
        ("async_staleness", 0),
    ],
)
def test_demo_config_errors_name_the_field(field, value):
    from tandem.rl.config import DemoConfig

    with pytest.raises(ValueError, match=field):
        DemoConfig(**{field: value})
