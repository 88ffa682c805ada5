"""The demo's controller: a supervised warm-up, then RL: rollouts from the engine, rewards, a
trainer step, a weight push; eval points on held-out problems along the way.

The task (`ReverseTask`) asks for a prompt's digits reversed, so the reward depends on the
prompt and no fixed answer scores well. The warm-up (a few cross-entropy steps on the trainers,
pushed once) teaches the answer format and leaves the policy far from solving it; GRPO then has
to raise the greedy accuracy on problems it never trains on.

Each RL step: the engine (`LLM(tp=2)`, 2 worker processes) samples ``group_size`` completions for
each of ``prompts_per_step`` prompts, with the raw log-probs of every sampled token; the task
scores them; group-relative advantages go with the samples to the trainer ranks (2 processes,
FSDP2 over gloo), which recompute the log-probs, take one AdamW step on the clipped
importance-weighted loss and push their shards into the engine (`WeightSender`).

- colocated (default): the engine releases its KV cache (`sleep`) while the trainers step and
  re-allocates it (`wake`) for the next rollouts; weights move through shared memory.
- disaggregated: the engine stays up; weights move by torch.distributed point to point.
- ``async_staleness=N``: rollouts never stop. A background thread generates up to N batches
  ahead while the trainers train; pushes land between decode steps, so a sample may carry two
  versions. A sample's staleness is the trainer's version minus the oldest version that
  produced it. Running at most N batches ahead bounds it by N; a group staler than N all the
  same is **dropped**; the others are importance-weighted by the clipped ratio
  exp(logp_trainer - logp_engine) against the log-probs the engine sampled with.

The engine runs in float32 by default, like the trainers, so it serves exactly their policy.
``engine_dtype="bfloat16"`` (or ``"fp8"``: block-FP8 weights, bfloat16 activations) is what
users run: the engine's log-probs then drift from the trainers', and on-policy samples are
quietly off-policy. ``is_correction`` (``"tis"``, ``"mis"``) corrects for it with importance
weights exp(logp_trainer - logp_engine) truncated or masked at ``is_cap``
(`tandem.rl.grpo.correct_mismatch`; docs/rl_mismatch.md). Every step reports the mismatch on
sampled tokens (max and mean |trainer - engine|) and what the correction did.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.engine.outputs import RequestOutput
from tandem.engine.state import EngineState
from tandem.models.tiny import make_tiny_model
from tandem.rl.config import DemoConfig
from tandem.rl.evaluate import EvalPoint, Evaluator
from tandem.rl.grpo import group_advantages
from tandem.rl.logs import StepLog, WarmupLog
from tandem.rl.messages import Sample
from tandem.rl.task import Problem, ReverseTask
from tandem.rl.trainers import TrainerGroup


@dataclass
class _Rollout:
    step: int
    problems: list[Problem]
    prompts: list[list[int]]
    outputs: list[RequestOutput]
    seconds: float


def run(config: DemoConfig, on_step=None, on_event=None) -> dict:
    """Run the warm-up and the RL loop; ``on_step(StepLog)`` after every RL step and
    ``on_event(WarmupLog | EvalPoint)`` after every warm-up step and eval point. Returns the
    JSON log."""
    model_dir = Path(config.model_dir)
    if not (model_dir / "config.json").is_file():
        make_tiny_model(model_dir, "llama", seed=config.seed)
    task = ReverseTask(config.seed, config.digits)
    params = SamplingParams(
        n=config.group_size,
        max_tokens=config.digits + 1,
        temperature=config.temperature,
        logprobs=0,
    )
    notify = on_event or (lambda event: None)
    started = time.perf_counter()
    logs: list[StepLog] = []
    evals: list[EvalPoint] = []
    with LLM(
        str(model_dir),
        tensor_parallel_size=config.engine_tp,
        kv_cache_memory=16 << 20,
        seed=config.seed,
        **config.engine_options(),
    ) as llm:
        with TrainerGroup(
            config.trainer_ranks,
            str(model_dir),
            llm.exchange_address,
            config.transport,
            config.seed,
            delta=config.delta,
        ) as trainers:
            evaluator = Evaluator(llm, trainers, task)

            def evaluate(phase: str, step: int) -> EvalPoint:
                evals.append(evaluator.run(phase, step))
                notify(evals[-1])
                return evals[-1]

            evaluate("init", 0)
            warmup = _warmup(llm, trainers, task, config, notify)
            evaluate("start", 0)
            rollouts = _Rollouts(llm, task, params, config)
            try:
                for step in range(config.steps):
                    log = _step(llm, trainers, task, rollouts.next(step), step, config)
                    done = step + 1
                    if done % config.eval_every == 0 or done == config.steps:
                        log.eval_reward = evaluate("rl", done).reward
                    logs.append(log)
                    if on_step is not None:
                        on_step(log)
            finally:
                rollouts.stop()
            final = _final_check(llm, trainers, task, params, config)
    return {
        "config": asdict(config),
        "task": task.name,
        "constant_policy_reward": round(task.constant_policy_reward(task.held_out()), 4),
        "warmup": [asdict(w) for w in warmup],
        "evals": [asdict(e) for e in evals],
        "steps": [asdict(log) for log in logs],
        "final_check": final,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _warmup(
    llm: LLM, trainers: TrainerGroup, task: ReverseTask, config: DemoConfig, notify
) -> list[WarmupLog]:
    """Supervised steps on training problems (never the held-out ones); one push at the end.
    Colocated, the engine sleeps meanwhile (the trainers have the memory)."""
    if config.warmup_steps == 0:
        return []
    tok, eos = llm.tokenizer, llm.engine.spec.eos_token_ids[0]
    logs = []
    colocated = config.placement == "colocate"
    if colocated:
        llm.sleep()
    try:
        for step in range(config.warmup_steps):
            examples = [
                [tok.encode(p.prompt), tok.encode(p.answer) + [eos]]
                for p in task.problems(step, config.warmup_batch, "warmup")
            ]
            shares = _shares(examples, config.trainer_ranks)
            last = step == config.warmup_steps - 1
            reports = trainers.warmup(step, llm.weight_version + 1, shares, last, config.lr)
            logs.append(
                WarmupLog(
                    step,
                    sum(r.loss for r in reports) / len(reports),
                    round(max(r.train_seconds for r in reports), 4),
                    round(1000 * max(r.push_seconds for r in reports), 2),
                )
            )
            notify(logs[-1])
    finally:
        if colocated:
            llm.wake()
    return logs


def _step(
    llm: LLM,
    trainers: TrainerGroup,
    task: ReverseTask,
    rollout: _Rollout,
    step: int,
    config: DemoConfig,
) -> StepLog:
    version = llm.weight_version  # what the trainers hold now (every push is committed)
    groups, versions, stale = [], [], []
    dropped = 0
    for problem, prompt, out in zip(
        rollout.problems, rollout.prompts, rollout.outputs, strict=True
    ):
        staleness = version - min(out.weight_versions)
        if config.async_staleness is not None and staleness > config.async_staleness:
            dropped += len(out.outputs)
            continue
        groups.append((problem, prompt, out))
        versions.append(out.weight_versions)
        stale.append(staleness)
    rewards = [task.reward(problem, c.text) for problem, _, out in groups for c in out.outputs]
    advantages = group_advantages(rewards, config.group_size) if rewards else []
    samples = []
    for g, (_, prompt, out) in enumerate(groups):
        fresh = out.weight_versions == [version]
        for i, c in enumerate(out.outputs):
            samples.append(
                Sample(
                    prompt, c.token_ids, c.logprobs, advantages[g * config.group_size + i], fresh
                )
            )
    shares = _shares(samples, config.trainer_ranks)
    update = all(shares)
    if not update:  # every rank runs the same collectives: all step or none does
        shares = [[] for _ in shares]
    if config.placement == "colocate" and config.async_staleness is None:
        llm.sleep()  # the trainers get the KV cache's memory while they step
    try:
        reports = trainers.step(
            step,
            version + 1,
            shares,
            update,
            config.rl_lr(step),
            config.is_correction,
            config.is_cap,
        )
    finally:
        if llm.engine.state is EngineState.SLEEPING:
            llm.wake()
    mismatches = [r.logprob_mismatch for r in reports if r.logprob_mismatch is not None]
    gap_mean, weight_mean, capped = _mismatch_means(reports)
    tokens_trained = sum(r.tokens for r in reports)
    tokens = sum(len(c.token_ids) for out in rollout.outputs for c in out.outputs)
    all_rewards = rewards or [0.0]
    return StepLog(
        step=step,
        version=llm.weight_version,
        reward_mean=sum(all_rewards) / len(all_rewards),
        reward_min=min(all_rewards),
        reward_max=max(all_rewards),
        samples=len(samples),
        dropped=dropped,
        rollout_tokens=tokens,
        rollout_seconds=round(rollout.seconds, 4),
        rollout_tokens_per_s=round(tokens / rollout.seconds, 1),
        train_seconds=round(max(r.train_seconds for r in reports), 4),
        sync_ms=round(1000 * max(r.push_seconds for r in reports), 2),
        sync_bytes=max(r.push_bytes for r in reports),
        loss=sum(r.loss for r in reports) / len(reports),
        grad_norm=reports[0].grad_norm,
        logprob_mismatch=max(mismatches) if mismatches else None,
        logprob_gap_mean=gap_mean,
        is_weight_mean=weight_mean,
        is_capped_fraction=capped,
        clip_fraction=sum(r.clip_fraction * r.tokens for r in reports) / max(1, tokens_trained),
        staleness_mean=sum(stale) / len(stale) if stale else 0.0,
        staleness_max=max(stale, default=0),
        sample_versions=versions,
    )


def _final_check(llm, trainers, task, params, config) -> dict:
    """After the last push: fresh rollouts, log-probs recomputed by the trainers (no update)."""
    prompts = [llm.tokenizer.encode(p.prompt) for p in task.problems(10**6, 2)]
    outputs = llm.generate(prompts, params)
    samples = [
        Sample(p, c.token_ids, c.logprobs, 0.0, True)
        for p, out in zip(prompts, outputs, strict=True)
        for c in out.outputs
    ]
    shares = _shares(samples, config.trainer_ranks)
    reports = trainers.step(
        -1,
        llm.weight_version,
        shares,
        update=False,
        lr=0.0,
        is_correction=config.is_correction,
        is_cap=config.is_cap,
    )
    gap_mean, weight_mean, capped = _mismatch_means(reports)
    return {
        "version": llm.weight_version,
        "logprob_mismatch": max(r.logprob_mismatch for r in reports),
        "logprob_gap_mean": gap_mean,
        "is_weight_mean": weight_mean,
        "is_capped_fraction": capped,
    }


def _mismatch_means(reports) -> tuple[float | None, float, float]:
    """Over every rank's tokens: the mean |trainer - engine| log-prob on fresh samples (None
    without any), the mean importance weight, the fraction of tokens over the cap."""
    fresh = sum(r.fresh_tokens for r in reports)
    tokens = max(1, sum(r.tokens for r in reports))
    gap = sum(r.logprob_gap_sum for r in reports) / fresh if fresh else None
    return (
        gap,
        sum(r.is_weight_sum for r in reports) / tokens,
        sum(r.is_over_cap for r in reports) / tokens,
    )


def _shares(items: list, ranks: int) -> list[list]:
    """Round-robin ``items`` over the trainer ranks (FSDP2: each rank takes its own share)."""
    return [items[r::ranks] for r in range(ranks)]


class _Rollouts:
    """Synchronous: generate when asked. Async: a thread generates ahead, at most N batches
    (so a batch is at most N versions stale when the trainer takes it)."""

    def __init__(self, llm: LLM, task: ReverseTask, params: SamplingParams, config: DemoConfig):
        self.llm, self.task, self.params, self.config = llm, task, params, config
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = None
        self._ahead = threading.Semaphore(max(1, config.async_staleness or 1))
        if config.async_staleness is not None:
            self._thread = threading.Thread(target=self._produce, daemon=True)
            self._thread.start()

    def _generate(self, step: int) -> _Rollout:
        problems = self.task.problems(step, self.config.prompts_per_step)
        prompts = [self.llm.tokenizer.encode(p.prompt) for p in problems]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, self.params)
        return _Rollout(step, problems, prompts, outputs, time.perf_counter() - start)

    def _produce(self) -> None:
        step = 0
        while not self._stop.is_set() and step < self.config.steps:
            if not self._ahead.acquire(timeout=0.2):
                continue
            try:
                item = self._generate(step)
            except Exception as exc:  # handed to the consumer, which raises it
                item = exc
            self._queue.put(item)
            step += 1

    def next(self, step: int) -> _Rollout:
        if self._thread is None:
            return self._generate(step)
        item = self._queue.get(timeout=600)
        self._ahead.release()
        if isinstance(item, Exception):
            raise item
        return item

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
