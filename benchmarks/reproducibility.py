"""What train.reproducibility=bitwise costs against rounding (docs/reproducibility.md), side by side, one run:

    .venv/bin/python benchmarks/reproducibility.py                 # all three tables (~9 min on 2 loaded cores)
    .venv/bin/python benchmarks/reproducibility.py --only balance  # reduction | steps | balance
    .venv/bin/python benchmarks/reproducibility.py --only steps --models 30M --worlds 1   # one row

reduction  one mini-batch's gradient reduction per rank on 1, 2, 3 gloo processes, for the tiny test model (81 K
           parameters) and a 30 M-parameter Qwen2 shape, 4 micro-batches per rank: rounding (autograd's += into
           .grad, all_reduce_grads, torch's clip) against bitwise (each micro-batch into fixed-point bins,
           ExactGrads.reduce, the fixed-point clip norm); median of 5 repetitions, ms.
steps      `evenrl train` step time (median over steps 2..N, from metrics.jsonl) under rounding and bitwise on 1, 2,
           3 processes, for the same two models; `update` is the update phase alone (its gradient reduction
           included).
balance    the price of whole micro-batches: the busiest rank's padded tokens over an even split of the tokens, for the
           token-level schedule (rounding: rows balanced, then packed per rank) and the canonical one (bitwise:
           packed once, whole micro-batches dealt), on lognormal sample lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

MODELS = {"tiny": dict(hidden=64, layers=2, heads=4), "30M": dict(hidden=512, layers=13, heads=8)}
WORLDS = (1, 2, 3)
MICRO = 4


def _reduction_worker(rank: int, world: int, port: int, shapes: list, out: str, src: str | None = None) -> None:
    if src:  # --baseline: evenrl from another source tree
        sys.path.insert(0, src)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    for k in ("SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(k, None)
    torch.set_num_threads(1)
    from evenrl.distributed import collectives as dist
    from evenrl.distributed import exact

    if world > 1:
        dist.init(timeout=300)
    g = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    grads = [[torch.randn(s, generator=g) * 1e-3 for s in shapes] for _ in range(MICRO)]
    times: dict[str, list[float]] = {"rounding": [], "bitwise": []}
    for _ in range(5):
        for arm in ("rounding", "bitwise"):
            for p in params:
                p.grad = None
            if world > 1:
                torch.distributed.barrier()
            t0 = time.perf_counter()
            if arm == "rounding":
                for micro in grads:  # what autograd does across micro-batches: += into .grad
                    for p, x in zip(params, micro):
                        p.grad = x.clone() if p.grad is None else p.grad.add_(x)
                dist.all_reduce_grads(params)
                dist.clip_grad_norm(params, 1.0)
            else:
                bins = exact.ExactGrads(params)
                for micro in grads:
                    for p, x in zip(params, micro):
                        p.grad = x.clone()
                    bins.deposit()
                bins.reduce()
                exact.clip_grad_norm(params, 1.0)
            times[arm].append(time.perf_counter() - t0)
    if world > 1:
        dist.shutdown()
    if rank == 0:
        torch.save({k: statistics.median(v) for k, v in times.items()}, out)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(root: Path, name: str) -> Path:
    from evenrl.testing import make_tiny_model

    path = root / f"model-{name}"
    if not path.exists():
        make_tiny_model(str(path), arch="qwen2", seed=0, **MODELS[name])
    return path


def reduction(root: Path, models, worlds, baseline: str | None = None) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    print(f"\nreduction: one mini-batch's gradient reduction per rank ({MICRO} micro-batches each), ms, median of 5"
          + (f"; before: bitwise with {baseline}, run just before" if baseline else ""))
    print(f"{'model':<6} {'params':>8} {'world':>5} {'rounding':>9} {'bitwise':>9} {'ratio':>6}"
          + (f" {'before':>9} {'ratio':>6}" if baseline else ""))
    for name in models:
        config = AutoConfig.from_pretrained(_model(root, name))  # written outside the meta device
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        shapes = [tuple(p.shape) for p in model.parameters()]
        n = sum(p.numel() for p in model.parameters())
        for world in worlds:
            out, before = str(root / f"red-{name}-{world}.pt"), ""
            if baseline:
                mp.spawn(_reduction_worker, args=(world, _free_port(), shapes, out, baseline), nprocs=world)
                t0 = torch.load(out)
                before = f" {1e3 * t0['bitwise']:>9.1f} {t0['bitwise'] / t0['rounding']:>6.2f}"
            mp.spawn(_reduction_worker, args=(world, _free_port(), shapes, out), nprocs=world)
            t = torch.load(out)
            print(f"{name:<6} {n / 1e6:>7.2f}M {world:>5} {1e3 * t['rounding']:>9.1f} {1e3 * t['bitwise']:>9.1f} "
                  f"{t['bitwise'] / t['rounding']:>6.2f}" + before)


def _train(root: Path, name: str, mode: str, world: int, steps: int, src: str | None = None) -> dict:
    from evenrl.demo import write_addition_data

    data = root / "addition.jsonl"
    if not data.exists():
        write_addition_data(data)
    run = root / f"run-{name}-{mode}-{world}"
    cmd = [sys.executable, "-m", "evenrl.cli", "train", "examples/demo.yaml", f"model.path={_model(root, name)}",
           f"data.path={data}", "eval.path=", f"log.run_dir={run}", f"train.steps={steps}", "log.progress=false",
           "data.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
           "algo.minibatches_per_step=2", "train.token_cap_per_micro_batch=64", f"train.reproducibility={mode}",
           "checkpoint.every_steps=0", "--overwrite", "--nproc-per-node", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": src} if src else {})}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 2]
    return {k: statistics.median(r[f"time/{k}"] for r in rows) for k in ("step", "update", "rollout")}


def steps(root: Path, n: int, models, worlds, baseline: str | None = None) -> None:
    print(f"\nsteps: evenrl train, 8 prompts x 4 samples x 8 new tokens, 2 mini-batches, token cap 64, one thread per "
          f"process; median s over steps 2..{n}" + (f"; b0: bitwise with {baseline}, run just before" if baseline else ""))
    print(f"{'model':<6} {'world':>5} {'step r':>8} {'step b':>8} {'ratio':>6} {'update r':>9} {'update b':>9} "
          f"{'rollout r':>10} {'rollout b':>10}" + (f" {'step b0':>8} {'ratio':>6} {'update b0':>9}" if baseline else ""))
    for name in models:
        for world in worlds:
            r = _train(root, name, "rounding", world, n)
            b0 = _train(root, name, "bitwise", world, n, baseline) if baseline else None
            b = _train(root, name, "bitwise", world, n)
            print(f"{name:<6} {world:>5} {r['step']:>8.3f} {b['step']:>8.3f} {b['step'] / r['step']:>6.2f} "
                  f"{r['update']:>9.3f} {b['update']:>9.3f} {r['rollout']:>10.3f} {b['rollout']:>10.3f}"
                  + (f" {b0['step']:>8.3f} {b0['step'] / r['step']:>6.2f} {b0['update']:>9.3f}" if b0 else ""))


def balance() -> None:
    from evenrl.core.canonical import canonical_schedule
    from evenrl.core.schedule import make_schedule

    print("\nbalance: the busiest rank's padded tokens, summed over mini-batches, / an even split of the samples' "
          "tokens (1.00 = perfect, padding counts), lognormal lengths (median 600 tokens, sigma 1, capped at 4096), "
          "groups of 8, token cap 8192; micro-steps per step")
    print(f"{'samples':>7} {'mini-b':>6} {'world':>5} {'rounding':>9} {'bitwise':>8} {'bitwise steps':>13} "
          f"{'rounding steps':>14}")
    rng = random.Random(0)
    for n, m, worlds in ((512, 4, (2, 8, 64)), (4096, 4, (8, 64)), (64, 1, (2, 8))):
        lengths = [min(4096, max(1, int(rng.lognormvariate(6.4, 1.0)))) for _ in range(n)]
        groups = [i // 8 for i in range(n)]
        for world in worlds:
            out = []
            for make in (make_schedule, canonical_schedule):
                s = make(lengths, world=world, minibatches=m, token_cap=8192, groups=groups)
                busiest = sum(max(sum(x.tokens for x in micros) for micros in mb.per_rank) for mb in s.minibatches)
                even = sum(lengths) / world  # the tokens themselves, evenly: padding counts against both
                out.append((busiest / even, sum(s.micro_steps())))
            print(f"{n:>7} {m:>6} {world:>5} {out[0][0]:>9.3f} {out[1][0]:>8.3f} {out[1][1]:>13} {out[0][1]:>14}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("reduction", "steps", "balance"))
    p.add_argument("--steps", type=int, default=5, help="train steps per run of the steps table")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="reduction, steps: which")
    p.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS), help="reduction, steps: process counts")
    p.add_argument("--baseline", metavar="SRC", help="reduction, steps: also time bitwise with evenrl from this source "
                   "folder, just before each row (a worktree of another commit: git worktree add /tmp/base HEAD~1, "
                   "then --baseline /tmp/base/src)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        if args.only in (None, "balance"):
            balance()
        if args.only in (None, "reduction"):
            reduction(root, args.models, args.worlds, args.baseline)
        if args.only in (None, "steps"):
            steps(root, args.steps, args.models, args.worlds, args.baseline)


if __name__ == "__main__":
    main()
