"""A run directory's metrics as PNG plots in RUN_DIR/plots: what `evenrl report` draws, and what the experiment
trackers (evenrl.train.trackers) get as images when training ends. matplotlib only, never torch."""

from __future__ import annotations

import math
from pathlib import Path

from evenrl.errors import UsageError, describe_error
from evenrl.train.runlog import MISMATCH_THRESHOLD, read_metrics

# (file name, title, metric keys plotted on one axis); the KL, phase and capacity panels are built from the rows
# (_panels).
PANELS = [
    ("reward.png", "Reward: sampled (mean over the step's samples) and greedy eval", ["reward/mean", "eval/reward"]),
    ("kl.png", "KL to the reference / policy drift", ["kl", "policy/approx_kl"]),
    ("response_length.png", "Response length (tokens; with rollout.env the sampled ones too)",
     ["response/length_mean", "response/sampled_length_mean"]),
    ("turns.png", "Multi-turn (rollout.env): assistant turns and tool calls per trajectory,\n"
                  "and the share of tool calls that could be read and run", ["rollout/turns_mean",
                                                                           "tools/calls_per_trajectory",
                                                                           "tools/success_rate"]),
    ("phases.png", "Seconds per step by phase", []),
    ("logprob_mismatch.png", f"Rollout engine vs trainer, sampled tokens: mean |log-prob diff|\n"
                             f"and the share of tokens above {MISMATCH_THRESHOLD}", ["rollout/logprob_mismatch",
                                                                                   "rollout/mismatch_fraction"]),
    ("off_policy.png", "Off-policy samples (rollout.max_staleness): staleness in steps,\nmean importance weight, "
                       "share of tokens cut to the cap", ["rollout/staleness_mean", "policy/is_weight",
                                                          "policy/is_clipped_fraction"]),
    ("capacity.png", "Capacity weight per rank (parallel.capacity_weights: auto)", []),
]
KL_OFF_TITLE = "Policy drift (approx. KL per update)\nno KL to a reference: off (algo.kl_coef=0) or always 0"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def _panels(rows: list[dict]) -> list[tuple[str, str, list[str]]]:
    """PANELS with what the rows hold: every `time/*` phase found (in order of appearance, the whole step last),
    every rank's capacity weight, and no reference KL line when KL is off (the key is absent or always 0), then only
    the policy drift."""
    out = []
    for fname, title, keys in PANELS:
        if fname == "phases.png":
            found = list(dict.fromkeys(k for r in rows for k in r if k.startswith("time/") and k != "time/step"))
            keys = found + (["time/step"] if any("time/step" in r for r in rows) else [])
        if fname == "capacity.png":
            keys = list(dict.fromkeys(k for r in rows for k in r if k.startswith("load/capacity_weight/")))
        if fname == "kl.png" and not any(_number(r.get("kl")) and r["kl"] != 0 for r in rows):
            keys, title = [k for k in keys if k != "kl"], KL_OFF_TITLE
        out.append((fname, title, keys))
    return out


def plotted_rows(run_dir: str | Path) -> list[dict]:
    """A run directory's metrics rows, checked for plotting (a bad line, or no rows, is a UsageError) before anything
    is written."""
    rows = read_metrics(run_dir)
    if not rows:
        raise UsageError(f"{run_dir}: no metrics.jsonl with rows; give a run directory written by evenrl train")
    return rows


def write_plots(run_dir: str | Path, rows: list[dict] | None = None) -> list[Path]:
    """RUN_DIR/plots/*.png from its metrics (`rows`: plotted_rows's, when the caller has read them)."""
    run_dir = Path(run_dir)
    rows = plotted_rows(run_dir) if rows is None else rows  # a bad line is a UsageError here, before any writing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir = run_dir / "plots"
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{out_dir}: a file where the plots directory goes; move it away")
    out_dir.mkdir(exist_ok=True)
    written = []
    for fname, title, keys in _panels(rows):
        present = [k for k in keys if any(_number(r.get(k)) for r in rows)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in present:
            xs = [r["step"] for r in rows if _number(r.get(k))]
            ys = [r[k] for r in rows if _number(r.get(k))]
            style = dict(color="k", ls="--") if k == "time/step" else {}
            label = ("whole step" if k == "time/step" else k.removeprefix("time/") if fname == "phases.png"
                     else f"rank {k.rpartition('/')[2]}" if fname == "capacity.png" else k)
            if len(ys) < 20:  # sparse series (evaluations): points, no smoothing
                ax.plot(xs, ys, marker="o", lw=1.5, ms=5, label=label, **{"ls": "-", **style})
                continue
            line, = ax.plot(xs, ys, alpha=0.35, lw=1, **style)
            ax.plot(xs, _smooth(ys, max(1, len(ys) // 20)), color=line.get_color(), lw=2, label=label,
                    ls=style.get("ls", "-"))
        ax.set_title(title, fontsize=10 if "\n" in title else None)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2 if len(present) > 4 else 1)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=100)
        plt.close(fig)
        written.append(out_dir / fname)
    loads = [r["load/rank_tokens"] for r in rows if isinstance(r.get("load/rank_tokens"), list)
             and r["load/rank_tokens"] and all(_number(x) for x in r["load/rank_tokens"])]
    if loads:
        world = len(loads[-1])
        same = [step_loads for step_loads in loads if len(step_loads) == world]
        totals = [sum(step_loads[i] for step_loads in same) for i in range(world)]
        # a vision-language run: the vision encoder's share of each rank's load, stacked on the text part
        vision = [v for v in (r.get("load/rank_vision_tokens") for r in rows)
                  if isinstance(v, list) and len(v) == world and all(_number(x) for x in v)]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if vision:
            v = [sum(step[i] for step in vision) for i in range(world)]
            ax.bar(range(world), [t - x for t, x in zip(totals, v)], color="#4c72b0", label="text and image tokens")
            ax.bar(range(world), v, bottom=[t - x for t, x in zip(totals, v)], color="#dd8452",
                   label="vision encoder (token equivalents)")
        else:
            ax.bar(range(world), totals, color="#4c72b0")
        mean = sum(totals) / world
        ax.axhline(mean, color="k", ls="--", lw=1, label=f"mean {mean:,.0f}")
        skipped = sum(r["load/skipped_samples"] for r in rows if _number(r.get("load/skipped_samples")))
        # rows with a zero advantage are planned onto ranks but not run (train.skip_zero_gradient_samples): the
        # bars hold what ran, which can look uneven where many were skipped
        ax.set_title(f"Training tokens per rank, summed over {len(same)} steps" + (
            f"\n({skipped:,} zero-advantage samples skipped, not counted)" if skipped else ""), fontsize=10)
        ax.set_xlabel("rank")
        if world <= 32:
            ax.set_xticks(range(world))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("tokens")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "rank_load.png", dpi=100)
        plt.close(fig)
        written.append(out_dir / "rank_load.png")
    return written


def first_difference(rows: list[dict], other: list[dict]) -> tuple[int | None, int]:
    """(the first step whose weights/hash differs between two runs' metrics rows, or None; the steps both logged a
    hash for), over the steps both runs reached."""
    a = {r["step"]: r["weights/hash"] for r in rows if isinstance(r.get("weights/hash"), str)}
    b = {r["step"]: r["weights/hash"] for r in other if isinstance(r.get("weights/hash"), str)}
    common = sorted(set(a) & set(b))
    return next((s for s in common if a[s] != b[s]), None), len(common)


def comparable(run_dir: str | Path, other_dir: str | Path, rows: list[dict], other: list[dict]) -> None:
    """Whether two runs' metrics can be compared (both logged weights/hash at some step); a UsageError if not."""
    if not first_difference(rows, other)[1]:
        raise UsageError(f"{run_dir} and {other_dir}: no step logged weights/hash in both (a run logs it with "
                         "train.reproducibility=bitwise)")


def write_comparison(run_dir: str | Path, other_dir: str | Path, rows: list[dict] | None = None,
                     other: list[dict] | None = None) -> tuple[Path, str]:
    """RUN_DIR/plots/compare.png: both runs' sampled reward by step, the first step whose weights differ marked;
    and the one-line verdict. `rows`, `other`: the runs' metrics rows, when the caller has read them."""
    run_dir, other_dir = Path(run_dir), Path(other_dir)
    rows = read_metrics(run_dir) if rows is None else rows
    other = read_metrics(other_dir) if other is None else other
    comparable(run_dir, other_dir, rows, other)
    step, common = first_difference(rows, other)
    verdict = (f"weights identical at all {common} steps both runs logged" if step is None else
               f"weights first differ at step {step} ({common} steps compared)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for rs, label, style in ((rows, run_dir.name, "-"), (other, other_dir.name, "--")):
        pts = [(r["step"], r["reward/mean"]) for r in rs if _number(r.get("reward/mean"))]
        ax.plot([x for x, _ in pts], [y for _, y in pts], ls=style, lw=1.5, label=label)
    if step is not None:
        ax.axvline(step, color="r", lw=1, label=f"weights differ from step {step}")
    ax.set_title(f"Sampled reward of two runs: {verdict}", fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    fig.savefig(out / "compare.png", dpi=100)
    plt.close(fig)
    return out / "compare.png", verdict


def plots_for_trackers(run_dir: str | Path) -> list[Path]:
    """write_plots for the experiment trackers at the end of training: a failure is a warning and no plots, never
    a failed run."""
    try:
        return write_plots(run_dir)
    except Exception as e:  # the plots only decorate the trackers' pages
        print(f"evenrl: warning: no plots for the trackers ({describe_error(e)})", flush=True)
        return []
