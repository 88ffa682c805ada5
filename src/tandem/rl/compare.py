"""Learning curves and engine/trainer mismatch of several `tandem demo` runs in one figure.

    python -m tandem.rl.compare OUT.png DIR [DIR ...]

Each DIR holds a run's ``demo.json``; its label is ``<engine dtype>/<correction>``. Left:
held-out greedy accuracy at the eval points; middle: sampled reward per RL step; right: the
mean |trainer - engine| log-prob gap on sampled tokens per step (log scale).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(runs: dict[str, dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, reward, gap) = plt.subplots(1, 3, figsize=(16, 4.5))
    for label, result in runs.items():
        rl = [e for e in result["evals"] if e["phase"] in ("start", "rl")]
        line = acc.plot(
            [e["step"] for e in rl], [e["reward"] for e in rl], marker="o", label=label
        )[0]
        steps = result["steps"]
        reward.plot(
            [s["step"] for s in steps],
            [s["reward_mean"] for s in steps],
            color=line.get_color(),
            alpha=0.8,
        )
        gap.plot(
            [s["step"] for s in steps],
            [max(s["logprob_gap_mean"] or 0.0, 1e-9) for s in steps],
            color=line.get_color(),
            alpha=0.8,
        )
    acc.set(title="held-out greedy accuracy", xlabel="RL step")
    reward.set(title="sampled reward", xlabel="RL step")
    gap.set(
        title="mean |log p trainer - log p engine|, sampled tokens", xlabel="RL step", yscale="log"
    )
    acc.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs = {}
    for d in argv[1:]:
        result = json.loads((Path(d) / "demo.json").read_text())
        config = result["config"]
        runs[f"{config['engine_dtype']}/{config['is_correction']}"] = result
    print(plot(runs, Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
