"""Plot a run directory's metrics to PNG files.

    evenrl report runs/demo/grpo      # writes runs/demo/grpo/plots/*.png and prints their paths
"""

from __future__ import annotations

from pathlib import Path

from evenrl.errors import ArgumentParser, UsageError
from evenrl.train.runlog import read_metrics

# (file name, title, metric keys plotted on one axis)
PANELS = [
    ("reward.png", "Reward: sampled (mean over the step's samples) and greedy eval", ["reward/mean", "eval/reward"]),
    ("kl.png", "KL to the reference / policy drift", ["kl", "policy/approx_kl"]),
    ("response_length.png", "Response length (tokens)", ["response/length_mean"]),
    ("phases.png", "Seconds per step by phase", ["time/rollout", "time/reward", "time/exchange",
                                                   "time/logprobs", "time/update"]),
]


def _smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def write_plots(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise UsageError(f"{run_dir}: no metrics.jsonl with rows; give a run directory written by evenrl train")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    steps = [r["step"] for r in rows]
    for fname, title, keys in PANELS:
        present = [k for k in keys if any(r.get(k) is not None for r in rows)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in present:
            xs = [s for s, r in zip(steps, rows) if r.get(k) is not None]
            ys = [r[k] for r in rows if r.get(k) is not None]
            if len(ys) < 20:  # sparse series (evaluations): points, no smoothing
                ax.plot(xs, ys, "o-", lw=1.5, ms=5, label=k)
                continue
            line, = ax.plot(xs, ys, alpha=0.35, lw=1)
            ax.plot(xs, _smooth(ys, max(1, len(ys) // 20)), color=line.get_color(), lw=2, label=k)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=100)
        plt.close(fig)
        written.append(out_dir / fname)
    loads = [r.get("load/rank_tokens") for r in rows if r.get("load/rank_tokens")]
    if loads:
        world = len(loads[-1])
        totals = [sum(step_loads[i] for step_loads in loads if len(step_loads) == world) for i in range(world)]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(range(world), totals, color="#4c72b0")
        mean = sum(totals) / world
        ax.axhline(mean, color="k", ls="--", lw=1, label=f"mean {mean:,.0f}")
        ax.set_title(f"Training tokens per rank, summed over {len(loads)} steps")
        ax.set_xlabel("rank")
        ax.set_ylabel("tokens")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "rank_load.png", dpi=100)
        plt.close(fig)
        written.append(out_dir / "rank_load.png")
    return written


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="evenrl report", description="Plot a run directory's metrics to PNG.")
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        raise UsageError(f"{args.run_dir}: not a directory; give a run directory written by evenrl train")
    for path in write_plots(args.run_dir):
        print(path)
    return 0
