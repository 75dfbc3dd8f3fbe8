"""Mixtures of experts on CPU: the experts' throughput by transformers' experts backend, and the engine-trainer
mismatch a bf16 engine leaves, with and without router replay. Numbers side by side; nothing asserts.

Run: .venv/bin/python benchmarks/moe.py [--tokens 2048] [--repeats 5] [--prompts 32] [--only experts,mismatch,ep]
     [--lora 16]
(~1 min on the shared 2-core project machine, 1 thread, without the EP rows; those take 3-6 min more: 4 x 4 processes)

experts   One Qwen3-MoE-shaped experts layer (hidden 256, 16 experts of width 128, top 4, fp32), the same routed
          tokens through transformers' `grouped_mm` (torch.nn.functional.grouped_mm: one grouped GEMM per
          projection, the default when a model is built or loaded) and `eager` (a Python loop over the experts hit),
          forward alone and forward + backward: tokens/s, median of --repeats. `batched_mm` is left out: 5-20x slower
          than the loop on CPU (../shared FIELD_NOTES).
mismatch  A tiny model of each family with random weights, sampled by the hf engine on a bf16 copy of its weights
          (bf16 autocast: what a bf16 engine or rollout rank holds) for --prompts prompts x 4 samples x 16 tokens, the
          engine recording each token's routes; the fp32 trainer then routes the same tokens itself (no replay) and
          replays the engine's routes (rollout.router_replay=engine): the share of routed tokens whose top-k set
          differs (per layer, in any layer) and |engine - trainer| log-prob over the sampled tokens, mean and max,
          without and with replay (what evenrl.train.moe.probe and rollout/logprob_mismatch report per step), and
          what replay costs: the trainer's scoring of the same rows (compute_logprobs: its forward, the fastest of
          3) routing itself and replaying the engine's routes.
EP        expert parallelism (parallel.expert_parallel_size) at EP = 1, 2, 4, and EP 2 x TP 2 (tensor parallelism on the
          attention and output layer, the experts' tokens split over the tp group), on 4 gloo processes (1 thread each):
          a Qwen3-MoE-shaped model whose experts are most of its weights (EP_MODEL: 16 experts x 256 wide in each
          of 4 layers, 6.3 M of 6.6 M parameters), replicated, fp32, AdamW per tensor (as the trainer steps an
          expert-parallel model). Each rank trains its own 4 rows of 64 tokens through the packed forward every MoE
          forward takes, then the gradient all-reduce (experts over edata only), the global-norm clip and the
          optimizer step, as evenrl.train.update does. Measured per rank (the largest): state (bytes of the local
          parameters, gradients and AdamW moments), one update's peak of live CPU tensors (torch's profiler, as
          benchmarks/memory.py measures it) and the step's wall time (median of --repeats more, unprofiled). Planned:
          evenrl.planner.memory.estimate_memory for the same config on 4 CPU ranks, less its fixed 0.3 GiB
          per-process overhead. With --lora R: LoRA rank R on the attention and on every expert (model.lora.experts:
          the experts' adapters split with them) over the frozen fp32 base, only the adapters in the optimizer.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def experts_rows(tokens: int, repeats: int) -> list[tuple[str, float, float]]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 256, generator=g)
    logits = torch.randn(tokens, 16, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(4, dim=-1)
    rows = []
    for impl in ("grouped_mm", "eager"):
        cfg._experts_implementation = impl
        torch.manual_seed(0)
        layer = Qwen3MoeExperts(cfg)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        timed = {}
        for name, backward in (("forward", False), ("forward+backward", True)):
            runs = []
            for _ in range(repeats + 1):  # the first is a warm-up
                h = x.clone().requires_grad_(backward)
                start = time.perf_counter()
                if backward:
                    layer(h, ids, weights).sum().backward()
                else:
                    with torch.no_grad():
                        layer(h, ids, weights)
                runs.append(time.perf_counter() - start)
            timed[name] = tokens / statistics.median(runs[1:])
        rows.append((impl, timed["forward"], timed["forward+backward"]))
    return rows


def mismatch_row(arch: str, prompts: int, root: str) -> dict:
    from evenrl.core.batch import Batch, Ragged
    from evenrl.distributed.sequence import SequenceGroup, sequence_parallel
    from evenrl.engines.base import Request, SamplingParams
    from evenrl.engines.hf import HFEngine
    from evenrl.models import routing
    from evenrl.models.loading import load_policy, set_autocast
    from evenrl.testing import make_tiny_model
    from evenrl.train import moe
    from evenrl.train.update import compute_logprobs

    trainer, tok = load_policy(make_tiny_model(f"{root}/{arch}", arch=arch, seed=3))
    sequence_parallel(trainer, SequenceGroup(None, 1, 0))
    engine_model = copy.deepcopy(trainer)
    set_autocast(engine_model, torch.bfloat16)
    engine = HFEngine(engine_model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id,
                      record_routes=True)
    ids = [tok(f"{i}+{3 * i + 1}=")["input_ids"] for i in range(prompts)]
    res = engine.generate([Request(p, i, 1) for i, p in enumerate(ids)],
                          SamplingParams(max_new_tokens=16, samples_per_prompt=4, seed=2))
    rows = [(p, c) for p, r in zip(ids, res) for c in r]
    batch = Batch({"tokens": Ragged.of([torch.tensor(p + c.token_ids) for p, c in rows], torch.long),
                   "response_len": torch.tensor([len(c.token_ids) for _, c in rows]),
                   "engine_logp": Ragged.of([torch.tensor(c.logprobs) for _, c in rows], torch.float32),
                   "routes": Ragged.of([c.routes for _, c in rows], routing.routing(trainer).dtype)})
    micro = [list(range(i, min(i + 16, len(batch)))) for i in range(0, len(batch), 16)]
    live = moe.probe(trainer, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
    def scored(replay: bool) -> tuple[list, float]:  # the log-probs and the fastest of 3 passes' seconds
        times = []
        with routing.options(trainer, replay=replay):
            for _ in range(3):
                t0 = time.perf_counter()
                out = compute_logprobs(trainer, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
                times.append(time.perf_counter() - t0)
        return out, min(times)

    (own, own_s), (replayed, replay_s) = scored(False), scored(True)
    gaps = {name: torch.cat([(t - torch.tensor(c.logprobs)).abs() for t, (_, c) in zip(lp, rows)])
            for name, lp in (("own", own), ("replay", replayed))}
    return {"arch": arch, "tokens": sum(len(p) + len(c.token_ids) - 1 for p, c in rows),
            "per_layer": live["moe/routes_differ"], "any": live["moe/routes_differ_any_layer"],
            "own_s": own_s, "replay_s": replay_s,
            **{f"{k}_{s}": float(getattr(v, s)()) for k, v in gaps.items() for s in ("mean", "max")}}


# expert parallelism's rows: experts are 95 % of this model, so what EP takes off a rank shows
EP_MODEL = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 256,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "num_experts": 16, "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 256,
            "tie_word_embeddings": True, "norm_topk_prob": True}
EP_WORLD, ROWS, LENGTH = 4, 4, 64


def ep_config(ep: int, lora: int = 0, tp: int = 1):
    """The evenrl config whose worst-case micro-batch is the benchmark's (ROWS rows of LENGTH tokens a rank)."""
    from evenrl.config import RunConfig

    return RunConfig.model_validate({
        "model": {"lora": {"rank": lora, "experts": bool(lora)}},
        "parallel": {"expert_parallel_size": ep, "tensor_parallel_size": tp}, "data": {"prompts_per_step": 8, "max_prompt_tokens": LENGTH // 2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": LENGTH // 2},
        "train": {"token_cap_per_micro_batch": ROWS * LENGTH}})


def ep_planned(ep: int, lora: int = 0, tp: int = 1) -> dict:
    from evenrl.planner.dims import dims_from_config
    from evenrl.planner.layout import make_layout
    from evenrl.planner.memory import GIB, OVERHEAD_GIB, estimate_memory, worst_case_shape

    cfg, lay = ep_config(ep, lora, tp), make_layout(1, EP_WORLD, device="cpu")
    assert worst_case_shape(cfg, lay)[0] == ROWS * LENGTH, "the planned micro-batch must be the measured one"
    est = estimate_memory(cfg, lay, dims_from_config(EP_MODEL))
    b = est.breakdown
    return {"state": (b["parameters"] + b["gradients"] + b["optimizer"]) * GIB,
            "update": (est.phases["update"] - OVERHEAD_GIB["cpu"]) * GIB, "params": est.params}


def ep_rank(rank: int, world: int, port: int, ep: int, repeats: int, out_dir: str, lora: int = 0,
            tp: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from memory import phase_peaks, resident_bytes  # benchmarks/memory.py: the same measurement
    from evenrl.core.batch import Batch, Ragged
    from evenrl.distributed import collectives as dist
    from evenrl.models.forward import response_logprobs
    from evenrl.train.parallelize import parallelize

    torch.set_num_threads(1)
    mesh = dist.init(expert_parallel=ep, tensor_parallel=tp)
    tokens = torch.randint(0, EP_MODEL["vocab_size"], (ROWS, LENGTH), generator=torch.Generator().manual_seed(rank))
    batch = Batch({"tokens": Ragged.of(list(tokens), torch.long), "response_len": torch.full((ROWS,), LENGTH - 1)})
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            Qwen3MoeConfig(**{k: v for k, v in EP_MODEL.items() if k != "model_type"}), attn_implementation="sdpa")
        if lora:  # adapters on the attention and every expert, as evenrl.train.trainer adds them before EP
            from evenrl.models.lora import add_adapters

            add_adapters(model, ep_config(ep, lora, tp).model.lora)
        # TP, then EP (its tp group splitting the tokens the experts see), the log-prob head, the packed forward
        # every MoE forward takes: as the trainer applies them
        parallelize(model, mesh, ep_config(ep, lora, tp))
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=False)

        def step() -> int:
            out, _, _ = response_logprobs(model, batch, 0)
            (-out[..., 0].mean()).backward()
            dist.all_reduce_grads(params)
            dist.clip_grad_norm(params, 1.0)
            optimizer.step()
            state = resident_bytes(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            return state

        step()  # creates AdamW's state
        dist.barrier()
        with record_function("update"):
            state = step()
        dist.barrier()
    peaks = phase_peaks(prof, ["update"])
    times = []
    for _ in range(repeats):  # timed without the profiler
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"state": state, "update": peaks["update"],
                                                         "seconds": statistics.median(times)}))
    dist.shutdown()


def ep_rows(repeats: int, lora: int = 0) -> list[dict]:
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the workers import benchmarks/memory.py
    from memory import free_port

    rows = []
    for ep, tp in ((1, 1), (2, 1), (4, 1), (2, 2)):  # TP without EP on a mixture is refused (config.compatibility)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(ep_rank, args=(EP_WORLD, free_port(), ep, repeats, d, lora, tp), nprocs=EP_WORLD, join=True)
            ranks = [json.loads(Path(d, f"{r}.json").read_text()) for r in range(EP_WORLD)]
        rows.append({"ep": ep, "tp": tp, **{k: max(r[k] for r in ranks) for k in ranks[0]},
                     "plan": ep_planned(ep, lora, tp)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--only", default="experts,mismatch,ep", help="which tables, comma-separated")
    ap.add_argument("--lora", type=int, default=0, help="EP rows: LoRA of this rank on the attention and experts")
    args = ap.parse_args()
    only = set(args.only.split(","))
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    if "experts" in only:
        print(f"\nexperts layer: {args.tokens} tokens, hidden 256, 16 experts x 128, top 4, fp32 (tokens/s)")
        print(f"  {'backend':<12} {'forward':>12} {'fwd+bwd':>12}")
        for impl, fwd, both in experts_rows(args.tokens, args.repeats):
            print(f"  {impl:<12} {fwd:12,.0f} {both:12,.0f}")
    if "mismatch" in only:
        mismatch_table(args.prompts)
    if "ep" in only:
        rows = ep_rows(args.repeats, args.lora)
        mib = 2 ** 20
        print(f"\nexpert parallelism: {EP_WORLD} processes, replicated, fp32, {rows[0]['plan']['params'] / 1e6:.1f} M "
              f"parameters ({EP_MODEL['num_experts']} experts x {EP_MODEL['num_hidden_layers']} layers), "
              + (f"frozen under LoRA rank {args.lora} on the attention and experts, " if args.lora else "")
              + f"{ROWS} x {LENGTH} tokens a rank; MiB per rank (the largest), plan = evenrl plan's less its 0.3 GiB "
              "overhead")
        print(f"  {'EP':>2} {'TP':>2} | {'state':>7} {'plan':>7} | {'update':>7} {'plan':>7} | {'step s':>7}")
        for r in rows:
            print(f"  {r['ep']:>2} {r['tp']:>2} | {r['state'] / mib:7.1f} {r['plan']['state'] / mib:7.1f} | "
                  f"{r['update'] / mib:7.1f} {r['plan']['update'] / mib:7.1f} | {r['seconds']:7.3f}")


def mismatch_table(prompts: int) -> None:
    print(f"\nbf16 engine vs fp32 trainer: {prompts} prompts x 4 samples x 16 tokens")
    print(f"  {'family':<12} {'tokens':>7} {'differ/layer':>20} {'any':>7}   {'|dlogp| mean':>20} {'|dlogp| max':>20}"
          f" {'scoring s':>15}")
    print(f"  {'':<12} {'':>7} {'':>20} {'':>7}   {'no replay / replay':>20} {'no replay / replay':>20}"
          f" {'no replay / rep':>15}")
    with tempfile.TemporaryDirectory() as root:
        for arch in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"):
            r = mismatch_row(arch, prompts, root)
            layers = " ".join(f"{x:.2%}" for x in r["per_layer"])
            print(f"  {r['arch']:<12} {r['tokens']:>7} {layers:>20} {r['any']:>7.2%}   "
                  f"{r['own_mean']:>9.2e} / {r['replay_mean']:.2e} {r['own_max']:>9.2e} / {r['replay_max']:.2e}"
                  f" {r['own_s']:>7.3f} / {r['replay_s']:.3f}")


if __name__ == "__main__":
    main()
