"""What the demo shows and leaves behind: a progress line per step, a JSON log, a PNG plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tandem.rl.logs import StepLog, WarmupLog


class Progress:
    """``step 12/200 [#.....] reward 0.42 | eval 0.51 | 812 tok/s | sync 9 ms | stale 0 |
    dlogp 2e-06 | v13``: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, stream=sys.stdout, width: int = 20):
        self.total, self.stream, self.width = total, stream, width
        self.tty = stream.isatty()
        self.eval = 0.0  # the latest held-out accuracy

    def event(self, event) -> None:
        """Warm-up steps and eval points: one line each (a terminal's bar line is kept)."""
        if isinstance(event, WarmupLog):
            if event.step == 0 or event.sync_ms:
                self._line(
                    f"warm-up step {event.step + 1}: loss {event.loss:.3f}"
                    + (f" | pushed in {event.sync_ms:.1f} ms" if event.sync_ms else "")
                )
        elif event.phase != "rl":
            self.eval = event.reward
            name = "before warm-up" if event.phase == "init" else "before RL"
            self._line(
                f"held-out greedy accuracy {name}: {event.reward:.3f} "
                f"(exact {event.exact:.2f}); KL(engine || trainer) {event.kl_max:.1e}"
            )

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def update(self, log: StepLog) -> None:
        done = log.step + 1
        filled = round(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        dlogp = "-" if log.logprob_mismatch is None else f"{log.logprob_mismatch:.1e}"
        if log.eval_reward is not None:
            self.eval = log.eval_reward
        line = (
            f"step {done:>3}/{self.total} [{bar}] reward {log.reward_mean:.3f} | "
            f"eval {self.eval:.3f} | "
            f"{log.rollout_tokens_per_s:>5.0f} tok/s | sync {log.sync_ms:>6.1f} ms | "
            f"stale {log.staleness_max} | dlogp {dlogp} | v{log.version}"
        )
        if self.tty:
            end = "\n" if done == self.total else ""
            self.stream.write("\r" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def summary(result: dict) -> dict:
    """The figures a reader checks first. ``eval_*`` is greedy per-digit accuracy (the task's
    mean reward) on held-out problems: ``eval_init`` before the warm-up, ``eval_start`` after
    it (before RL), ``eval_end`` after the last RL step; ``constant_policy_reward`` is the best
    any single fixed completion gets on those problems. The engine/trainer mismatch on sampled
    tokens: ``max_logprob_mismatch`` (the largest |gap| of any step), ``mean_logprob_gap`` (the
    steps' mean gaps, averaged), ``mean_is_weight`` and ``is_capped_fraction_*`` (the tokens
    over the cap: truncated by TIS, masked by MIS, left alone without a correction);
    ``clip_fraction_mean``: the tokens whose PPO ratio PPO's clip bounds (without a correction a
    lower-precision engine's mismatch puts tokens there; their gradient may be cut)."""
    steps, evals = result["steps"], result["evals"]
    k = max(1, min(3, len(steps) // 3))
    first = [s["reward_mean"] for s in steps[:k]]
    last = [s["reward_mean"] for s in steps[-k:]]
    mismatches = [s["logprob_mismatch"] for s in steps if s["logprob_mismatch"] is not None]
    gaps = [s["logprob_gap_mean"] for s in steps if s["logprob_gap_mean"] is not None]
    capped = [s["is_capped_fraction"] for s in steps]
    by_phase = {phase: [e for e in evals if e["phase"] == phase] for phase in ("init", "start")}
    return {
        "eval_init": by_phase["init"][0]["reward"],
        "eval_start": by_phase["start"][0]["reward"],
        "eval_end": evals[-1]["reward"],
        "exact_start": by_phase["start"][0]["exact"],
        "exact_end": evals[-1]["exact"],
        "constant_policy_reward": result["constant_policy_reward"],
        "reward_start": round(sum(first) / len(first), 4),
        "reward_end": round(sum(last) / len(last), 4),
        "steps_averaged": k,
        "warmup_loss_start": result["warmup"][0]["loss"] if result["warmup"] else None,
        "warmup_loss_end": result["warmup"][-1]["loss"] if result["warmup"] else None,
        "engine_dtype": result["config"]["engine_dtype"],
        "is_correction": result["config"]["is_correction"],
        "is_cap": result["config"]["is_cap"],
        "max_logprob_mismatch": max(mismatches, default=None),
        "mean_logprob_gap": sum(gaps) / len(gaps) if gaps else None,
        "final_logprob_mismatch": result["final_check"]["logprob_mismatch"],
        "final_logprob_gap_mean": result["final_check"]["logprob_gap_mean"],
        "mean_is_weight": sum(s["is_weight_mean"] for s in steps) / max(1, len(steps)),
        "is_capped_fraction_mean": sum(capped) / max(1, len(capped)),
        "is_capped_fraction_max": max(capped, default=0.0),
        "clip_fraction_mean": sum(s["clip_fraction"] for s in steps) / max(1, len(steps)),
        "max_kl": max(e["kl_max"] for e in evals),
        "max_logprob_gap_vocab": max(e["logprob_gap_max"] for e in evals),
        "staleness_max": max((s["staleness_max"] for s in steps), default=0),
        "mean_sync_ms": round(sum(s["sync_ms"] for s in steps) / max(1, len(steps)), 2),
        "seconds": result["seconds"],
    }


def write(result: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """``demo.json`` and ``demo.png`` in ``out_dir``. The plot: the warm-up's loss; then per
    RL step the mean sampled reward, the held-out greedy accuracy at eval points (step 0: after
    the warm-up) and the best constant completion; the weight sync time; the staleness."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path, plot_path = out / "demo.json", out / "demo.png"
    log_path.write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals, warmup = result["steps"], result["evals"], result["warmup"]
    x = [s["step"] + 1 for s in steps]
    fig = plt.figure(figsize=(8, 9))
    grid = fig.add_gridspec(4, 1, height_ratios=[1, 2, 1, 1])
    ax_warm = fig.add_subplot(grid[0])
    ax_reward = fig.add_subplot(grid[1])
    ax_sync = fig.add_subplot(grid[2], sharex=ax_reward)
    ax_stale = fig.add_subplot(grid[3], sharex=ax_reward)
    if warmup:
        ax_warm.plot(
            [w["step"] + 1 for w in warmup],
            [w["loss"] for w in warmup],
            marker="o",
            ms=3,
            color="tab:purple",
        )
    ax_warm.set_ylabel("warm-up loss")
    ax_warm.set_xlabel("supervised warm-up step")
    ax_reward.plot(x, [s["reward_mean"] for s in steps], lw=1, label="sampled reward (mean)")
    rl_evals = [e for e in evals if e["phase"] != "init"]
    at = [e["step"] for e in rl_evals]
    ax_reward.plot(
        at,
        [e["reward"] for e in rl_evals],
        marker="s",
        color="tab:red",
        label="held-out greedy accuracy (per digit)",
    )
    ax_reward.plot(
        at,
        [e["exact"] for e in rl_evals],
        marker="^",
        ls=":",
        color="tab:red",
        label="held-out exact match",
    )
    ax_reward.axhline(
        result["constant_policy_reward"], ls="--", color="gray", label="best constant answer"
    )
    ax_reward.set_ylabel("reward / accuracy")
    ax_reward.set_ylim(0, 1)
    ax_reward.legend(loc="upper left", fontsize=8)
    ax_sync.plot(x, [s["sync_ms"] for s in steps], lw=1, color="tab:orange")
    ax_sync.set_ylabel("weight sync (ms)")
    ax_stale.step(
        x, [s["staleness_max"] for s in steps], where="mid", color="tab:green", label="max"
    )
    ax_stale.plot(x, [s["staleness_mean"] for s in steps], color="tab:olive", label="mean")
    ax_stale.set_ylabel("staleness (versions)")
    ax_stale.set_xlabel("RL step")
    ax_stale.legend(loc="upper left", fontsize=8)
    c = result["config"]
    mode = c["placement"] + (
        "" if c["async_staleness"] is None else f", async {c['async_staleness']}"
    )
    engine = c["engine_dtype"] + (
        "" if c["is_correction"] == "none" else f", {c['is_correction']} (cap {c['is_cap']:g})"
    )
    fig.suptitle(f"tandem demo: {result['task']} task, {mode}; engine {engine}")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=100)
    plt.close(fig)
    return log_path, plot_path
