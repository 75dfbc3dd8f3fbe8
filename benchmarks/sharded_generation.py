"""Generating from an FSDP2-sharded policy: gather the whole model once per rollout (what evenrl does,
`distributed.weights.gathered`) vs let FSDP gather layer by layer inside every decoding step.

    .venv/bin/python benchmarks/sharded_generation.py            # 2 CPU processes, prints a table

Both arms generate the same samples (same keys, EOS ignored so every rank decodes the same number of tokens: the
per-layer arm needs that, or the ranks' gathers would not meet). Runs alternate, 3 pairs; ratio per pair.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, model_dir: str, port: int, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from evenrl.distributed import collectives as dist
    from evenrl.distributed.sharding import shard
    from evenrl.distributed.weights import gathered
    from evenrl.engines.base import Request
    from evenrl.engines.hf import SamplingParams, generate
    from evenrl.models.loading import load_policy

    dist.init()
    model, tok = load_policy(model_dir)
    shard(model)
    model.eval()
    prompts = [tok(f"{i % 50}+{(7 * i) % 50}=")["input_ids"] for i in range(8)]
    keys = [rank * 100 + i for i in range(8)]
    rows = []
    for new in (16, 64):
        params = SamplingParams(max_new_tokens=new, samples_per_prompt=4)
        kw = dict(eos_token_ids=set(), pad_token_id=tok.pad_token_id)
        asks = [Request(p, k, 0) for p, k in zip(prompts, keys)]
        for pair in range(3):
            times = {}
            for arm in ("gather once", "per layer"):
                tdist.barrier()
                t0 = time.perf_counter()
                if arm == "gather once":
                    with gathered(model):
                        res = generate(model, asks, params, **kw)
                else:  # the model's own forward: FSDP's hooks gather each block at every decoding step
                    res = generate(model, asks, params, decoder="forward", **kw)
                tdist.barrier()
                times[arm] = time.perf_counter() - t0
                if arm == "gather once":
                    want = [c.token_ids for r in res for c in r]
                else:
                    assert [c.token_ids for r in res for c in r] == want, "the two arms sampled differently"
            n_tok = 8 * 4 * new
            rows.append((new, pair, times["gather once"], times["per layer"], n_tok))
    if rank == 0:
        out.put(rows)
    dist.shutdown()


def main():
    from safetensors.torch import load_file

    from evenrl.testing import make_tiny_model

    world = 2
    with tempfile.TemporaryDirectory() as d:
        model_dir = make_tiny_model(os.path.join(d, "m"), hidden=256, layers=8, heads=8)
        n = sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = 29500 + os.getpid() % 1000
        procs = [ctx.Process(target=_worker, args=(r, world, model_dir, port, out)) for r in range(world)]
        for p in procs:
            p.start()
        rows = out.get(timeout=1800)
        for p in procs:
            p.join()
    print(f"FSDP2 over {world} CPU processes (gloo, 1 thread each), Qwen2 {n / 1e6:.1f} M parameters, 8 layers; "
          f"8 prompts x 4 samples per rank, EOS ignored; torch {torch.__version__}")
    print(f"{'new tokens':>10} {'pair':>4} {'gather once s':>14} {'per layer s':>12} {'ratio':>6} "
          f"{'tok/s once':>11} {'tok/s layer':>12}")
    for new, pair, once, layer, n_tok in rows:
        print(f"{new:>10} {pair:>4} {once:14.3f} {layer:12.3f} {layer / once:6.2f} {n_tok / once:11,.0f} "
              f"{n_tok / layer:12,.0f}")


if __name__ == "__main__":
    sys.exit(main())
