"""One slow rank of three: equal capacity weights against parallel.capacity_weights=auto, side by side.

Run: .venv/bin/python benchmarks/heterogeneous.py [--steps 20 --rounds 2 --slow 3 --hidden 128 --layers 4]

Three CPU processes train the same GRPO run (a random Qwen2 of the given shape, the demo's one-digit sums, the
share of digits as reward) while rank 1 computes --slow times slower: tests/faults' plug-in makes each of its
training forwards and generation calls sleep (slow - 1) times their own duration (EVENRL_FAULT_SLOW_RANK; evenrl
has no hooks of its own). Arm "equal": parallel.capacity_weights=[1,1,1] (every rank the same share; the weights
are set so that each rank's busy time is measured and logged). Arm "auto": measured speeds, balanced by from the
second step. Runs alternate (equal, auto, equal, ...) so load on the machine hits both alike.

Per run, over the steps after the first --warmup: the median wall time of a step (time/step), the median update
phase on rank 0 (time/update: its own passes plus the wait for the slowest rank in the gradient reduction), and each
rank's idle fraction: (slowest rank's busy seconds - its own) / slowest's, from load/busy_s/<rank> (the seconds a rank
spent in its own generation and forward/backward passes, waits excluded), averaged over steps; for auto also the last
weights. Prints numbers only; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLD = 3
SLOW_RANK = 1


def run(args: list[str], env: dict) -> None:
    proc = subprocess.run([sys.executable, "-m", "evenrl.cli", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"evenrl {' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def summary(run_dir: Path, warmup: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    idle = [[] for _ in range(WORLD)]
    for r in rows:
        busy = [r[f"load/busy_s/{k}"] for k in range(WORLD)]
        for k in range(WORLD):
            idle[k].append((max(busy) - busy[k]) / max(max(busy), 1e-9))
    return {"step_s": statistics.median(r["time/step"] for r in rows),
            "update_s": statistics.median(r["time/update"] for r in rows),
            "rollout_s": statistics.median(r["time/rollout"] for r in rows),
            "idle": [sum(x) / len(x) for x in idle],
            "tokens": [statistics.mean(r["load/rank_tokens"][k] for r in rows) for k in range(WORLD)],
            "weights": [rows[-1].get(f"load/capacity_weight/{k}") for k in range(WORLD)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out (auto measures on them)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (equal, auto)")
    ap.add_argument("--slow", type=float, default=3.0, help="rank 1 computes this many times slower")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    path = os.pathsep.join([str(ROOT / "tests" / "faults"), str(ROOT / "src"), str(ROOT / "benchmarks"),
                            os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path,
           "EVENRL_FAULT_SLOW_RANK": f"{SLOW_RANK}:{args.slow}"}

    from evenrl.demo import write_addition_data
    from evenrl.testing import make_tiny_model

    arms = {"equal": "parallel.capacity_weights=[1,1,1]", "auto": "parallel.capacity_weights=auto"}
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        model = make_tiny_model(str(out / "model"), arch="qwen2", hidden=args.hidden, layers=args.layers,
                                heads=max(1, args.hidden // 16), seed=0)
        data = out / "addition.jsonl"
        write_addition_data(data)
        shape = [str(ROOT / "examples" / "demo.yaml"), f"model.path={model}", f"data.path={data}", "eval.path=''",
                 "rewards.functions=[{name: 'gpu:digit_fraction'}]", "rewards.isolate=false",
                 f"train.steps={args.steps}", f"data.prompts_per_step={args.prompts}",
                 f"rollout.samples_per_prompt={args.samples}", f"rollout.max_new_tokens={args.new_tokens}",
                 "checkpoint.every_steps=0", "log.samples_every_steps=0", "log.progress=false",
                 "log.tensorboard=false", "--nproc-per-node", str(WORLD)]
        for rnd in range(args.rounds):
            for arm, setting in arms.items():
                run_dir = out / f"{arm}-{rnd}"
                run(["train", *shape, setting, f"log.run_dir={run_dir}", "--overwrite"], env)
                s = summary(run_dir, args.warmup)
                results[arm].append(s)
                print(f"round {rnd + 1} {arm:>5}: step {s['step_s'] * 1e3:.0f} ms, update {s['update_s'] * 1e3:.0f} "
                      f"ms, idle {' '.join(f'{x:.2f}' for x in s['idle'])}", flush=True)

    import torch

    print(f"\n{WORLD} CPU processes, rank {SLOW_RANK} {args.slow:g}x slower (forwards and generation), OMP threads 1 "
          f"each, {os.cpu_count()} cores; random Qwen2 hidden {args.hidden} x {args.layers} layers; "
          f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens per step; {args.steps} "
          f"steps, the first {args.warmup} left out; medians over {args.rounds} rounds; torch {torch.__version__}")
    head = f"{'arm':>6} {'step ms':>8} {'update ms':>10} {'rollout ms':>11} " + " ".join(
        f"{'idle r' + str(k):>8}" for k in range(WORLD)) + " " + " ".join(
        f"{'tokens r' + str(k):>10}" for k in range(WORLD)) + "  last weights"
    print(head)
    for arm, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("step_s", "update_s", "rollout_s")}
        idle = [statistics.median(r["idle"][k] for r in rs) for k in range(WORLD)]
        tokens = [statistics.median(r["tokens"][k] for r in rs) for k in range(WORLD)]
        weights = rs[-1]["weights"] if arm == "auto" else [1.0] * WORLD
        print(f"{arm:>6} {med['step_s'] * 1e3:8.0f} {med['update_s'] * 1e3:10.0f} {med['rollout_s'] * 1e3:11.0f} "
              + " ".join(f"{x:8.2f}" for x in idle) + " " + " ".join(f"{x:10.0f}" for x in tokens)
              + "  " + ",".join(f"{w:g}" for w in weights))
    ratio = statistics.median(a["step_s"] / e["step_s"] for a, e in zip(results["auto"], results["equal"]))
    print(f"auto / equal step time: {ratio:.2f}x (median of the rounds' ratios)")


if __name__ == "__main__":
    main()
