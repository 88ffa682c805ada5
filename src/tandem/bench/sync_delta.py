"""`tandem bench sync --delta`: delta pushes against dense ones, step by step of a real RL run.

The run: the bench's sync model (`tandem.bench.sync.bench_model`: 142.6M parameters; ``--quick``
a few MiB) in float32 as the trainer (this process, one rank, transformers), served by
``LLM(tensor_parallel_size=2, dtype="bfloat16")`` in this process; the demo's task
(`tandem.rl.task.ReverseTask`: reverse 3 digits). As in the demo, a supervised warm-up
(``WARMUP`` AdamW steps at ``WARMUP_LR`` on prompts and their answers) first teaches the
answer's format, so rewards differ within a group. Each RL step samples ``GROUP`` completions
of ``PROMPTS`` problems from the engine (temperature 1, the engine's log-probs kept), scores
them, and takes one AdamW step on the demo's GRPO loss (`tandem.rl.grpo`: group-relative
advantages, the clipped surrogate against the engine's log-probs). It runs ``STEPS`` steps at
each learning rate of ``LRS``, from the same warmed-up start.

After each step, for each transport (shm, dist = torch.distributed gloo point to point,
mooncake), all staged and verified, into the same engine:

- ``dense``: a sender with ``delta=False`` pushes the new weights (timed);
- the delta sender pushes the weights from before the step (untimed: the engine then holds
  exactly what its shadow holds), then the new ones with ``delta=True`` (timed).

Per step and transport: the density (elements whose bfloat16 value changed, of all), bytes
moved by each, seconds of each (the push's wall time: encoding, staging, the engine's apply
and checks), the encoding's own seconds, and the engine's window (its phases: apply and the
whole-box checks for the delta). After the dense and the delta push of a step the engine's
greedy output (tokens and log-probs) is the same, bit for bit (``identical``).

``ratios``: at lr 1e-6, the median over steps of delta over dense bytes
(``delta_bytes_vs_dense``) and seconds per transport (``delta_<t>_seconds_vs_dense``); the
per-lr medians are in ``by_lr``. Then the same at lr 1e-6 into a fleet,
``LLM(data_parallel_size=3)`` of TP=1 replicas (``fleet``; ``fleet_delta_*`` ratios), the
trainer sending each push once (dist: relayed replica to replica; shm: one staging every
replica reads; Mooncake: every replica reads the trainer's memory). ``delta="auto"`` (the
default) sends a delta over dist and Mooncake where it carries at most half the dense bytes,
and stays dense over shm.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from tandem.bench.phases import Phases
from tandem.bench.sync import bench_model, weights_of

TRANSPORTS = ("shm", "dist", "mooncake")
LRS = (1e-6, 1e-5)
HEADLINE_LR = 1e-6
KV_CACHE_MEMORY = 64 << 20
# quick -> (RL steps per learning rate, problems per step, samples per problem)
SIZES = {False: (5, 16, 4), True: (2, 4, 2)}
WARMUP = {False: 6, True: 2}  # supervised steps of 32 problems
FLEET = 3  # replicas (TP=1 each) of the fleet run
FLEET_STEPS = {False: 3, True: 1}
WARMUP_LR = 3e-4


def run(quick: bool = False) -> dict[str, Any]:
    import transformers

    from tandem import LLM, SamplingParams
    from tandem.rl.task import ReverseTask

    phases = Phases()
    steps, prompts, group = SIZES[quick]
    path = bench_model(quick)
    params, weight_bytes = weights_of(path)
    task = ReverseTask(seed=0, digits=3)
    sampling = SamplingParams(n=group, max_tokens=4, temperature=1.0, logprobs=0, seed=0)
    result: dict[str, Any] = {
        "benchmark": "sync-delta",
        "quick": quick,
        "model": {"params": params, "bytes": weight_bytes, "trainer_dtype": "float32"},
        "engine": {"tensor_parallel_size": 2, "dtype": "bfloat16"},
        "trainer": {"ranks": 1, "optimizer": "AdamW", "lrs": list(LRS)},
        "rl": {
            "task": task.name,
            "warmup_steps": WARMUP[quick],
            "warmup_lr": WARMUP_LR,
            "steps_per_lr": steps,
            "prompts": prompts,
            "group": group,
        },
        "threads": torch.get_num_threads(),
    }
    runs: list[dict[str, Any]] = []
    with LLM(
        str(path), tensor_parallel_size=2, dtype="bfloat16", kv_cache_memory=KV_CACHE_MEMORY
    ) as llm:
        phases.lap("engine_start")
        trainer = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        result["warmup_loss"] = _warmup(llm, trainer, task, WARMUP[quick])
        start = [p.detach().clone() for p in trainer.parameters()]
        phases.lap("warmup")
        run_lr = _RlRun(trainer, start, task, prompts, sampling, phases)
        for lr in LRS:
            runs += run_lr(llm, lr, steps, "engine")
    with LLM(
        str(path), data_parallel_size=FLEET, dtype="bfloat16", kv_cache_memory=KV_CACHE_MEMORY
    ) as fleet:
        phases.lap("fleet_start")
        fleet_runs = run_lr(fleet, HEADLINE_LR, FLEET_STEPS[quick], "fleet")
    result["steps"] = runs
    result["by_lr"] = {f"{lr:g}": _medians([r for r in runs if r["lr"] == lr]) for lr in LRS}
    result["fleet"] = {"replicas": FLEET, "steps": fleet_runs, "medians": _medians(fleet_runs)}
    head, fleet_head = result["by_lr"][f"{HEADLINE_LR:g}"], result["fleet"]["medians"]
    result["ratios"] = {
        "delta_bytes_vs_dense": head["bytes_vs_dense"],
        **{f"delta_{t}_seconds_vs_dense": head[f"{t}_seconds_vs_dense"] for t in TRANSPORTS},
        "fleet_delta_bytes_vs_dense": fleet_head["bytes_vs_dense"],
        **{
            f"fleet_delta_{t}_seconds_vs_dense": fleet_head[f"{t}_seconds_vs_dense"]
            for t in TRANSPORTS
        },
    }
    result["identical"] = all(r[t]["identical"] for r in runs + fleet_runs for t in TRANSPORTS)
    result["phase_seconds"] = phases.seconds
    result["notes"] = [
        "ratios: medians over the RL steps at lr 1e-6 of (delta push) / (dense push) of the "
        "same weights into the same engine, each push staged and verified; by_lr: every lr; "
        f"fleet_*: the same into LLM(data_parallel_size={FLEET}) (TP=1 replicas), the run "
        "continuing from the engine's last weights",
        "density: elements whose bfloat16 value changed in the step, of all; the trainer's "
        "shadow (what it last pushed, in bfloat16) costs the memory of one dense push: "
        "bytes_needed",
    ]
    return result


class _RlRun:
    """RL steps at one learning rate from the warmed-up weights, each step's weights pushed
    dense and as a delta over every transport into the engine (or fleet) given."""

    def __init__(self, trainer, start, task, prompts: int, sampling, phases: Phases):
        self.trainer, self.start, self.task = trainer, start, task
        self.prompts, self.sampling, self.phases = prompts, sampling, phases
        self.version = 0

    def __call__(self, llm, lr: float, steps: int, label: str) -> list[dict[str, Any]]:
        from tandem.exchange import WeightSender

        trainer = self.trainer
        _load(trainer, self.start)  # every run from the warmed-up weights
        opt = torch.optim.AdamW(trainer.parameters(), lr=lr)
        dense = {t: WeightSender(trainer, llm, transport=t) for t in TRANSPORTS}
        delta = {t: WeightSender(trainer, llm, transport=t) for t in TRANSPORTS}
        self.version += 1
        dense["shm"].push(self.version, delta=False)  # the run starts from the trainer's weights
        records = []
        for step in range(steps):
            before = [p.detach().clone() for p in trainer.parameters()]
            reward = _rl_step(llm, trainer, opt, self.task, step, self.prompts, self.sampling)
            record: dict[str, Any] = {"lr": lr, "step": step, "mean_reward": reward}
            for t in TRANSPORTS:
                self.version += 1
                d = dense[t].push(self.version, delta=False)
                reference = _greedy(llm)
                with _holding(trainer, before):  # the engine at the shadow's weights
                    self.version += 1
                    delta[t].push(self.version, delta=True)
                self.version += 1
                x = delta[t].push(self.version, delta=True)
                if not x.delta:
                    raise RuntimeError(f"{t}: the delta push went dense: {x.why_dense}")
                record[t] = _figures(d, x, _greedy(llm) == reference)
            records.append(record)
            self.phases.lap(f"{label} lr {lr:g} step {step}")
        for sender in (*dense.values(), *delta.values()):
            sender.close()
        return records


def _warmup(llm, trainer, task, steps: int) -> list[float]:
    """The demo's supervised warm-up: cross-entropy on each prompt's answer and end of text;
    the losses."""
    from tandem.rl.trainer import continuation_logprobs

    tok, eos = llm.tokenizer, llm.engine.spec.eos_token_ids[0]
    opt = torch.optim.AdamW(trainer.parameters(), lr=WARMUP_LR)
    losses = []
    for step in range(steps):
        pairs = [
            (tok.encode(p.prompt), tok.encode(p.answer) + [eos])
            for p in task.problems(step, 32, "warmup")
        ]
        logp, mask = continuation_logprobs(trainer, pairs)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
    return losses


def _rl_step(llm, trainer, opt, task, step: int, prompts: int, sampling) -> float:
    """One GRPO step of the demo's loss on samples from the engine: the mean reward."""
    from tandem.rl.grpo import group_advantages, policy_loss
    from tandem.rl.trainer import continuation_logprobs

    problems = task.problems(step, prompts)
    ids = [llm.tokenizer.encode(p.prompt) for p in problems]
    outputs = llm.generate(ids, sampling)
    pairs, behaviour, rewards = [], [], []
    for problem, prompt, out in zip(problems, ids, outputs, strict=True):
        for c in out.outputs:
            pairs.append((prompt, list(c.token_ids)))
            behaviour.append(c.logprobs)
            rewards.append(task.reward(problem, c.text))
    advantages = torch.tensor(group_advantages(rewards, sampling.n))
    logp, mask = continuation_logprobs(trainer, pairs)
    old = torch.zeros_like(mask)
    for i, ((prompt, completion), lps) in enumerate(zip(pairs, behaviour, strict=True)):
        old[i, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = torch.tensor(lps)
    loss, _ = policy_loss(logp, old, advantages, mask)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return sum(rewards) / len(rewards)


def _load(model, values: list[torch.Tensor]) -> None:
    """``values`` into the model's parameters, in order."""
    with torch.no_grad():
        for p, v in zip(model.parameters(), values, strict=True):
            p.copy_(v)


class _holding:
    """The trainer's parameters set to ``values`` inside the block, put back after."""

    def __init__(self, model, values: list[torch.Tensor]):
        self.model, self.values = model, values

    def __enter__(self):
        self.now = [p.detach().clone() for p in self.model.parameters()]
        _load(self.model, self.values)

    def __exit__(self, *exc):
        _load(self.model, self.now)


def _greedy(llm):
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)
    out = llm.generate([[5, 9, 33, 2, 17, 100, 3, 8]], params)[0].outputs[0]
    return out.token_ids, out.logprobs


def _engine_seconds(stats) -> float:
    return sum(r.seconds for r in stats.replicas)


def _figures(dense, delta, identical: bool) -> dict[str, Any]:
    return {
        "density": round(delta.density, 6),
        "dense_bytes": dense.bytes_moved,
        "delta_bytes": delta.bytes_moved,
        "bytes_needed": dense.bytes_needed,
        "dense_seconds": round(dense.seconds, 6),
        "delta_seconds": round(delta.seconds, 6),
        "encode_seconds": round(delta.encode_seconds, 6),
        "dense_engine_seconds": round(_engine_seconds(dense), 6),
        "delta_engine_seconds": round(_engine_seconds(delta), 6),
        "identical": identical,
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def median(t: str, key) -> float:
        return round(statistics.median(key(r[t]) for r in runs), 4)

    out: dict[str, Any] = {
        "density": median("shm", lambda f: f["density"]),
        "bytes_vs_dense": median("shm", lambda f: f["delta_bytes"] / f["dense_bytes"]),
    }
    for t in TRANSPORTS:
        out[f"{t}_seconds_vs_dense"] = median(t, lambda f: f["delta_seconds"] / f["dense_seconds"])
        out[f"{t}_encode_seconds"] = median(t, lambda f: f["encode_seconds"])
    out["mean_reward"] = round(statistics.mean(r["mean_reward"] for r in runs), 4)
    out["steps"] = len(runs)
    return out


def summary(result: dict[str, Any]) -> str:
    lines = [f"{k}: {v:.3f}x" for k, v in result["ratios"].items()]
    for lr, m in result["by_lr"].items():
        lines.append(
            f"lr {lr}: density {m['density']:.4f}, bytes {m['bytes_vs_dense']:.3f}x, "
            + ", ".join(f"{t} {m[f'{t}_seconds_vs_dense']:.2f}x" for t in TRANSPORTS)
            + f", mean reward {m['mean_reward']:.3f}"
        )
    m = result["fleet"]["medians"]
    lines.append(
        f"fleet of {result['fleet']['replicas']}: bytes {m['bytes_vs_dense']:.3f}x, "
        + ", ".join(f"{t} {m[f'{t}_seconds_vs_dense']:.2f}x" for t in TRANSPORTS)
    )
    lines.append(f"engine output identical after delta and dense: {result['identical']}")
    return "\n".join(lines)
