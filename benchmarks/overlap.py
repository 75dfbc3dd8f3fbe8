"""Synchronous vs overlapped steps: rollout.max_staleness 0 against 1 and 2, with reserved rollout processes.

Run: .venv/bin/python benchmarks/overlap.py [--steps 30 --pairs 2 --nproc 2 --rollout-devices 1 --hidden 64]

The demo's task (one-digit addition, exact-match reward) and model (a random Qwen2 with a character tokenizer,
given the demo's supervised warm start once, so the reward can move), then the same GRPO run (the same prompts,
samples per prompt, seed and number of steps) at each staleness, on the same processes: R of them only generate,
the others train. Runs alternate (k=0, k=1, k=2, k=0, ...) so load on the machine hits every arm alike; each
overlapped run's ratio is taken against the synchronous run of its own round, and the median ratio is reported.

--shape qwen2.5-0.5b (or tiny): instead of the demo, benchmarks/gpu.py's random Qwen2.5-0.5B-shaped model, its
data (long sums) and reward (share of digits), no warm start (with random weights the reward says nothing about
learning; the table is about speed). On one GPU the trainer and the rollout process share the device (collectives
then go through gloo: NCCL puts no two ranks on one GPU).

Per run: the median wall time of a step (time/step, leaving out the first, which holds start-up), samples/s
(samples per step over that median), the mean reward of the first and last 10 steps, and how much of a step the
trainers spend waiting for samples (time/rollout: with k >= 1 that is the part of generation not hidden behind the
previous update), then `evenrl plan`'s estimate for the same shape beside the measured numbers. Prints numbers
only; nothing here asserts speed.
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

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], env: dict) -> None:
    proc = subprocess.run([sys.executable, "-m", "evenrl.cli", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"evenrl {' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def summary(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    steps = [r["time/step"] for r in rows[1:]]
    step = statistics.median(steps)
    rewards = [r["reward/mean"] for r in rows]
    return {"step_s": step, "samples_per_s": rows[-1]["samples"] / step,
            "wait_s": statistics.median(r.get("time/rollout", 0.0) for r in rows[1:]),
            "update_s": statistics.median(r.get("time/update", 0.0) for r in rows[1:]),
            "push_s": statistics.median(r.get("time/weights", 0.0) for r in rows[1:]),
            "reward_first": sum(rewards[:10]) / len(rewards[:10]), "reward_last": sum(rewards[-10:]) / len(rewards[-10:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pairs", type=int, default=2, help="rounds of (k=0, k=1, k=2)")
    ap.add_argument("--staleness", default="0,1,2", help="max_staleness values; the first is the baseline")
    ap.add_argument("--nproc", type=int, default=2, help="processes in all")
    ap.add_argument("--rollout-devices", type=int, default=1, help="of which only generate")
    ap.add_argument("--hidden", type=int, default=64, help="model width (the demo's: 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    ap.add_argument("--shape", choices=["demo", "tiny", "qwen2.5-0.5b"], default="demo",
                    help="demo: the demo's model, task and warm start; else benchmarks/gpu.py's model of that shape")
    ap.add_argument("--dtype", default="float32", help="model.dtype")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    ks = [int(k) for k in args.staleness.split(",")]
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": path}

    from evenrl.demo import write_addition_data
    from evenrl.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        cfg = str(ROOT / "examples" / "demo.yaml")
        common = ["eval.path=''", "log.samples_every_steps=0", "log.progress=false", "log.tensorboard=false",
                  f"model.dtype={args.dtype}"]
        if args.shape == "demo":
            model = make_tiny_model(str(out / "model"), arch="qwen2", hidden=args.hidden, layers=args.layers,
                                    heads=max(1, args.hidden // 16), seed=0)
            data = out / "addition.jsonl"
            write_addition_data(data)
            common.append(f"data.path={data}")
            t0 = time.perf_counter()
            run(["sft", cfg, *common, f"model.path={model}", f"log.run_dir={out / 'sft'}", "--overwrite"], env)
            print(f"warm start (evenrl sft, the demo's): {time.perf_counter() - t0:.0f} s", flush=True)
            model = out / "sft" / "final"
        else:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            import gpu

            model, data = gpu.make_model(out / "model", gpu.SHAPES[args.shape]), out / "sums.jsonl"
            gpu.write_data(data)
            common += [f"data.path={data}", "data.max_prompt_tokens=64", "rewards.functions=[{name: 'gpu:digit_fraction'}]",
                       "rewards.isolate=false", "train.lr=1.0e-5", "train.token_cap_per_micro_batch=4096"]
        shape = [*common, f"model.path={model}", f"train.steps={args.steps}",
                 f"data.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
                 f"rollout.max_new_tokens={args.new_tokens}", "checkpoint.every_steps=0",
                 "--nproc-per-node", str(args.nproc), "--rollout-devices", str(args.rollout_devices)]
        plan = subprocess.run([sys.executable, "-m", "evenrl.cli", "plan", cfg, *shape, "rollout.max_staleness=1",
                               "--json"], env=env, capture_output=True, text=True)
        overlap = json.loads(plan.stdout)["overlap"] if plan.stdout.strip().startswith("{") else None
        results: dict[int, list[dict]] = {k: [] for k in ks}
        for pair in range(args.pairs):
            for k in ks:
                run_dir = out / f"k{k}-{pair}"
                t0 = time.perf_counter()
                run(["train", cfg, *shape, f"rollout.max_staleness={k}", f"log.run_dir={run_dir}", "--overwrite"],
                    env)
                s = summary(run_dir)
                s["wall_s"] = time.perf_counter() - t0
                results[k].append(s)
                print(f"round {pair + 1} k={k}: step {s['step_s'] * 1e3:.0f} ms, {s['samples_per_s']:.0f} samples/s, "
                      f"waiting for samples {s['wait_s'] * 1e3:.0f} ms, update {s['update_s'] * 1e3:.0f} ms, "
                      f"weight push {s['push_s'] * 1e3:.0f} ms, "
                      f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}", flush=True)

    import torch

    where = f"{torch.cuda.get_device_name()} (shared by all processes)" if torch.cuda.is_available() else "CPU"
    model_text = (f"demo model hidden {args.hidden} x {args.layers} layers" if args.shape == "demo"
                  else f"random {args.shape}-shaped model")
    print(f"\n{args.nproc} processes ({args.rollout_devices} only generate) on {where}, OMP threads {args.threads} "
          f"each, {os.cpu_count()} cores; {model_text}, {args.dtype}; {args.prompts} prompts x "
          f"{args.samples} samples x {args.new_tokens} new tokens per step; {args.steps} steps; torch "
          f"{torch.__version__}")
    if overlap:
        est = overlap["planned"]
        print(f"evenrl plan's estimate ({overlap['rates']['basis']}): generation {est['generation_s'] * 1e3:.0f} ms, "
              f"training {est['training_s'] * 1e3:.0f} ms, push {est['push_s'] * 1e3:.1f} ms; step synchronous "
              f"{est['sync_step_s'] * 1e3:.0f} ms, overlapped {est['overlapped_step_s'] * 1e3:.0f} ms")
    base = ks[0]
    print(f"{'max_staleness':>13} {'step ms':>8} {'samples/s':>10} {'wait ms':>8} {'update ms':>9} "
          f"{'reward first10->last10':>23} {'samples/s vs k=' + str(base):>18}")
    for k in ks:
        rs = results[k]
        ratio = statistics.median(r["samples_per_s"] / b["samples_per_s"] for r, b in zip(rs, results[base]))
        med = {name: statistics.median(r[name] for r in rs) for name in rs[0]}
        print(f"{k:>13} {med['step_s'] * 1e3:8.0f} {med['samples_per_s']:10.1f} {med['wait_s'] * 1e3:8.0f} "
              f"{med['update_s'] * 1e3:9.0f} {med['reward_first']:11.3f} -> {med['reward_last']:.3f} "
              f"{ratio:17.2f}x")


if __name__ == "__main__":
    main()
