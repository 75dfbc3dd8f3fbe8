"""The demo behind `make demo`: a tiny model learns one-digit addition on 2 CPU cores in a few minutes.

    evenrl demo                          # SFT warm start, then GRPO; prints first/last-10-step rewards
    evenrl demo --nproc-per-node 2       # the GRPO phase on two processes (what make demo runs)

1. makes a random 81 K-parameter Qwen2 model with a character tokenizer in runs/demo/model (no download);
2. writes the task: prompts "3+5=" with answers "8" (a, b in 0..9), runs/demo/data/addition.jsonl;
3. a short supervised warm start (evenrl sft) so greedy answers are mostly right but samples are not
   (RL sharpens what the model half-knows: with too little SFT the reward barely moves);
4. GRPO (evenrl train) with an exact-match reward, config examples/demo.yaml;
5. plots (evenrl report) and the mean reward of the first and last 10 steps.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from evenrl.config import load_config
from evenrl.errors import ArgumentParser, UsageError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write_addition_data(path: Path, seed: int = 0) -> int:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def _config_path() -> Path:
    path = EXAMPLES / "demo.yaml"
    if not path.exists():
        raise UsageError(f"{path}: missing; the demo runs from a checkout of the evenrl repository (make demo)")
    return path


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="evenrl demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo", help="where the model, data and runs go")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes for the GRPO phase")
    p.add_argument("overrides", nargs="*", help="dotted overrides of examples/demo.yaml, e.g. train.steps=50 sft.steps=100")
    args = p.parse_args(argv)
    out = Path(args.out)
    cfg_path = _config_path()
    t0 = time.time()

    from evenrl.testing import make_tiny_model

    model_dir = make_tiny_model(str(out / "model"), arch="qwen2", seed=0)
    data = out / "data" / "addition.jsonl"
    n = write_addition_data(data)
    print(f"[demo] tiny Qwen2 model in {model_dir}; {n} addition prompts in {data}")

    common = [f"data.path={data}", f"eval.path={data}"]  # 100 prompts: the task is all of them
    sft_dir = out / "sft"
    sft_cfg = load_config(cfg_path, common + [*args.overrides, f"model.path={model_dir}", f"log.run_dir={sft_dir}"])
    print(f"[demo] supervised warm start: {sft_cfg.sft.steps} steps of {sft_cfg.sft.rows_per_step} rows")
    from evenrl.train.sft import sft

    sft(sft_cfg, overwrite=True)  # the demo owns runs/demo: a second `make demo` starts afresh
    print(f"[demo] warm start done in {time.time() - t0:.0f} s")

    grpo_dir = out / "grpo"
    overrides = common + [f"model.path={sft_dir / 'final'}", f"log.run_dir={grpo_dir}", *args.overrides]
    cmd = [sys.executable, "-m", "evenrl.cli", "train", str(cfg_path), *overrides,
           "--nproc-per-node", str(args.nproc_per_node), "--overwrite"]
    print("[demo] GRPO:", " ".join(cmd[2:]))
    rc = subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")
                                   if args.nproc_per_node > 1 else os.environ.get("OMP_NUM_THREADS", "2")})
    if rc != 0:
        print(f"[demo] training failed with exit code {rc}", file=sys.stderr)
        return rc

    from evenrl.report import write_plots
    from evenrl.train.runlog import read_metrics

    rows = [r for r in read_metrics(grpo_dir) if "reward/mean" in r]
    evals = [r["eval/reward"] for r in read_metrics(grpo_dir) if "eval/reward" in r]
    rewards = [r["reward/mean"] for r in rows]
    first, last = rewards[:10], rewards[-10:]
    plots = write_plots(grpo_dir)
    print(f"[demo] {len(rows)} GRPO steps; mean reward first 10 steps {sum(first) / len(first):.3f} "
          f"-> last 10 steps {sum(last) / len(last):.3f}")
    if len(evals) >= 2:
        print(f"[demo] greedy exact-match on all {n} prompts: before GRPO {evals[0]:.3f} -> after {evals[-1]:.3f}")
    print(f"[demo] run directory: {grpo_dir}  (config.yaml, plan.txt, metrics.jsonl, samples.jsonl, tb/, final/)")
    print(f"[demo] plots: {', '.join(str(p) for p in plots)}")
    print(f"[demo] total {time.time() - t0:.0f} s")
    return 0
