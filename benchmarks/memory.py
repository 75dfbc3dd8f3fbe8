"""Per-rank memory of a training step, measured, beside `evenrl plan`'s estimate for the same config and layout.

Run: .venv/bin/python benchmarks/memory.py [--worlds 1,2,3] [--bf16-worlds 1] [--lora 16] [--quick]
(float32 on 1-3 processes, full fine-tuning only (--lora 0): 5 min 21 s wall, 2 min 15 s of CPU, on the shared
2-core project machine; the LoRA rows, on by default, about as much again; --bf16-worlds 1 adds ~2 min of CPU)

A Qwen2-shaped model with random weights (MODEL below: ~31 M parameters, tied embeddings) on 1, 2 and 3 CPU
processes (gloo), replicated and FSDP2-sharded (evenrl.distributed.sharding.shard, no offload: offload needs an
accelerator), with fused AdamW, in float32 and in bfloat16 mixed precision (fp32 state, bf16 compute: autocast
when replicated, FSDP2's policy when sharded; bf16 matmuls are ~10x slower than fp32 on this CPU, so bf16 runs
only when --bf16-worlds asks). After a first step creates AdamW's state, each rank runs one step in
the trainer's order and the profiler marks its phases. Every configuration runs twice: training every weight
("full"), and as a LoRA policy ("lora16": model.lora.rank=16 through evenrl.models.lora, the frozen base in the
compute dtype, fp32 adapters the only trainable parameters, AdamW over them alone). "step s" is the update phase's
wall time, the two modes side by side:
  rollout    the weights gathered for generation (evenrl.distributed.weights.gathered); no tokens are generated,
             so the planner's KV cache and autocast copies are left out of this comparison
  log-probs  a no-grad forward of the micro-batch through evenrl.models.forward.response_logprobs (the output layer
             computes log-probs chunk by chunk, core.fused_head), as the trainer does
  update     two micro-batches of forward, log-probs and backward (the second runs with the first's gradients
             held, as on any rank with more than one micro-batch), the gradient all-reduce (replicated, more than
             one rank), the optimizer step

Measured, per rank (the table shows the largest rank):
  state   bytes of the local tensor storage of parameters + gradients + AdamW state after the optimizer step
          (a DTensor counts its local shard: .to_local()).
  phase   peak bytes of live CPU tensors during the phase: the running sum of every allocation and free that
          torch's profiler records (profile_memory=True) from before the model is built, its maximum inside the
          phase. It counts what torch's CPU allocator hands out, not the process: no Python, libtorch or gloo
          buffers, no allocator slack, and only allocations made on the rank's threads the profiler follows.
  rss     ru_maxrss growth from before the model is built to the end (Linux: KiB). The process-level view: it
          includes allocator slack and libraries, and is a high-water mark over everything the rank did, so it
          bounds the phases from above rather than measuring one.
Planned: evenrl.planner.memory.estimate_memory for the same RunConfig and a CPU layout of W ranks, without its
fixed per-process overhead (0.3 GiB on CPU), which no tensor statistic includes.
Targets (read by eye; nothing asserts): sharded state per rank within 10 % of 1/W of replicated; each planned
phase within +-20 % of the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

# The model: Qwen2-shaped, a few tens of millions of parameters, so one step takes seconds on a CPU core.
MODEL = {"model_type": "qwen2", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 16384, "tie_word_embeddings": True,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
ROWS, LENGTH = 4, 64  # one micro-batch per rank: 4 samples of 32 prompt + 32 new tokens
MIB = 2**20


def run_config(dtype: str, sharding: str, lora: int = 0):
    """The evenrl config whose worst-case micro-batch is the benchmark's: ROWS rows of LENGTH tokens on any W <= 3."""
    from evenrl.config import RunConfig

    return RunConfig.model_validate({
        "model": {"dtype": dtype, "lora": {"rank": lora}}, "parallel": {"sharding": sharding},
        "data": {"prompts_per_step": 6, "max_prompt_tokens": LENGTH // 2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": LENGTH // 2},
        "train": {"token_cap_per_micro_batch": ROWS * LENGTH}})


def planned(dtype: str, sharding: str, world: int, lora: int = 0) -> dict:
    from evenrl.planner.layout import make_layout
    from evenrl.planner.dims import dims_from_config
    from evenrl.planner.memory import GIB, OVERHEAD_GIB, estimate_memory, worst_case_shape

    cfg, lay = run_config(dtype, sharding, lora), make_layout(1, world, device="cpu")
    assert worst_case_shape(cfg, lay)[0] == ROWS * LENGTH, "the planned micro-batch must be the measured one"
    est = estimate_memory(cfg, lay, dims_from_config(MODEL))
    b, over = est.breakdown, OVERHEAD_GIB["cpu"]
    return {"state": (b["parameters"] + b["gradients"] + b["optimizer"]) * GIB,
            "update": (est.phases["update"] - over) * GIB, "log-probs": (est.phases["log-probs"] - over) * GIB,
            # no tokens generated: the rollout's weights only (no KV cache, no autocast copies: no forward runs)
            "gather": (est.phases["rollout"] - over - b["KV cache"] - b["autocast copies"]) * GIB,
            "params": est.params}


# ------------------------------------------------------------------------------------------ one rank

def storage_bytes(tensors) -> int:
    """Bytes of each distinct local storage (a DTensor's local shard; views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def resident_bytes(model, optimizer) -> int:
    state = [v for st in optimizer.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
    return storage_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(), *state])


def phase_peaks(prof, phases: list[str]) -> dict[str, int]:
    """Peak bytes of live CPU tensors within each phase: the running sum of every allocation and free the
    profiler recorded since it started (before the model was built), its maximum inside the phase's window.
    "drift": what the sum grew by from the start of the first phase to the end of the last, which in the steady
    state hold the same tensors: frees the profiler did not see (made on gloo's threads), so each peak may be
    that much too high."""
    events = prof.profiler.kineto_results.events()
    windows = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in phases}
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    curve, live = [], 0
    for t, nbytes in memory:
        live += nbytes
        curve.append((t, live))

    def live_at(t: int) -> int:
        before = [v for when, v in curve if when <= t]
        return before[-1] if before else 0

    peaks = {name: max([live_at(start)] + [v for t, v in curve if start <= t <= end])
             for name, (start, end) in windows.items()}
    peaks["drift"] = live_at(windows[phases[-1]][1]) - live_at(windows[phases[0]][0])
    return peaks


def rank_main(rank: int, world: int, port: int, dtype: str, sharding: str, lora: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as tdist
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AutoModelForCausalLM, Qwen2Config

    from evenrl.core.batch import Batch, Ragged
    from evenrl.models.forward import response_logprobs
    from evenrl.distributed import collectives
    from evenrl.distributed.sharding import shard
    from evenrl.distributed.weights import gathered
    from evenrl.models.lora import add_adapters

    torch.set_num_threads(1)  # ranks share the cores; one thread each keeps them from fighting
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    compute = torch.float32 if dtype == "float32" else torch.bfloat16
    replicated_autocast = sharding == "replicated" and compute != torch.float32
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (ROWS, LENGTH), generator=gen)
    batch = Batch({"tokens": Ragged.of(list(tokens), torch.long), "response_len": torch.full((ROWS,), LENGTH - 1)})
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        conf = Qwen2Config(**{k: v for k, v in MODEL.items() if k != "model_type"})
        # as the trainer holds them: fp32 master weights, or with LoRA a frozen base in the compute dtype
        model = AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa",
                                                 dtype=compute if lora else torch.float32)
        if lora:
            add_adapters(model, run_config(dtype, sharding, lora).model.lora)
        if sharding == "fsdp":
            shard(model, compute_dtype=compute, offload=False)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)

        def forward():
            with torch.autocast("cpu", dtype=compute, enabled=replicated_autocast):
                out, _, _ = response_logprobs(model, batch, 0)
            return out[..., 0]

        def step(micro_batches: int):
            for _ in range(micro_batches):  # gradients accumulate: from the second on, they are there throughout
                loss = -forward().mean()
                loss.backward()
            if sharding == "replicated":
                collectives.all_reduce_grads([p for p in model.parameters() if p.requires_grad])
            optimizer.step()
            state = resident_bytes(model, optimizer)  # parameters + gradients + AdamW state, before grads go
            optimizer.zero_grad(set_to_none=True)
            return state

        step(1)  # creates AdamW's state: the steady state every later step starts from
        # then one step in the trainer's order: rollout (the weights gathered), log-probs, update
        tdist.barrier()
        with record_function("gather"), gathered(model):
            pass
        tdist.barrier()
        with record_function("log-probs"), torch.no_grad():
            forward()
        tdist.barrier()
        t0 = time.perf_counter()
        with record_function("update"):
            state = step(2)
        seconds = time.perf_counter() - t0
        tdist.barrier()
    peaks = phase_peaks(prof, ["gather", "log-probs", "update"])
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    result = {"rank": rank, "state": state, **peaks, "rss": rss, "seconds": seconds}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    tdist.destroy_process_group()


# ------------------------------------------------------------------------------------------ driver

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, dtype: str, sharding: str, lora: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(world, free_port(), dtype, sharding, lora, d), nprocs=world, join=True)
        return [json.loads(Path(d, f"{r}.json").read_text()) for r in range(world)]


def pct(measured: float, plan: float) -> str:
    return f"{100 * (plan - measured) / measured:+.0f}%"


def counts(ap: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        worlds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: got {text!r}; need process counts like 1,2,3")
    if any(not 1 <= w <= 3 for w in worlds):  # the planned micro-batch is the measured one only up to 3 ranks
        ap.error(f"{flag}: got {text!r}; each count must be 1, 2 or 3")
    return worlds


PHASE_COLUMNS = (("rollout", "gather"), ("log-probs", "log-probs"), ("update", "update"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1,2,3", help="float32 process counts (default 1,2,3)")
    ap.add_argument("--bf16-worlds", default="", help="bfloat16 process counts, e.g. 1 (default: none; slow)")
    ap.add_argument("--lora", type=int, default=16, help="LoRA rank of the rows beside full fine-tuning (default "
                                                            "16; 0: full fine-tuning only)")
    ap.add_argument("--quick", action="store_true", help="float32 on 1 and 2 processes only")
    ns = ap.parse_args(argv)
    runs = {"float32": [1, 2] if ns.quick else counts(ap, "--worlds", ns.worlds),
            "bfloat16": [] if ns.quick else counts(ap, "--bf16-worlds", ns.bf16_worlds)}
    modes = [0, ns.lora] if ns.lora > 0 else [0]
    params = planned("float32", "replicated", 1)["params"]
    print(f"model: Qwen2-shaped, {params / 1e6:.1f} M parameters (tied), random weights; micro-batch {ROWS} x "
          f"{LENGTH} tokens; fused AdamW; gloo on {os.cpu_count()} CPU cores")
    print("MiB per rank (the largest rank); plan = evenrl's estimate less its fixed 0.3 GiB per-process overhead; "
          "diff = (plan - measured) / measured")
    head = (f"{'dtype':<8} {'trains':<7} {'sharding':<10} {'W':>1} | {'state':>6} {'plan':>6} {'xW/rep':>6} | "
            + " | ".join(f"{name:>9} {'plan':>6} {'diff':>5}" for name, _ in PHASE_COLUMNS)
            + f" | {'drift':>5} {'rss':>5} {'step s':>6}")
    print(head)
    print("-" * len(head))
    t_all = time.perf_counter()
    for dtype, worlds in runs.items():
        for lora in modes:
            replicated_state = {}
            trains = f"lora{lora}" if lora else "full"
            for sharding in ("replicated", "fsdp"):
                for w in worlds:
                    ranks = measure(w, dtype, sharding, lora)
                    top = {k: max(r[k] for r in ranks) for k in ranks[0] if k != "rank"}
                    plan = planned(dtype, sharding, w, lora)
                    if sharding == "replicated":
                        replicated_state[w] = top["state"]
                    ref = replicated_state.get(w) if sharding == "fsdp" else None
                    ratio = f"{top['state'] * w / ref:.3f}" if ref else "-"
                    phases = " | ".join(f"{top[key] / MIB:9.1f} {plan[key] / MIB:6.1f} {pct(top[key], plan[key]):>5}"
                                        for _, key in PHASE_COLUMNS)
                    print(f"{dtype:<8} {trains:<7} {sharding:<10} {w:>1} | {top['state'] / MIB:6.1f} "
                          f"{plan['state'] / MIB:6.1f} {ratio:>6} | {phases} | {top['drift'] / MIB:5.1f} "
                          f"{top['rss'] / MIB:5.0f} {top['seconds']:6.2f}", flush=True)
    print(f"xW/rep: sharded state per rank x W / replicated state per rank (1.000: exactly 1/W). drift: frees the "
          f"profiler missed (each phase may read that much high). Whole run {time.perf_counter() - t_all:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
