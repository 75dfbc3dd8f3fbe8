"""The update alone at prime-rl's benchmark shapes: tokens/s, MFU computed the way prime-rl computes it, peak memory.

    python3 benchmarks/trainer_throughput.py --model qwen3-0.6b --seq-len 16384                 # one GPU, bf16
    python3 benchmarks/trainer_throughput.py --model qwen3-4b --lora-rank 16 --seq-len 65536
    .venv/bin/python benchmarks/trainer_throughput.py --tiny --device cpu                        # the CPU rehearsal

What runs is evenrl's gradient step, not a copy of it. The policy is made as `evenrl train` makes it
(train/trainer.py's trainable_model: fp32 master weights, or with --lora-rank a frozen base in the compute dtype
under fp32 peft adapters on every projection; train.parallelize: bf16 autocast, activation checkpointing, the
packed training forward), from random weights of the shape's published config.json (SHAPES: built in memory, no
download), with trainer.adamw's AdamW; each step is train/step.py's `update`, the function `evenrl train` calls for
its mini-batch updates (update.minibatch_update over the micro-batches: models.forward.response_logprobs, the GRPO
objective train.objectives.rl_objective, backward, the gradient clip, AdamW's step).

The data are prime-rl's trainer benchmark's (`--bench`: trainer only, `data.fake`, rl/data.py FakeDataLoader at
prime-rl b798a90d6, the commit of its BENCHMARKS.md of 2026-02-01): each micro-batch one sequence of seq_len random
token ids below 100, every position trained on; 2 micro-batches, one optimizer step per step. Here a micro-batch is
one packed row of seq_len tokens (its first token the prompt, the rest the response) or --rows-per-micro-batch rows
packed into the same seq_len.

Tokens/s and MFU as prime-rl computes them (src/prime_rl/trainer/perf.py, PerfCounter, at b798a90d6; its
rl/train.py counts seq_len x micro-batches tokens per step, and its bench drops the first of 4 steps):
    tokens/s        tokens of the timed steps / their wall time (each step ends synchronized)
    MFU             flop_per_token x tokens/s / peak
    flop_per_token  6 N_mm + 12 L H (hidden / H) seq_len                                       full fine-tuning
                    4 N_mm + 2 N_trainable_not_lora + 6 N_lora + 12 L H (hidden / H) seq_len    LoRA
    N_mm            (get_active_mm_params) L (2 hidden H head_dim [q, o] + 2 hidden KV head_dim [k, v]
                    + 3 hidden intermediate) + vocab hidden [the output layer, tied or not]
    peak            dense bf16 (_get_peak_flops): 989 TFLOP/s H100 SXM and H200, 835 H100 NVL, 756 H100 PCIe,
                    312 A100, 2,250 B200, another GPU A100's (prime-rl's fallback); none on CPU (MFU is then
                    left out unless --peak-tflops gives one)
What the convention counts: attention at hidden / heads per head (64 for Qwen3-0.6B, whose heads are 128 wide),
every query against every key (no halving for the causal mask), no recomputation. It reproduces prime-rl's
published MFU from its published tokens/s (tests/test_trainer_throughput.py). Peak memory: CUDA's
max_memory_reserved (prime-rl's "Peak Mem") and max_memory_allocated; on CPU the process's peak resident set.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

GIB = 2**30
# The published config.json of each shape on the Hugging Face hub (the fields that set its size and speed):
# Qwen/Qwen3-0.6B, and Qwen/Qwen3-4B-Instruct-2507 (the 4B of prime-rl's rows; Qwen3-4B differs only in
# max_position_embeddings 40960 and rope_theta 1e6). No network here: the values are written down.
QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, hidden_act="silu", rms_norm_eps=1e-6,
             attention_bias=False, tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
             bos_token_id=151643, eos_token_id=151645)
SHAPES = {
    "qwen3-0.6b": {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 40960,
                   "rope_theta": 1e6},
    "qwen3-4b": {**QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 262144,
                 "rope_theta": 5e6},
    # --tiny: the same family at toy size, for the CPU rehearsal
    "tiny": {**QWEN3, "vocab_size": 512, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 4096, "rope_theta": 1e6, "bos_token_id": 1, "eos_token_id": 2},
}
# prime-rl's _get_peak_flops (perf.py), dense bf16 FLOP/s by device name, first match wins
PEAKS = ((("H100", "NVL"), 835e12), (("H100", "PCIe"), 756e12), (("H100",), 989e12), (("H200",), 989e12),
         (("GB200",), 2.5e15), (("B200",), 2.25e15), (("A100",), 312e12))
# prime-rl's benchmarks/results/BENCHMARKS.md of 2026-02-01, one H100 (HBM3), FlashAttention 3, activation
# checkpointing (Recompute), torch.compile, 2 micro-batches: (model, seq_len, LoRA rank) -> (tokens/s, MFU, GiB)
PUBLISHED = {("qwen3-0.6b", 16384, 0): (11900, 0.111, 12.5), ("qwen3-0.6b", 65536, 0): (10150, 0.268, 19.6),
             ("qwen3-0.6b", 16384, 16): (13340, 0.109, 5.1), ("qwen3-0.6b", 65536, 16): (9970, 0.252, 11.5),
             ("qwen3-4b", 16384, 16): (6230, 0.217, 23.3), ("qwen3-4b", 65536, 16): (4160, 0.374, 42.0)}
PUBLISHED_WHERE = "prime-rl BENCHMARKS.md 2026-02-01, 1xH100 HBM3, FA3, Recompute, compiled"


# ------------------------------------------------------------------------------------------ prime-rl's formula

def mm_params(shape: dict) -> int:
    """prime-rl's get_active_mm_params for a dense GQA model: the parameters each token meets in a matmul."""
    h, L, H, kv = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "num_key_value_heads"))
    d = shape.get("head_dim") or h // H
    return L * (2 * h * H * d + 2 * h * kv * d + 3 * shape["intermediate_size"] * h) + shape["vocab_size"] * h


def flop_per_token(shape: dict, seq_len: int, lora_params: int = 0, other_trainable: int = 0,
                   lora: bool = False) -> int:
    """prime-rl's _get_num_flop_per_token: forward + backward matmul FLOPs per token at sequence length seq_len."""
    L, H = shape["num_hidden_layers"], shape["num_attention_heads"]
    attention = 12 * L * H * (shape["hidden_size"] // H) * seq_len
    if lora:
        return 4 * mm_params(shape) + 2 * other_trainable + 6 * lora_params + attention
    return 6 * mm_params(shape) + attention


def peak_flops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    return next((v for words, v in PEAKS if all(w in device_name for w in words)), 312e12)  # prime-rl: A100's


# ------------------------------------------------------------------------------------------ model, data

def run_config(args):
    from evenrl.config import load_config

    return load_config(None, [f"model.dtype={args.dtype}", f"model.gradient_checkpointing={str(args.ckpt).lower()}",
                              f"model.lora.rank={args.lora_rank}", f"model.lora.alpha={args.lora_alpha}",
                              f"train.lr={args.lr}", f"train.seed={args.seed}"])


def build_policy(args, cfg, device):
    """The policy as train/trainer.py's trainable_model makes it, from random weights in memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from evenrl.models.lora import add_adapters
    from evenrl.distributed import collectives as dist
    from evenrl.train.parallelize import parallelize

    shape = SHAPES[args.model]
    hf = AutoConfig.for_model(**shape)
    hf.pad_token_id = shape["vocab_size"] - 1  # never among the fake ids (< 100)
    torch.manual_seed(args.seed)
    # fp32 master weights; a LoRA base is frozen, held in model.dtype (trainable_model's rule)
    dtype = getattr(torch, args.dtype) if args.lora_rank else torch.float32
    with torch.device(device):  # initialised where it trains: 4 B parameters on one CPU core take minutes
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype, attn_implementation="sdpa")
    if args.lora_rank:
        add_adapters(model, cfg.model.lora)
    parallelize(model, dist.init(), cfg)
    model.train()
    return model


def fake_batch(args, pad: int):
    """prime-rl's fake micro-batches: micro_batches x seq_len tokens below 100, each micro-batch one packed row (or
    --rows-per-micro-batch rows of about equal length), every token after a row's first one trained on."""
    import torch

    from evenrl.core.batch import Batch, Ragged

    g = torch.Generator().manual_seed(args.seed)
    k, n = args.rows_per_micro_batch, args.seq_len
    lens = [n // k + (i < n % k) for i in range(k)] * args.micro_batches
    tokens = [torch.randint(0, min(100, pad), (m,), generator=g) for m in lens]
    resp = torch.tensor(lens) - 1
    batch = Batch({"tokens": Ragged.of(tokens, torch.long), "response_len": resp,
                   "advantage": torch.randn(len(lens), generator=g),
                   "engine_logp": Ragged.of([-torch.rand(int(r), generator=g) for r in resp], torch.float32),
                   "sample_index": torch.arange(len(lens))})
    micro = [[list(range(i * k, (i + 1) * k)) for i in range(args.micro_batches)]]  # one mini-batch
    return batch, micro


# ------------------------------------------------------------------------------------------ the measurement

def measure(args) -> dict:
    import torch

    from evenrl.core.masking import counted_lengths
    from evenrl.core.model_plan import plan_of
    from evenrl.distributed import collectives as dist
    from evenrl.train import step as train_step
    from evenrl.train.objectives import norm_tokens
    from evenrl.train.pooled import pool
    from evenrl.train.trainer import Prompts, Trained, Trainer, adamw
    from evenrl.train.update import minibatch_denominators

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = run_config(args)
    t0 = time.perf_counter()
    model = build_policy(args, cfg, device)
    build_s = time.perf_counter() - t0
    pad = model.config.pad_token_id
    optimizer, scheduler = adamw(model, cfg, cfg.train.lr, cfg.train.warmup_steps)
    trainer = Trainer(cfg=cfg, mesh=dist.init(), policy=Trained(model, optimizer, scheduler), critic=None, reference=None,
                      tokenizer=SimpleNamespace(pad_token_id=pad), prompts=Prompts([], []),
                      eval_prompts=Prompts([], []), sampler=None, reward_fns=[], engine=None, sync=None)
    batch, micro = fake_batch(args, pad)
    lens = counted_lengths(cfg, batch)
    denoms = [minibatch_denominators(lens, [r for rows in mb for r in rows], norm_tokens(cfg)) for mb in micro]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lora_params = sum(p.numel() for n, p in named if "lora_A" in n or "lora_B" in n)
    # one trained tensor the steps must move: the last (a LoRA B, which starts at zero, moves from the first step)
    watched = named[-1][1].detach().float().cpu().clone()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    secs, stats = [], {}
    for i in range(args.warmup + args.steps):
        sync()
        t = time.perf_counter()
        stats = train_step.update(trainer, i, batch, micro, denoms, pool(cfg, i, batch, micro))
        sync()
        secs.append(time.perf_counter() - t)
    timed = secs[args.warmup:]
    tokens = int(batch["tokens"].lengths.sum())  # per step: prime-rl's seq_len x micro-batches
    tps = tokens * len(timed) / sum(timed)
    shape = SHAPES[args.model]
    fpt = flop_per_token(shape, args.seq_len, lora_params, sum(p.numel() for _, p in named) - lora_params,
                         lora=args.lora_rank > 0)
    name = torch.cuda.get_device_name(device) if cuda else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(name)
    memory = ({"peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
               "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB, "what": "CUDA allocator"}
              if cuda else {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
                            "what": "peak resident set of the process (CPU: no allocator statistics)"})
    published = PUBLISHED.get((args.model, args.seq_len, args.lora_rank))
    return {
        "model": args.model, "shape": shape, "seq_len": args.seq_len, "micro_batches": args.micro_batches,
        "rows_per_micro_batch": args.rows_per_micro_batch, "lora_rank": args.lora_rank, "dtype": args.dtype,
        "gradient_checkpointing": args.ckpt, "device": name or "cpu",
        "forward_path": "packed" if plan_of(model).sequence is not None else "masked",
        "params": sum(p.numel() for p in model.parameters()), "trainable_params": sum(p.numel() for _, p in named),
        "lora_params": lora_params, "build_s": build_s, "warmup_s": secs[:args.warmup], "step_s": timed,
        "tokens_per_step": tokens, "tokens_per_s": tps, "flop_per_token": fpt,
        "peak_tflops": peak / 1e12 if peak else None, "mfu": fpt * tps / peak if peak else None,
        "memory": memory, "grad_norm": stats.get("grad_norm"),
        "watched_param": named[-1][0], "watched_max_change": float((named[-1][1].detach().float().cpu() - watched)
                                                                    .abs().max()),
        "prime_rl": None if published is None else {"tokens_per_s": published[0], "mfu": published[1],
                                                    "peak_gib": published[2], "where": PUBLISHED_WHERE}}


def report(r: dict) -> str:
    mem = r["memory"]
    m = (f"peak {mem['peak_reserved_gib']:.1f} GiB reserved ({mem['peak_allocated_gib']:.1f} allocated)"
         if "peak_reserved_gib" in mem else f"peak RSS {mem['peak_rss_gib']:.2f} GiB")
    mfu = f"MFU {r['mfu']:.1%} of {r['peak_tflops']:.0f} TFLOP/s" if r["mfu"] is not None else "MFU - (no peak)"
    lines = [f"{r['model']} {'LoRA r=' + str(r['lora_rank']) if r['lora_rank'] else 'full'}, {r['dtype']}, "
             f"{r['micro_batches']} micro-batches x {r['seq_len']} tokens ({r['rows_per_micro_batch']} row(s) each), "
             f"checkpointing {'on' if r['gradient_checkpointing'] else 'off'}, {r['forward_path']} forward, "
             f"{r['device']}",
             f"  steps {', '.join(f'{s:.3f}' for s in r['step_s'])} s (warm-up "
             f"{', '.join(f'{s:.3f}' for s in r['warmup_s'])}); {r['tokens_per_s']:,.0f} tokens/s; {mfu} "
             f"({r['flop_per_token'] / 1e9:.3g} GFLOP/token, prime-rl's formula); {m}"]
    if r["prime_rl"]:
        p = r["prime_rl"]
        lines.append(f"  prime-rl ({p['where']}): {p['tokens_per_s']:,} tokens/s, MFU {p['mfu']:.1%}, "
                     f"{p['peak_gib']} GiB")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=[s for s in SHAPES if s != "tiny"], default="qwen3-0.6b")
    ap.add_argument("--tiny", action="store_true", help="the tiny Qwen3 shape, 64 tokens per micro-batch (CPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per micro-batch (default 16384; --tiny 64)")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per optimizer step (prime-rl: 2)")
    ap.add_argument("--rows-per-micro-batch", type=int, default=1, help="rows packed into each micro-batch")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning; prime-rl: 16)")
    ap.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha (prime-rl's default 32)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="model.dtype")
    ap.add_argument("--no-checkpointing", dest="ckpt", action="store_false",
                    help="no activation checkpointing (default on, as prime-rl's Recompute)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (prime-rl: 1)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (prime-rl: 3)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the peak MFU divides by (default: prime-rl's "
                                                                    "table by device name; none on CPU)")
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW's learning rate: no speed depends on it; "
                                                            "evenrl's default 1e-6 moves weights by ~1e-6 a step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    args.model = "tiny" if args.tiny else args.model
    if args.seq_len is None:
        args.seq_len = 64 if args.tiny else 16384
    for name in ("seq_len", "micro_batches", "rows_per_micro_batch", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not a count >= 1")
    if args.seq_len < 2 * args.rows_per_micro_batch:
        ap.error(f"--seq-len: {args.seq_len} leaves a row under 2 tokens with --rows-per-micro-batch "
                 f"{args.rows_per_micro_batch} (each row needs a prompt token and a response token)")
    if args.warmup < 0 or args.lora_rank < 0:
        ap.error(f"--warmup/--lora-rank: {args.warmup}/{args.lora_rank}; counts >= 0")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        ap.error(f"--peak-tflops: {args.peak_tflops} is not a number of TFLOP/s > 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("trainer_throughput.py: --device cuda but torch sees no CUDA device; on CPU: --tiny --device cpu",
              file=sys.stderr)
        raise SystemExit(2)
    result = measure(args)
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
