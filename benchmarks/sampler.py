"""evenrl's own sampler (engines.hf.generate) on a tiny random model: tokens/s per decoder and precision, and what a
decoding step dispatches (aten ops, and elements converted between dtypes), side by side in one run.

    .venv/bin/python benchmarks/sampler.py [--new-tokens 16,128] [--bf16]

Ops per step is the number that matters on a GPU, where a small model's decode step is launch-bound: every op is a
kernel launch unless the step is replayed from a CUDA graph (rollout.decoder=static on CUDA). On this CPU the wall
time says how the decoders compare here; bf16 matmuls are slow on CPUs without bf16 units, so --bf16 rows are slow.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from evenrl.engines.base import Request
from evenrl.engines.hf import SamplingParams, generate
from evenrl.models.decoder import LeanDecoder
from evenrl.models.loading import autocast, load_policy, set_autocast
from evenrl.testing import make_tiny_model


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0
        self.converted = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype):
            if out.dtype == args[0].dtype:
                return out  # .to() of the tensor's own dtype: returns it, no kernel
            self.converted += args[0].numel()
        self.ops += 1
        return out


def step_counts(model, static: bool, rows: int = 32, steps: int = 8) -> tuple[float, float]:
    """(aten ops, elements converted to another dtype) per decoding step of 32 rows, prompt of 8 tokens."""
    ids = torch.randint(3, 100, (rows, 8))
    attn, pos = torch.ones_like(ids), torch.arange(8).expand_as(ids)
    with torch.inference_mode(), autocast(model):
        dec = LeanDecoder(model, 8 + steps, static=static)
        logits = dec.prefill(ids, attn, pos)
        count = _Count()
        with count:
            for t in range(steps):
                logits = dec.step(logits.argmax(-1), pos[:, -1] + 1 + t)
    return count.ops / steps, count.converted / steps


def tokens_per_s(model, tok, decoder: str, new: int) -> float:
    prompts = [tok(f"{i % 50}+{(7 * i) % 50}=")["input_ids"] for i in range(32)]
    keys = list(range(32))
    params = SamplingParams(max_new_tokens=new, samples_per_prompt=8)
    generate(model, [Request(p, k, 0) for p, k in zip(prompts[:2], keys)], params, eos_token_ids=set(),
             pad_token_id=tok.pad_token_id, decoder=decoder)
    t0 = time.perf_counter()
    res = generate(model, [Request(p, k, 1) for p, k in zip(prompts, keys)], params, eos_token_ids=set(),
                   pad_token_id=tok.pad_token_id, decoder=decoder)
    n_tok = sum(len(c.token_ids) for r in res for c in r)
    return n_tok / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", default="16,128", help="comma-separated max_new_tokens to time")
    ap.add_argument("--bf16", action="store_true", help="also the bf16 autocast rows (slow on most CPUs)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.new_tokens.split(",")]
    with tempfile.TemporaryDirectory() as d:
        model, tok = load_policy(make_tiny_model(d, hidden=256, layers=4))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny Qwen2 ({n_params / 1e6:.2f} M params, "
          f"{model.config.num_hidden_layers} layers); 32 prompts x 8 samples, no EOS")
    print(f"{'decoder':8} {'precision':14} {'ops/step':>9} {'converted/step':>15}"
          + "".join(f" {f'tok/s @{n}':>11}" for n in lengths))
    for precision in ("fp32", "bf16-autocast") if args.bf16 else ("fp32",):
        if precision != "fp32":
            set_autocast(model, torch.bfloat16)
        for decoder in ("forward", "lean", "static"):
            if decoder == "forward":
                ops, conv = float("nan"), float("nan")
            else:
                ops, conv = step_counts(model, decoder == "static")
            speeds = [tokens_per_s(model, tok, decoder, n) for n in lengths]
            print(f"{decoder:8} {precision:14} {ops:9.0f} {conv:15,.0f}" + "".join(f" {s:11,.0f}" for s in speeds))


if __name__ == "__main__":
    main()
