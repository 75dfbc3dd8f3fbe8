"""Tokens per second of evenrl's own sampler (engines.hf.generate) on a tiny random model, at two lengths.

    .venv/bin/python benchmarks/sampler.py
"""

from __future__ import annotations

import tempfile
import time

import torch

from evenrl.engines.hf import SamplingParams, generate
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        model, tok = load_policy(make_tiny_model(d))
    prompts = [tok(f"{i % 50}+{(7 * i) % 50}=")["input_ids"] for i in range(32)]
    keys = list(range(32))
    for new in (16, 128):
        params = SamplingParams(max_new_tokens=new, samples_per_prompt=8)
        generate(model, prompts[:2], keys[:2], params, step=0, eos_token_ids=set(), pad_token_id=tok.pad_token_id)
        t0 = time.perf_counter()
        res = generate(model, prompts, keys, params, step=1, eos_token_ids=set(), pad_token_id=tok.pad_token_id)
        dt = time.perf_counter() - t0
        n_tok = sum(len(c.token_ids) for r in res for c in r)
        print(f"32 prompts x 8 samples x {new} new tokens: {n_tok} tokens in {dt:.2f} s = {n_tok / dt:,.0f} tokens/s "
              f"(torch threads: {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
