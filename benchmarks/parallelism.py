"""Tensor parallelism on CPU, side by side in one run: memory per rank measured beside planned at TP = 1, 2, 4, step
time, the time a step spends in the mesh's collectives, and the numerically stable plan (evenrl's) against the
row-wise plan (Megatron's), each against one process.

Run: .venv/bin/python benchmarks/parallelism.py [--tp 1,2,4] [--rows 2] [--length 256]

The model: Qwen2-shaped, narrow with a wide vocabulary (MODEL: hidden 128, 4 layers, 8 query and 4 KV heads, MLP
512, a 32,768-token vocabulary, untied: 8.4 M of its 9.5 M parameters are the embeddings and the output layer;
random weights), float32, replicated; gloo on this machine's cores.
The step: `rows` samples of `length` tokens (64 prompt tokens), one micro-batch on every rank of the TP group (TP
splits no tokens), through the trainer's own parts: the packed forward a split model trains with
(evenrl.distributed.sequence.sequence_parallel at size 1, at TP = 1 too, so the arms differ by the split alone),
the log-probs from the output layer chunk by chunk (evenrl.models.forward.response_logprobs; with TP each rank's
vocabulary slice: VocabParallelHead), a backward of the mean response log-prob, and the trainer's AdamW
(evenrl.train.trainer.adamw: per-tensor with TP).

One arm per (plan, TP): `python -m torch.distributed.run --nproc-per-node TP` runs this file's worker on TP gloo
processes, which build the mesh (evenrl.distributed.collectives.init(tensor_parallel=TP)) and split the model:
  stable    evenrl.distributed.tensor_parallel.tensor_parallel, the product's plan: q/k/v/gate/up column-wise,
            o_proj/down_proj column-wise on all-gathered inputs with their outputs all-gathered
  rowwise   built here, not a product option: the same, but o_proj/down_proj torch's RowwiseParallel (split by
            input, partial outputs all-reduced), as Megatron and DeepSpeed AutoTP do
Measured per arm, the largest rank's:
  peak      bytes of live CPU tensors during one whole update step after a first one (AdamW's moments exist):
            weights, moments, gradients, activations, logits' chunks, collective buffers (torch's profiler,
            profile_memory=True; benchmarks/memory.py's phase_peaks: what the CPU allocator hands out)
  step s    wall time of one update step, the median of 5 after the profiled ones
  coll. s   the wall time that step spends inside collectives: the union of the profiler's spans of the c10d and
            functional-collective ops (DTensor's all-gathers and reduce-scatters, launched and waited on) and of
            the synchronous torch.distributed calls (the vocabulary's per-token all-reduces, the gradients'), waits
            included; calls: how many collectives were launched. The mesh's cost per step on gloo (a memory copy on
            one machine; NCCL over NVLink or InfiniBand is another cost, which no machine of this project has
            measured)
  drift     what the live-tensor sum grew by over the profiled step: frees the profiler did not see (gloo's
            threads), so the peak may read that much high
  dlogp     max |log-prob - one process's| over the response tokens, from the first step (same weights)
  dgrad     max over tensors of max |grad - one process's| / max |one process's grad| (whole tensors gathered)
Planned (stable only): evenrl.planner.memory.estimate_memory for the same config on TP CPU ranks: the update phase
less its fixed 0.3 GiB per-process overhead (and, at TP = 1, less nothing else: the reference model, gradient
buckets and autocast copies are 0 here). Bytes per block: one forward's all-gathered (stable) or all-reduced
(row-wise) bytes per rank per decoder block, by the ring algorithms' arithmetic ((TP - 1) / TP of the gathered
tensor; 2 (TP - 1) / TP of the reduced one); the backward moves as many again.
Targets (read by eye; nothing asserts): planned peak within +-25 % of measured; the stable plan's dlogp 0 (its
forward sums no partial products across ranks) and the row-wise plan's above it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/memory.py's profiler reading

from long_context import numbers, pct, run_arm  # noqa: E402  (its arguments, differences and launcher)

MODEL = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32768, "tie_word_embeddings": False,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
PROMPT = 64
MIB = 2**20
SYNC = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")  # c10d calls
WRAP = "sync collective"  # the profiler's name for a synchronous c10d call, wait included (timed_collectives)


def run_config(tp: int, rows: int, length: int):
    from evenrl.config import RunConfig

    return RunConfig.model_validate({
        "data": {"prompts_per_step": rows, "max_prompt_tokens": PROMPT},
        "rollout": {"samples_per_prompt": 1, "max_new_tokens": length - PROMPT},
        "algo": {"advantage": "reinforce_pp", "kl_coef": 0.0},
        "parallel": {"tensor_parallel_size": tp}, "train": {"token_cap_per_micro_batch": rows * length}})


def planned(tp: int, rows: int, length: int) -> dict:
    from evenrl.planner.dims import dims_from_config
    from evenrl.planner.layout import make_layout
    from evenrl.planner.memory import GIB, OVERHEAD_GIB, estimate_memory

    est = estimate_memory(run_config(tp, rows, length), make_layout(1, tp, device="cpu"), dims_from_config(MODEL))
    assert est.micro_tokens == rows * length, "the planned micro-batch must be the measured one"
    return {"peak": (est.phases["update"] - OVERHEAD_GIB["cpu"]) * GIB}


def block_bytes(tp: int, tokens: int, plan: str) -> float:
    """One forward's bytes received per rank per decoder block (module docstring), float32."""
    if tp == 1:
        return 0.0
    h, q, i = MODEL["hidden_size"], MODEL["hidden_size"], MODEL["intermediate_size"]
    if plan == "stable":  # gathered: o_proj's input and output, down_proj's input and output
        return (tp - 1) / tp * tokens * (q + h + i + h) * 4
    return 2 * 2 * (tp - 1) / tp * tokens * h * 4  # two all-reduces of [tokens, hidden]


# ------------------------------------------------------------------------------------------ one rank

def rowwise(model, tp_mesh) -> None:
    """The row-wise plan (a benchmark's variant, not a product option): evenrl's split with o_proj and down_proj
    split by input rows, their partial outputs all-reduced (torch's RowwiseParallel)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from evenrl.core.model_plan import record
    from evenrl.distributed.tensor_parallel import VocabParallelHead, _shard_rows

    inner = model.model
    for layer in inner.layers:
        for block, names, out in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "o_proj"),
                                  (layer.mlp, ("gate_proj", "up_proj"), "down_proj")):
            for name in names:
                parallelize_module(getattr(block, name), tp_mesh, ColwiseParallel())
            parallelize_module(getattr(block, out), tp_mesh, RowwiseParallel())
    parallelize_module(inner.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    head = model.get_output_embeddings()
    model.set_output_embeddings(VocabParallelHead(_shard_rows(head.weight, tp_mesh), None, tp_mesh))
    record(model).tensor_parallel = tp_mesh


def worker(plan: str, rows: int, length: int, out_dir: str) -> None:
    """One rank of an arm (under torch.distributed.run)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AutoModelForCausalLM, Qwen2Config

    from evenrl.core.batch import Batch, Ragged
    from evenrl.distributed import collectives as dist
    from evenrl.distributed.sequence import sequence_parallel
    from evenrl.distributed.tensor_parallel import tensor_parallel
    from evenrl.models.forward import response_logprobs
    from evenrl.train.trainer import adamw
    from memory import phase_peaks

    torch.set_num_threads(1)  # the arm's ranks share the cores
    timed_collectives(record_function)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    info = dist.init("gloo", tensor_parallel=tp)
    cfg = run_config(tp, rows, length)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, MODEL["vocab_size"], (length,), generator=g) for _ in range(rows)]
    batch = Batch({"tokens": Ragged.of(tokens, torch.long), "response_len": torch.tensor([length - PROMPT] * rows)})

    def barrier():
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def step(record: dict | None = None):
        out, _, mask = response_logprobs(model, batch, 0)
        (-(out[..., 0] * mask).sum() / mask.sum()).backward()
        if record is not None:  # the first step's log-probs and whole gradients, before any update
            record["logp"] = out[..., 0][mask].detach().clone()
            record["grads"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                               for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    first: dict = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        conf = Qwen2Config(**{k: v for k, v in MODEL.items() if k != "model_type"})
        model = AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa", dtype=torch.float32)
        if tp > 1:
            (tensor_parallel if plan == "stable" else rowwise)(model, dist.device_mesh(info.device)["tp"])
        sequence_parallel(model, dist.sequence_group())  # the packed forward a split model trains with
        model.train()
        optimizer, _ = adamw(model, cfg, 1e-4, 0)
        barrier()
        step(first)  # AdamW's moments come into being here
        if dist.rank() == 0:  # written now: the whole gradients it holds are no part of a step's memory
            torch.save(first, Path(out_dir, "first.pt"))
        first.clear()
        barrier()
        with record_function("update"):
            step()
        barrier()
    peaks = phase_peaks(prof, ["update"])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        barrier()
        step()
    coll_s, calls = collective_time(prof)
    seconds = []
    for _ in range(5):
        barrier()
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    Path(out_dir, f"{dist.rank()}.json").write_text(json.dumps(
        {"peak": peaks["update"], "drift": peaks["drift"], "seconds": statistics.median(seconds), "coll_s": coll_s,
         "calls": calls}))
    dist.shutdown()


def timed_collectives(record_function) -> None:
    """Wrap torch.distributed's synchronous collectives (looked up by evenrl's code at call time) in a profiler
    range, so their waits, which happen outside any op, count in collective_time."""
    import torch.distributed as tdist

    def wrapped(fn):
        def call(*args, **kwargs):
            with record_function(WRAP):
                return fn(*args, **kwargs)
        return call

    for name in SYNC:
        setattr(tdist, name, wrapped(getattr(tdist, name)))


def collective_time(prof) -> tuple[float, int]:
    """(seconds inside collectives, collectives launched) of a profiled step: the union of the spans of the c10d
    and functional-collective ops and of the wrapped synchronous calls (nested and overlapping spans counted once)."""
    events = prof.profiler.kineto_results.events()
    ops = [e for e in events if e.name().startswith(("c10d::", "_c10d_functional::"))]
    spans = sorted((e.start_ns(), e.end_ns()) for e in ops + [e for e in events if e.name() == WRAP])
    total, end = 0, -1
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e9, sum(1 for e in ops if "wait" not in e.name())


def measure(plan: str, tp: int, rows: int, length: int) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as d:
        ranks = run_arm(__file__, tp, [plan, str(rows), str(length)], d, f"{plan} tp={tp}")
        first = torch.load(Path(d, "first.pt"))
    return {"peak": max(r["peak"] for r in ranks), "drift": max(r["drift"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks),
            "coll_s": max(r["coll_s"] for r in ranks), "calls": ranks[0]["calls"], "first": first}


def differences(arm: dict, base: dict) -> tuple[float, float]:
    """(max |dlogp|, max relative gradient difference) of an arm against one process (module docstring)."""
    a, b = arm["first"], base["first"]
    dlogp = float((a["logp"] - b["logp"]).abs().max())
    assert a["grads"].keys() == b["grads"].keys(), "the arms must train the same parameters"
    dgrad = max(float((a["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
                for n, g in b["grads"].items())
    return dlogp, dgrad


# ------------------------------------------------------------------------------------------ driver

def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(argv[1], int(argv[2]), int(argv[3]), argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2,4", help="tensor_parallel_size values (default 1,2,4; each divides the "
                                                  "model's 4 KV heads)")
    ap.add_argument("--rows", type=int, default=2, help="samples in the step's micro-batch (default 2)")
    ap.add_argument("--length", type=int, default=256, help=f"tokens per sample, {PROMPT} of them prompt "
                                                             "(default 256)")
    ns = ap.parse_args(argv)
    tps = numbers(ns.tp, ap, "--tp")
    if any(MODEL["num_key_value_heads"] % t for t in tps):
        ap.error(f"--tp: got {ns.tp!r}; each must divide the model's {MODEL['num_key_value_heads']} KV heads")
    if not 1 <= ns.rows <= 64 or not PROMPT < ns.length < MODEL["max_position_embeddings"]:
        ap.error(f"--rows {ns.rows} --length {ns.length}: need 1..64 rows of {PROMPT + 1}.."
                 f"{MODEL['max_position_embeddings'] - 1} tokens")
    from evenrl.planner.dims import dims_from_config

    t_all = time.perf_counter()
    tokens = ns.rows * ns.length
    print(f"model: Qwen2-shaped, {dims_from_config(MODEL).params / 1e6:.1f} M parameters (untied), hidden "
          f"{MODEL['hidden_size']}, MLP {MODEL['intermediate_size']}, vocabulary {MODEL['vocab_size']:,}; float32, "
          f"replicated; gloo on {os.cpu_count()} CPU cores; {ns.rows} x {ns.length} tokens per step")
    print("peak MiB, step s, coll. s: the largest rank; plan = the update phase less the 0.3 GiB per-process "
          "overhead; diff = (plan - measured) / measured; dlogp, dgrad against TP=1 (module docstring)")
    head = (f"{'plan':<8} {'TP':>2} | {'peak':>7} {'plan':>7} {'diff':>5} {'drift':>5} | {'step s':>6} "
            f"{'coll. s':>7} {'calls':>5} {'KiB/block':>9} | {'dlogp':>8} {'dgrad':>8}")
    print(head)
    print("-" * len(head))
    base = None
    for tp in tps:
        for plan in (("stable",) if tp == 1 else ("stable", "rowwise")):
            got = measure(plan, tp, ns.rows, ns.length)
            base = base if base is not None or tp != 1 else got
            want = planned(tp, ns.rows, ns.length)["peak"] if plan == "stable" else None
            dl, dg = differences(got, base) if base is not None else (float("nan"), float("nan"))
            shown = f"{want / MIB:7.1f} {pct(got['peak'], want):>5}" if want else f"{'-':>7} {'':>5}"
            print(f"{plan:<8} {tp:>2} | {got['peak'] / MIB:7.1f} {shown} {got['drift'] / MIB:5.1f} | "
                  f"{got['seconds']:6.3f} "
                  f"{got['coll_s']:7.3f} {got['calls']:>5} {block_bytes(tp, tokens, plan) / 1024:9.0f} | "
                  f"{dl:8.1e} {dg:8.1e}", flush=True)
    print(f"Whole run {time.perf_counter() - t_all:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
