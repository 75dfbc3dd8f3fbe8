"""Multi-turn trajectories on 3 processes: evenrl's token-balanced split against an equal-count split.

Run: .venv/bin/python benchmarks/multiturn.py [--samples 48] [--steps 5] [--world 3]

A step's trajectories have 1-5 turns: each prompt draws how many its samples take (a hard prompt's trajectories are
all long, as in tool-using runs), each of its --samples-per-prompt samples one turn more or less (seeded); each turn
20-60 sampled tokens and, between turns, an environment turn of 10-40 tokens, after a 30-token prompt. Every
process (gloo, real processes) runs the update of its rows (forward and backward of a 2.4 M-parameter Qwen2 through
evenrl's training forward, micro-batches of at most --token-cap padded tokens) and the gradient all-reduce, under
two splits of the same rows:
  tokens   evenrl.core.schedule.make_schedule on the trajectories' real token counts (what `evenrl train` runs);
  count    contiguous chunks of equal row counts (verl's DataProto.chunk), micro-batched by the same cap.
Printed side by side: update samples/s (rows / the step's wall time, barrier to barrier), the idle-rank fraction
(1 - sum of busy time / (ranks x the busiest rank's)), the busiest rank's tokens over the mean, and micro-steps.
Medians over --steps steps of fresh trajectories; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from evenrl.core.batch import Batch, Ragged
from evenrl.core.schedule import make_schedule
from evenrl.models.forward import response_logits
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model

PROMPT = 30


def trajectories(n: int, per_prompt: int, seed: int) -> list[tuple[int, int]]:
    """(total tokens, response tokens) of n trajectories of 1-5 turns, in prompt groups of `per_prompt`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % per_prompt == 0:
            base = rng.randint(1, 5)
        turns = min(5, max(1, base + rng.randint(-1, 1)))
        response = sum(rng.randint(20, 60) for _ in range(turns)) + sum(rng.randint(10, 40) for _ in range(turns - 1))
        out.append((PROMPT + response, response))
    return out


def count_split(lens: list[int], world: int, cap: int) -> list[list[list[int]]]:
    """Equal row counts per rank in index order, each rank's rows cut into micro-batches of at most `cap` padded
    tokens."""
    q, r = divmod(len(lens), world)
    cuts = [i * q + min(i, r) for i in range(world + 1)]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        micros, cur = [], []
        for i in range(a, b):
            if cur and (len(cur) + 1) * max(lens[j] for j in cur + [i]) > cap:
                micros.append(cur)
                cur = []
            cur.append(i)
        out.append(micros + ([cur] if cur else []))
    return out


def token_split(lens: list[int], world: int, cap: int) -> list[list[list[int]]]:
    sch = make_schedule(lens, world=world, minibatches=1, token_cap=cap)
    return [[m.rows for m in sch.minibatches[0].per_rank[r]] for r in range(world)]


def worker(rank: int, world: int, args, path: str, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    model, _ = load_policy(path)
    model.train()
    results = {"tokens": [], "count": []}
    for step in range(args.steps + 1):  # step 0 warms up
        shapes = trajectories(args.samples, args.samples_per_prompt, seed=step)
        g = torch.Generator().manual_seed(step)
        rows = [torch.randint(4, 60, (total,), generator=g) for total, _ in shapes]
        batch = Batch({"tokens": Ragged.of(rows, torch.long),
                       "response_len": torch.tensor([r for _, r in shapes], dtype=torch.long)})
        lens = [t for t, _ in shapes]
        for name, split in (("tokens", token_split), ("count", count_split)):
            micros = split(lens, world, args.token_cap)
            steps = max(len(m) for m in micros)
            tdist.barrier()
            t0 = time.perf_counter()
            for micro in micros[rank]:
                logits, targets, mask = response_logits(model, batch.select(micro), 0)
                logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
                (-(logp * mask).sum() / max(sum(r for _, r in shapes), 1)).backward()
            busy = time.perf_counter() - t0
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                tdist.all_reduce(p.grad)
                p.grad = None
            tdist.barrier()
            wall = time.perf_counter() - t0
            busy_all = [0.0] * world
            tdist.all_gather_object(busy_all, busy)
            tokens = [sum(len(m) * max(lens[i] for i in m) for m in micros[r]) for r in range(world)]
            if step and rank == 0:
                results[name].append((args.samples / wall, 1 - sum(busy_all) / (world * max(busy_all)),
                                      max(tokens) / (sum(tokens) / world), steps))
    if rank == 0:
        out.update(results)
    tdist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--token-cap", type=int, default=1024)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(d, hidden=256, layers=4, heads=4, seed=0)
        out = mp.Manager().dict()
        port = 29500 + os.getpid() % 1000
        mp.spawn(worker, args=(args.world, args, path, port, out), nprocs=args.world, join=True)
    lens = [t for t, _ in trajectories(args.samples, args.samples_per_prompt, 1)]
    print(f"{args.samples} trajectories of 1-5 turns per step ({args.samples_per_prompt} per prompt; e.g. "
          f"{min(lens)}-{max(lens)} tokens), {args.world} processes, token cap {args.token_cap}, medians over "
          f"{args.steps} steps")
    print(f"{'split':<8} {'samples/s':>10} {'idle ranks':>11} {'busiest/mean tokens':>20} {'micro-steps':>12}")
    for name in ("tokens", "count"):
        rows = out[name]
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        print(f"{name:<8} {med[0]:10.1f} {100 * med[1]:10.1f}% {med[2]:20.3f} {med[3]:12.0f}")


if __name__ == "__main__":
    main()
