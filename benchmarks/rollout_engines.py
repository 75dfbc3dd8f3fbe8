"""Rollout engines side by side: vLLM vs evenrl's hf sampler, tokens/s on the same model, prompts and lengths.

Run: .venv/bin/python benchmarks/rollout_engines.py [--hidden 256 --layers 4 --new-tokens 64 --pairs 3]

A random Qwen2 (head size 32, the smallest vLLM's CPU attention takes) is written on the spot; both engines sample
P prompts x 8 samples x N new tokens from it (temperature 1, the same keys), at three batch sizes. Runs alternate
(hf, vllm, hf, vllm, ...) so machine load hits both alike; the ratio is taken per pair and the median reported.
tokens/s counts generated tokens (both stop at EOS; the counts are printed). One warm-up call each first; vLLM's
start-up time is printed apart. Prints numbers only; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from evenrl.config import RunConfig
from evenrl.engines import HFEngine, Request, SamplingParams, make_engine
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model

BATCHES = (4, 16, 64)  # prompts per call; x 8 samples


def timed(engine, prompts, params, step) -> tuple[float, int]:
    t0 = time.perf_counter()
    res = engine.generate([Request(p, i, step) for i, p in enumerate(prompts)], params)
    dt = time.perf_counter() - t0
    return dt, sum(len(c.token_ids) for r in res for c in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(d, hidden=args.hidden, layers=args.layers, heads=args.hidden // 32, seed=0)
        model, tok = load_policy(path)
        n_params = sum(p.numel() for p in model.parameters())
        cfg = RunConfig.model_validate({"model": {"path": path}, "data": {"max_prompt_tokens": 32},
                                        "rollout": {"engine": "vllm", "max_new_tokens": args.new_tokens}})
        eos = {tok.eos_token_id}
        t0 = time.perf_counter()
        vllm = make_engine(cfg, model, eos_token_ids=eos, pad_token_id=tok.pad_token_id, device=torch.device("cpu"))
        start = time.perf_counter() - t0
        hf = HFEngine(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id)
        prompts = [tok(f"{i % 50}+{(7 * i) % 50}=")["input_ids"] for i in range(max(BATCHES))]
        params = SamplingParams(max_new_tokens=args.new_tokens, samples_per_prompt=8, seed=0)
        for e in (hf, vllm):
            e.generate([Request(p, i, 0) for i, p in enumerate(prompts[:2])], params)
        print(f"model: Qwen2, {n_params / 1e6:.1f} M parameters (hidden {args.hidden}, {args.layers} layers), fp32; "
              f"torch threads {torch.get_num_threads()}; vLLM start-up {start:.1f} s")
        print(f"{'prompts x 8 x new':>20} {'hf tok/s':>10} {'vllm tok/s':>11} {'vllm/hf (median of pairs)':>26}"
              f" {'tokens hf/vllm':>16}")
        for b in BATCHES:
            rates = {"hf": [], "vllm": []}
            counts = {}
            for pair in range(args.pairs):
                for name, e in (("hf", hf), ("vllm", vllm)):
                    dt, n = timed(e, prompts[:b], params, step=pair + 1)
                    rates[name].append(n / dt)
                    counts[name] = n
            ratio = statistics.median(v / h for h, v in zip(rates["hf"], rates["vllm"]))
            print(f"{f'{b} x 8 x {args.new_tokens}':>20} {statistics.median(rates['hf']):10,.0f} "
                  f"{statistics.median(rates['vllm']):11,.0f} {ratio:25.2f}x {counts['hf']:>7}/{counts['vllm']:<7}")
        vllm.close()


if __name__ == "__main__":  # vLLM may spawn processes
    main()
