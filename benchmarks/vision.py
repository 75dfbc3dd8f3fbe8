"""Mixed-resolution image batches on 3 processes: evenrl's token-balanced schedule (text + image tokens + the vision
encoder's work, evenrl.core.schedule with `extra`) vs the same schedule without the encoder term (text + image
tokens only) vs an equal-count split (each rank the next N/3 samples, as verl/EasyR1 chunk a batch, micro-batches
of a fixed number of samples), side by side in one run.

    .venv/bin/python benchmarks/vision.py        # ~2 min on 2 CPU cores; prints per-rank busy time and idle share

The update of three steps of a tiny Qwen2.5-VL (evenrl.testing.make_tiny_model, arch="qwen2_5_vl", its vision
tower widened so that images cost about what they do in a real model): 12 prompts x 4 samples each, every prompt
with one image whose size is drawn per step (56, 112, 224 or 448 pixels square: 4 to 256 image tokens, 16 to 1,024
patches; half of them small), responses of 8-40 tokens. Each rank runs forward + backward over its micro-batches
(gloo, 1 thread each), the ranks taking turns so that each one's time is its own on a machine with fewer cores
than ranks (as on 3 devices); busy = that time, idle = what it would wait for the slowest rank before the gradient
all-reduce. Arms alternate, 3 rounds per step; medians shown.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

WORLD, PROMPTS, SAMPLES, MICRO, STEPS = 3, 12, 4, 4, 3  # MICRO: samples per micro-batch of the equal-count arm
SIDES, SIDE_WEIGHTS = (56, 112, 224, 448), (0.5, 0.2, 0.2, 0.1)  # image sizes (square) and how often each comes
TOKEN_CAP = 2400


def _samples(tok, processor, config, seed: int):
    """The step's samples: (token ids, response length, ImageInputs) in sample order, groups of SAMPLES."""
    import io

    import numpy as np
    from PIL import Image

    from evenrl.models.vision import encode_vision_prompt, image_inputs

    rng, pixels = random.Random(seed), np.random.default_rng(seed)
    out = []
    for p in range(PROMPTS):
        w = h = rng.choices(SIDES, SIDE_WEIGHTS)[0]
        buf = io.BytesIO()
        Image.fromarray(pixels.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        prompt = encode_vision_prompt(tok, processor, config, f"<image>x+{p}=9, x=", [(w, h)], False)
        inputs = image_inputs(processor, [buf.getvalue()])
        for _ in range(SAMPLES):
            response = [rng.randrange(10, 60) for _ in range(rng.randint(8, 40))]
            out.append((prompt + response, len(response), inputs))
    return out


def _worker(rank: int, model_dir: str, port: int, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    from evenrl.distributed import collectives as dist
    from evenrl.models.loading import load_policy
    from evenrl.models.vision import load_image_processor
    from evenrl.models.vision_config import vision_token_weight
    from evenrl.planner.dims import read_model_dims

    dist.init()
    model, tok = load_policy(model_dir)
    model.train()
    processor = load_image_processor(model_dir, min_pixels=None, max_pixels=max(SIDES) ** 2)
    dims = read_model_dims(model_dir)
    weight = vision_token_weight(dims.layers, dims.layer_params, dims.vision)
    rows = []
    for step in range(STEPS):
        samples = _samples(tok, processor, model.config, seed=step)
        rows.append(_step(model, tok, samples, weight, rank))
    if rank == 0:
        out.put((rows, weight, sum(p.numel() for p in model.model.visual.parameters()),
                 sum(p.numel() for p in model.parameters())))
    dist.shutdown()


def _step(model, tok, samples, weight, rank):
    """Both arms on one step's samples: (per rank median busy seconds, per rank tokens) by arm."""
    import torch.distributed as tdist

    from evenrl.core.batch import Batch, Ragged
    from evenrl.core.schedule import make_schedule
    from evenrl.models.forward import response_logits

    lengths = [len(t) for t, _, _ in samples]
    vision = [round(int(x.grid.prod(-1).sum()) * weight) for _, _, x in samples]
    groups = [i // SAMPLES for i in range(len(lengths))]
    balanced = make_schedule(lengths, world=WORLD, token_cap=TOKEN_CAP, groups=groups, extra=vision).minibatches[0]
    text_only = make_schedule(lengths, world=WORLD, token_cap=TOKEN_CAP, groups=groups).minibatches[0]
    n = len(samples) // WORLD
    equal = [[list(range(r * n, (r + 1) * n))[i:i + MICRO] for i in range(0, n, MICRO)] for r in range(WORLD)]
    plans = {"token-balanced": [[list(m.rows) for m in micros if m.rows] for micros in balanced.per_rank],
             "no encoder term": [[list(m.rows) for m in micros if m.rows] for micros in text_only.per_rank],
             "equal-count": equal}
    # per rank, what its micro-batches hold: rows x longest row + the rows' vision-encoder tokens
    loads = {arm: [sum(len(m) * max(lengths[i] for i in m) + sum(vision[i] for i in m) for m in micros)
                   for micros in plan] for arm, plan in plans.items()}

    def batch_of(rows):
        pick = [samples[i] for i in rows]
        return Batch({"tokens": Ragged.of([torch.tensor(t) for t, _, _ in pick], torch.long),
                      "response_len": torch.tensor([r for _, r, _ in pick]),
                      "pixel_values": Ragged.of([x.pixel_values for _, _, x in pick], torch.float32),
                      "image_grid_thw": Ragged.of([x.grid for _, _, x in pick], torch.long)})

    busy = {arm: [] for arm in plans}
    for _ in range(3):
        for arm, plan in plans.items():
            for turn in range(WORLD):  # one rank at a time: each one's time is its own on fewer cores than ranks
                tdist.barrier()
                if turn == rank:
                    t0 = time.perf_counter()
                    for rows in plan[rank]:
                        logits, _, mask = response_logits(model, batch_of(rows), tok.pad_token_id)
                        (logits.float().logsumexp(-1) * mask).sum().backward()
                    busy[arm].append(time.perf_counter() - t0)
                    model.zero_grad(set_to_none=True)
    times = [None] * WORLD
    tdist.all_gather_object(times, {arm: statistics.median(v) for arm, v in busy.items()})
    return {arm: ([t[arm] for t in times], loads[arm]) for arm in plans}


def main():
    from evenrl.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model_dir = make_tiny_model(os.path.join(d, "m"), arch="qwen2_5_vl", hidden=128, layers=4, heads=4,
                                    vision_width=128)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = 29500 + os.getpid() % 1000
        procs = [ctx.Process(target=_worker, args=(r, model_dir, port, out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        rows, weight, vis, total = out.get(timeout=1800)
        for p in procs:
            p.join()
    print(f"{WORLD} CPU processes (gloo, 1 thread each); tiny Qwen2.5-VL, {total / 1e6:.2f} M parameters "
          f"({vis / 1e6:.2f} M in the vision tower, {weight:.2f} tokens of compute per patch); {PROMPTS} prompts x "
          f"{SAMPLES} samples per step, one image each of {', '.join(map(str, SIDES))} pixels square; "
          f"torch {torch.__version__}")
    print(f"{'step':>4} {'arm':<15} {'tokens per rank (text+image+vision)':>36} {'busy s per rank':>22} "
          f"{'update s':>8} {'idle %':>6}")
    ratios = []
    for step, arms in enumerate(rows):
        for arm in ("token-balanced", "no encoder term", "equal-count"):
            busy, loads = arms[arm]
            slowest = max(busy)
            idle = sum(slowest - b for b in busy) / (WORLD * slowest)
            print(f"{step:>4} {arm:<15} {' '.join(f'{x:>7,}' for x in loads):>36} "
                  f"{' '.join(f'{b:6.2f}' for b in busy):>22} {slowest:8.2f} {100 * idle:6.1f}")
        ratios.append([max(arms[a][0]) / max(arms["token-balanced"][0]) for a in ("no encoder term", "equal-count")])
    for j, arm in enumerate(("no encoder term", "equal-count")):
        print(f"update time (the slowest rank), {arm} / token-balanced: "
              + ", ".join(f"step {i} {r[j]:.2f}x" for i, r in enumerate(ratios)))


if __name__ == "__main__":
    sys.exit(main())
