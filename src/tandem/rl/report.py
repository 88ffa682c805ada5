"""What the demo shows and leaves behind: a progress line per step, a JSON log, a PNG plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tandem.rl.loop import StepLog


class Progress:
    """``step 12/30 [#####.....] reward 0.42 | 812 tok/s | sync 45 ms | stale 0 | dlogp 2e-06``.
    Redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, stream=sys.stdout, width: int = 20):
        self.total, self.stream, self.width = total, stream, width
        self.tty = stream.isatty()

    def update(self, log: StepLog) -> None:
        done = log.step + 1
        filled = round(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        dlogp = "-" if log.logprob_mismatch is None else f"{log.logprob_mismatch:.1e}"
        line = (f"step {done:>3}/{self.total} [{bar}] reward {log.reward_mean:.3f} | "
                f"{log.rollout_tokens_per_s:>5.0f} tok/s | sync {log.sync_ms:>6.1f} ms | "
                f"stale {log.staleness_max} | dlogp {dlogp} | v{log.version}")  # fmt: skip
        if self.tty:
            end = "\n" if done == self.total else ""
            self.stream.write("\r" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def summary(result: dict) -> dict:
    steps = result["steps"]
    k = max(1, min(3, len(steps) // 3))
    first = [s["reward_mean"] for s in steps[:k]]
    last = [s["reward_mean"] for s in steps[-k:]]
    mismatches = [s["logprob_mismatch"] for s in steps if s["logprob_mismatch"] is not None]
    return {
        "reward_start": round(sum(first) / len(first), 4),
        "reward_end": round(sum(last) / len(last), 4),
        "steps_averaged": k,
        "max_logprob_mismatch": max(mismatches, default=None),
        "final_logprob_mismatch": result["final_check"]["logprob_mismatch"],
        "mean_sync_ms": round(sum(s["sync_ms"] for s in steps) / len(steps), 2),
        "seconds": result["seconds"],
    }


def write(result: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """``demo.json`` and ``demo.png`` (reward, sync time, staleness per step) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path, plot_path = out / "demo.json", out / "demo.png"
    log_path.write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    x = [s["step"] + 1 for s in steps]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    axes[0].plot(x, [s["reward_mean"] for s in steps], marker="o", ms=3)
    axes[0].fill_between(x, [s["reward_min"] for s in steps], [s["reward_max"] for s in steps],
                         alpha=0.2)  # fmt: skip
    axes[0].set_ylabel("reward (mean, min-max)")
    axes[1].plot(x, [s["sync_ms"] for s in steps], marker="o", ms=3, color="tab:orange")
    axes[1].set_ylabel("weight sync (ms)")
    axes[2].step(x, [s["staleness_max"] for s in steps], where="mid", color="tab:green",
                 label="max")  # fmt: skip
    axes[2].plot(x, [s["staleness_mean"] for s in steps], color="tab:olive", label="mean")
    axes[2].set_ylabel("staleness (versions)")
    axes[2].set_xlabel("step")
    axes[2].legend(loc="upper left")
    c = result["config"]
    mode = c["placement"] + (
        "" if c["async_staleness"] is None else f", async {c['async_staleness']}"
    )
    fig.suptitle(f"tandem demo: {result['task']} task, {mode}")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=100)
    plt.close(fig)
    return log_path, plot_path
