"""Partial rollouts against whole-sample steps on a long-tailed response-length workload, reserved rollout ranks.

Run: .venv/bin/python benchmarks/partial_rollouts.py [--steps 30 --budgets 32,16 --median 16 --sigma 1 --new-tokens 128
     --window 5]

The demo's model and task (one-digit addition after the demo's supervised warm start, so the reward can move), with
response lengths drawn from a lognormal distribution instead of the model's EOS (benchmarks/partial_workload: each
sample's length keyed by its step, prompt position and sample, cut at max_new_tokens; the same lengths in every
arm), and a reward that reads the answer at the start of the response (`partial_rollouts:starts_with_answer`). The
same GRPO run (prompts, samples, seed, steps) without partial rollouts and with rollout.partial at each budget
(rollout.tokens_per_round), on the same processes: R only generate, the others train; arms alternate round by
round, so the machine's load hits them alike.

Per arm: samples trained per second over the steady steps (those after the first max_carry_steps + 1, when a
partial run's pipeline is full; the same steps in every arm), the median step, and two idle shares of the rollout
ranks: time (the share of their wall time outside generate calls: waiting for weights and for the trainers) and
rows (the share of row x decode-step slots of their generate calls held by rows that had already finished: what a
step pays for waiting on its longest sample when a decode step costs the same whatever its rows, as on a GPU in
the memory-bound regime, or on this CPU with a tiny model, where a step is overhead). Then each arm's reward curve
on the same step numbers, every round (--window steps a cell, 1: every step; '-' where an arm trained nothing),
and `evenrl plan`'s estimate for the same shape. Prints numbers only; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overlap import run  # benchmarks/overlap.py: `evenrl ARGS` in a subprocess, its stderr on failure

ROOT = Path(__file__).resolve().parents[1]


def starts_with_answer(completion: str, sample: dict) -> float:
    """1 when the response starts with the sum (the rest is the workload's filler), else 0."""
    return 1.0 if completion.strip().startswith(str(sample["answer"])) else 0.0


def summary(run_dir: Path, record: Path, steady: int, generators: list[int]) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) > 0]
    late = rows[steady:]
    calls = [json.loads(x) for g in generators for x in (record / f"gen-{g}").read_text().splitlines()]
    busy = sum(c["s"] for c in calls)
    spans = []
    for g in generators:
        mine = [json.loads(x) for x in (record / f"gen-{g}").read_text().splitlines()]
        spans.append(max(c["t"] for c in mine) - (min(c["t"] - c["s"] for c in mine)))
    slots = sum(c["rows"] * c["longest"] for c in calls)
    return {"samples_per_s": sum(r["samples"] for r in late) / sum(r["time/step"] for r in late),
            "step_s": statistics.median(r["time/step"] for r in late),
            "idle_time": 1 - busy / sum(spans), "idle_rows": 1 - sum(c["tokens"] for c in calls) / max(slots, 1),
            "in_flight": statistics.mean(r.get("partial/in_flight", 0) for r in late),
            "rewards": {r["step"]: r.get("reward/mean") for r in rows},  # None: a step that trained nothing
            "trained": {r["step"]: r.get("samples", 0) for r in rows}}


def print_reward_curve(results: dict[str, list[dict]], steps: int, window: int) -> None:
    """Each arm's reward/mean over the same step numbers, per round, as windows of `window` steps: a window's mean
    over the samples trained in it (each step's mean weighted by its samples), '-' where the arm trained nothing.
    A partial arm's reward at step t is that of the groups complete at t, drawn at t or up to max_carry_steps
    before."""
    for rnd in range(len(next(iter(results.values())))):
        print(f"\nreward/mean by step, round {rnd + 1} (a partial run trains nothing until its first groups are "
              "complete):")
        spans = [(a, min(a + window - 1, steps)) for a in range(1, steps + 1, window)]
        print(f"{'steps':>26} " + " ".join(f"{f'{a}-{b}' if b > a else str(a):>7}" for a, b in spans))
        for name, rs in results.items():
            rw, n = rs[rnd]["rewards"], rs[rnd]["trained"]
            cells = []
            for a, b in spans:
                got = [(rw[t], n[t]) for t in range(a, b + 1) if rw.get(t) is not None and n.get(t)]
                total = sum(k for _, k in got)
                cells.append(f"{sum(x * k for x, k in got) / total:7.3f}" if total else f"{'-':>7}")
            print(f"{name:>26} " + " ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every arm")
    ap.add_argument("--budgets", default="32,16", help="rollout.tokens_per_round of the partial arms")
    ap.add_argument("--max-carry", type=int, default=7, help="rollout.max_carry_steps")
    ap.add_argument("--median", type=float, default=16.0, help="median response length")
    ap.add_argument("--sigma", type=float, default=1.0, help="spread of log(length)")
    ap.add_argument("--new-tokens", type=int, default=128, help="rollout.max_new_tokens")
    ap.add_argument("--staleness", type=int, default=0, help="rollout.max_staleness of every arm")
    ap.add_argument("--nproc", type=int, default=2, help="processes in all")
    ap.add_argument("--rollout-devices", type=int, default=1, help="of which only generate")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    ap.add_argument("--decoder", default="auto", help="rollout.decoder: auto (lean on CPU: finished rows dropped) or "
                                                     "static (every row to the end, as CUDA graphs run on a GPU)")
    ap.add_argument("--window", type=int, default=5, help="steps per cell of the reward curve (1: every step)")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": path}

    from evenrl.demo import write_addition_data
    from evenrl.testing import make_tiny_model

    arms = {"whole samples": []} | {f"partial, {b} tokens/step": [
        "rollout.partial=true", f"rollout.tokens_per_round={b}", f"rollout.max_carry_steps={args.max_carry}"]
        for b in budgets}
    generators = list(range(args.nproc - args.rollout_devices, args.nproc))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        cfg = str(ROOT / "examples" / "demo.yaml")
        common = ["eval.path=''", "log.samples_every_steps=0", "log.progress=false", "log.tensorboard=false"]
        model = make_tiny_model(str(out / "model"), arch="qwen2", seed=0)
        data = out / "addition.jsonl"
        write_addition_data(data)
        common.append(f"data.path={data}")
        t0 = time.perf_counter()
        run(["sft", cfg, *common, f"model.path={model}", f"log.run_dir={out / 'sft'}", "--overwrite"], env)
        print(f"warm start (evenrl sft, the demo's): {time.perf_counter() - t0:.0f} s", flush=True)
        shape = [*common, f"model.path={out / 'sft' / 'final'}", f"train.steps={args.steps}",
                 f"data.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
                 f"rollout.max_new_tokens={args.new_tokens}", f"rollout.max_staleness={args.staleness}",
                 f"rollout.decoder={args.decoder}",
                 "rewards.functions=[{name: 'partial_rollouts:starts_with_answer'}]", "rewards.isolate=false",
                 "checkpoint.every_steps=0", "train.token_cap_per_micro_batch=8192",
                 f"rollout.response_lengths.median={round(args.median)}", f"rollout.response_lengths.sigma={args.sigma}",
                 "--nproc-per-node", str(args.nproc), "--rollout-devices", str(args.rollout_devices)]
        results: dict[str, list[dict]] = {name: [] for name in arms}
        for rnd in range(args.rounds):
            for i, (name, extra) in enumerate(arms.items()):
                run_dir, record = out / f"arm{i}-{rnd}", out / f"record{i}-{rnd}"
                record.mkdir(parents=True, exist_ok=True)
                arm_env = {**env, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "partial_workload"), path]),
                           "EVENRL_BENCH_LENGTHS": f"{args.median}:{args.sigma}:0", "EVENRL_BENCH_RECORD": str(record)}
                run(["train", cfg, *shape, *extra, f"log.run_dir={run_dir}", "--overwrite"], arm_env)
                s = summary(run_dir, record, args.max_carry + 1, generators)
                results[name].append(s)
                print(f"round {rnd + 1} {name}: {s['samples_per_s']:.1f} samples/s, step {s['step_s'] * 1e3:.0f} ms, "
                      f"rollout ranks idle {s['idle_time']:.0%} of their time, {s['idle_rows']:.0%} of their row "
                      f"slots", flush=True)
        plan = subprocess.run([sys.executable, "-m", "evenrl.cli", "plan", cfg, *shape, *arms[list(arms)[1]],
                               "--json"], env=env, capture_output=True, text=True)
        notes = [f["message"] for f in json.loads(plan.stdout)["findings"] if f["rule"] == "partial-estimate"] \
            if plan.stdout.strip().startswith("{") else []

    import torch

    print(f"\n{args.nproc} processes ({args.rollout_devices} only generate) on CPU, OMP threads {args.threads} each, "
          f"{os.cpu_count()} cores; the demo's model after its warm start; {args.prompts} prompts x {args.samples} "
          f"samples per step, lengths lognormal(median {args.median:g}, sigma {args.sigma:g}) cut at "
          f"{args.new_tokens}; decoder {args.decoder}; max_staleness {args.staleness}, max_carry_steps {args.max_carry}; "
          f"{args.steps} steps "
          f"(steady: after step {args.max_carry + 1}); torch {torch.__version__}")
    base = list(arms)[0]
    print(f"{'arm':>26} {'samples/s':>10} {'vs whole':>9} {'step ms':>8} {'in flight':>10} {'idle time':>10} "
          f"{'idle rows':>10}")
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("rewards", "trained")}
        ratio = statistics.median(r["samples_per_s"] / b["samples_per_s"] for r, b in zip(rs, results[base]))
        print(f"{name:>26} {med['samples_per_s']:10.1f} {ratio:8.2f}x {med['step_s'] * 1e3:8.0f} "
              f"{med['in_flight']:10.0f} {med['idle_time']:10.0%} {med['idle_rows']:10.0%}")
    print_reward_curve(results, args.steps, args.window)
    for note in notes:
        print(f"\nevenrl plan's estimate for {list(arms)[1]}: {note}")


if __name__ == "__main__":
    main()
