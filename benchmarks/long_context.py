"""Long samples on CPU: one sample's peak memory per rank and step time at sequence_parallel_size 1, 2, 4, planned
beside measured; and the padding a batch of lognormal lengths wastes, padded rows against packed ones.

Run: .venv/bin/python benchmarks/long_context.py [--lengths 8192,16384] [--sp 1,2,4] [--padding-only]

The model: Qwen2-shaped, narrow with a wide vocabulary (MODEL: hidden 128, 4 layers, 4 query and 2 KV heads, a
32,768-token vocabulary, tied; random weights), so the output layer and attention, not the MLPs, are the cost.
The sample: 64 prompt tokens and length - 64 response tokens, one micro-batch (train.token_cap_per_micro_batch is
one sample's slice per rank), float32, replicated (FSDP would only move the state, which SP does not change).

Measured, one arm per (length, SP): `python -m torch.distributed.run --nproc-per-node SP` runs this file's worker on
SP gloo processes; each builds the model, applies the run config (parallel.sequence_parallel_size=SP) through the
trainer's own evenrl.train.parallelize.parallelize, and runs one forward (evenrl.models.forward.response_logprobs, the
output layer's log-probs chunk by chunk) and backward of the sample:
  peak   the largest rank's peak bytes of live CPU tensors during that forward and backward, model weights included
         (torch's profiler, profile_memory=True; benchmarks/memory.py's phase_peaks: what the CPU allocator hands
         out, not the process)
  step s the largest rank's wall time of a second forward and backward, without the profiler
Planned: evenrl.planner.memory.estimate_memory for the same config on SP CPU ranks: its update phase without the
optimizer's moments (no optimizer step runs here) and its fixed 0.3 GiB per-process overhead; and a step time from
FLOPs at the planner's assumed CPU rate (evenrl.planner.timing.assumed_rates, shared cores scaled): projections
and the output layer 2 N t x 3 (forward, backward) plus the output layer's recomputed logits 2 V h t, attention's
causal s^2 work 2 s^2 q_dim L / SP x 3, the all-to-all's 4 t h c x 3 bytes per layer at the assumed CPU link
rate; t = ceil(length / SP) tokens per rank.
Sequence parallelism's measured arms need its runtime (evenrl.distributed.sequence); where this checkout does not
have it they print "runtime not landed" and only the planned numbers.

Padding: 256 samples of lognormal lengths (median 2,048, sigma 1, clipped to 64..16,384 tokens; seed 0) scheduled
by evenrl.core.schedule.make_schedule over 8 ranks at a token cap of 16,384 per rank: padded micro-batches hold
rows x their longest row, packed ones (rows back to back, sequence parallelism's forward) the sum of their rows,
padded at the end to a multiple of SP. Share = padding tokens / tokens processed.
Targets (read by eye; nothing asserts): planned peak within +-25 % of measured; SP=4's peak per rank well under
SP=1's at 16 K; packed padding under 1 %.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/memory.py's profiler reading

MODEL = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32768, "tie_word_embeddings": True,
         "max_position_embeddings": 16448, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
PROMPT = 64
MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]


def run_config(length: int, sp: int):
    from evenrl.config import RunConfig

    return RunConfig.model_validate({
        "data": {"prompts_per_step": 1, "max_prompt_tokens": PROMPT},
        "rollout": {"samples_per_prompt": 1, "max_new_tokens": length - PROMPT},
        "parallel": {"sequence_parallel_size": sp}, "train": {"token_cap_per_micro_batch": -(-length // sp)}})


def sequence_runtime() -> bool:
    """Whether this checkout has sequence parallelism's runtime (the trainer's split forward)."""
    return importlib.util.find_spec("evenrl.distributed.sequence") is not None


# ------------------------------------------------------------------------------------------ planned

def planned(length: int, sp: int) -> dict:
    from evenrl.planner.dims import dims_from_config
    from evenrl.planner.layout import make_layout
    from evenrl.planner.memory import GIB, OVERHEAD_GIB, estimate_memory
    from evenrl.planner.timing import assumed_rates

    cfg, lay, d = run_config(length, sp), make_layout(1, sp, device="cpu"), dims_from_config(MODEL)
    est = estimate_memory(cfg, lay, d)
    assert est.micro_tokens == -(-length // sp), "the planned micro-batch must be the measured one"
    peak = (est.phases["update"] - est.breakdown["optimizer"] - OVERHEAD_GIB["cpu"]) * GIB
    t, c = est.micro_tokens, 4
    flops = 3 * 2 * d.linear_params * t + 2 * d.vocab * d.hidden * t
    flops += 3 * 2 * length ** 2 * d.heads * d.head_dim * d.layers / sp
    a2a = 3 * 4 * t * d.hidden * c * d.layers if sp > 1 else 0
    rates = assumed_rates(lay, "float32")
    return {"peak": peak, "seconds": flops / (rates.tflops * 1e12) + a2a / (rates.link_gbps * 1e9),
            "tokens": t, "rate": rates.tflops}


# ------------------------------------------------------------------------------------------ one rank

def worker(length: int, out_dir: str) -> None:
    """One rank of an arm (under torch.distributed.run): the sample's forward and backward, profiled, then timed."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AutoModelForCausalLM, Qwen2Config

    from evenrl.core.batch import Batch, Ragged
    from evenrl.distributed import mesh
    from evenrl.models.forward import response_logprobs
    from evenrl.core.model_plan import plan_of
    from evenrl.train.parallelize import parallelize
    from memory import phase_peaks

    torch.set_num_threads(1)  # the arm's ranks share the cores
    sp = int(os.environ.get("WORLD_SIZE", "1"))  # the arm is one SP group (one process: no process group)
    info = mesh.init("gloo", sequence_parallel=sp)

    def barrier():
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    cfg = run_config(length, sp)
    ids = torch.randint(0, MODEL["vocab_size"], (length,), generator=torch.Generator().manual_seed(0))
    batch = Batch({"tokens": Ragged.of([ids], torch.long), "response_len": torch.tensor([length - PROMPT])})
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        conf = Qwen2Config(**{k: v for k, v in MODEL.items() if k != "model_type"})
        model = AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa", dtype=torch.float32)
        parallelize(model, info, cfg)  # the trainer's: applies the mesh's sequence parallelism
        split = plan_of(model).sequence
        if sp > 1 and (split is None or split.size != sp):
            raise SystemExit(f"parallelize did not split the sequence over {sp} ranks (runtime: {split})")
        model.train()

        def step():
            out, _, _ = response_logprobs(model, batch, 0)
            (-out[..., 0].sum() / (length - PROMPT)).backward()

        barrier()
        with record_function("update"):
            step()
        barrier()
    peak = phase_peaks(prof, ["update"])["update"]
    model.zero_grad(set_to_none=True)
    barrier()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    Path(out_dir, f"{mesh.rank()}.json").write_text(json.dumps({"peak": peak, "seconds": seconds}))
    mesh.shutdown()


def measure(length: int, sp: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        ranks = run_arm(__file__, sp, [str(length)], d, f"length={length} sp={sp}")
    return {k: max(r[k] for r in ranks) for k in ("peak", "seconds")}


def run_arm(script: str, nproc: int, args: list[str], out_dir: str, label: str) -> list[dict]:
    """`script --worker *args out_dir` on `nproc` gloo processes (torch.distributed.run, one thread each); each rank's
    JSON record from out_dir/RANK.json. A failing arm ends the benchmark with its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
           "--worker", *args, out_dir]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"arm {label} failed:\n{done.stderr[-3000:]}")
    return [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(nproc)]


# ------------------------------------------------------------------------------------------ padding

def padding_rows(seed: int = 0, n: int = 256) -> list[int]:
    import random

    rng = random.Random(seed)
    return [min(16384, max(64, round(rng.lognormvariate(math.log(2048), 1.0)))) for _ in range(n)]


def padding(sps: list[int], ranks: int = 8, cap: int = 16384) -> list[tuple]:
    """(sp, micro-steps, real tokens, padded tokens, packed tokens, how packed was counted) per SP."""
    from evenrl.core.schedule import make_schedule

    lengths = padding_rows()
    can_pack = "packed" in inspect.signature(make_schedule).parameters
    rows = []
    for sp in sps:
        if ranks % sp:
            continue
        args = dict(world=ranks // sp, token_cap=sp * cap)
        padded = make_schedule(lengths, **args)
        micro = [m.rows for mb in padded.minibatches for per in mb.per_rank for m in per if m.rows]
        pad_tokens = sum(len(r) * max(lengths[i] for i in r) for r in micro)
        if can_pack:  # the schedule the trainer makes for packed rows (cuts by the sum of lengths)
            packed = make_schedule(lengths, packed=True, **args)
            micro = [m.rows for mb in packed.minibatches for per in mb.per_rank for m in per if m.rows]
        pack_tokens = sum(-(-sum(lengths[i] for i in r) // sp) * sp for r in micro)
        rows.append((sp, sum(padded.micro_steps()), sum(lengths), pad_tokens, pack_tokens,
                     "make_schedule(packed=True)" if can_pack else "the padded schedule's micro-batches, packed"))
    return rows


# ------------------------------------------------------------------------------------------ driver

def numbers(text: str, ap: argparse.ArgumentParser, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: got {text!r}; need numbers like 1,2,4")
    if not values or min(values) < 1:
        ap.error(f"{flag}: got {text!r}; need positive numbers like 1,2,4")
    return values


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,16384", help="sample lengths in tokens (default 8192,16384)")
    ap.add_argument("--sp", default="1,2,4", help="sequence_parallel_size values (default 1,2,4; each divides the "
                                                  f"model's {MODEL['num_attention_heads']} query heads)")
    ap.add_argument("--padding-only", action="store_true", help="only the padding table (no model runs)")
    ns = ap.parse_args(argv)
    lengths, sps = numbers(ns.lengths, ap, "--lengths"), numbers(ns.sp, ap, "--sp")
    if any(MODEL["num_attention_heads"] % s for s in sps):
        ap.error(f"--sp: got {ns.sp!r}; each must divide the model's {MODEL['num_attention_heads']} query heads")
    if max(lengths) + 1 > MODEL["max_position_embeddings"] or min(lengths) <= PROMPT:
        ap.error(f"--lengths: got {ns.lengths!r}; each in {PROMPT + 1}..{MODEL['max_position_embeddings'] - 1}")
    runtime = sequence_runtime()
    t_all = time.perf_counter()
    if not ns.padding_only:
        from evenrl.planner.dims import dims_from_config

        print(f"model: Qwen2-shaped, {dims_from_config(MODEL).params / 1e6:.1f} M parameters (tied), hidden "
              f"{MODEL['hidden_size']}, vocabulary {MODEL['vocab_size']:,}; float32, replicated; gloo on "
              f"{os.cpu_count()} CPU cores; one sample per arm ({PROMPT} prompt tokens)")
        print("peak MiB and step s: the largest rank; planned peak = the update phase without AdamW's moments and "
              "the 0.3 GiB per-process overhead; diff = (plan - measured) / measured")
        head = (f"{'tokens':>6} {'SP':>2} {'per rank':>8} | {'peak':>8} {'plan':>8} {'diff':>5} | {'step s':>7} "
                f"{'plan':>7} {'diff':>5}")
        print(head)
        print("-" * len(head))
        for length in lengths:
            for sp in sps:
                plan = planned(length, sp)
                if sp > 1 and not runtime:
                    got = None
                else:
                    got = measure(length, sp)
                peak = (f"{got['peak'] / MIB:8.1f} {plan['peak'] / MIB:8.1f} {pct(got['peak'], plan['peak']):>5}"
                        if got else f"{'-':>8} {plan['peak'] / MIB:8.1f} {'':>5}")
                time_ = (f"{got['seconds']:7.2f} {plan['seconds']:7.2f} {pct(got['seconds'], plan['seconds']):>5}"
                         if got else f"{'-':>7} {plan['seconds']:7.2f}   runtime not landed")
                print(f"{length:>6} {sp:>2} {plan['tokens']:>8,} | {peak} | {time_}", flush=True)
    print("\npadding of 256 lognormal samples (median 2,048, clipped 64..16,384) on 8 ranks, token cap 16,384 "
          "per rank:")
    head = f"{'SP':>2} {'groups':>6} {'micro':>5} {'real tokens':>11} | {'padded':>9} {'share':>6} | " \
           f"{'packed':>9} {'share':>6}"
    print(head)
    print("-" * len(head))
    how = ""
    for sp, micro, real, pad, pack, how in padding(sps):
        print(f"{sp:>2} {8 // sp:>6} {micro:>5} {real:>11,} | {pad:>9,} {1 - real / pad:6.1%} | {pack:>9,} "
              f"{1 - real / pack:6.1%}")
    print(f"packed: {how}. Whole run {time.perf_counter() - t_all:.0f} s.")
    return 0


def pct(measured: float, plan: float) -> str:
    return f"{100 * (plan - measured) / measured:+.0f}%"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
