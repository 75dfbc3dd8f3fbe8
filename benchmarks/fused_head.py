"""Peak memory and time of one log-prob pass and one update micro-batch at a 151,936-token vocabulary: the output
layer as logits then log-softmax (the plain path) beside log-probs straight from the hidden states
(evenrl.models.forward.response_logprobs, core.fused_head), side by side in one run.

    .venv/bin/python benchmarks/fused_head.py [--rows 8] [--prompt 32] [--response 256] [--layers 2]

The model is Qwen2.5-0.5B-shaped (hidden 896, vocabulary 151,936, tied embeddings) with fewer layers, random
weights, float32, on the CPU. Each arm runs in a fresh process; its peak is the most bytes of live CPU tensors during
the measured call beyond those live when it starts (the model and the micro-batch): torch's profiler records every
allocation and free (benchmarks/memory.py's phase_peaks). It counts what the pass allocates: activations, logits
or chunks, and for the update the parameters' gradients (0.6 GiB here, the same in both paths).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
         "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 2048}


def arm(path: str, phase: str, rows: int, prompt: int, response: int, layers: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory import phase_peaks  # benchmarks/memory.py: live CPU tensor bytes from the profiler's events

    from evenrl.core.batch import Batch, Ragged
    from evenrl.core.losses import token_logprobs
    from evenrl.models.forward import response_logits, response_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(num_hidden_layers=layers, **SHAPE), dtype=torch.float32)
    model.train()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, SHAPE["vocab_size"], (prompt + response,), generator=g) for _ in range(rows)]
    batch = Batch({"tokens": Ragged.of(seqs, torch.long), "response_len": torch.full((rows,), response)})

    def logp():
        if path == "plain":
            logits, targets, mask = response_logits(model, batch, 0)
            return token_logprobs(logits, targets), mask
        out, _, mask = response_logprobs(model, batch, 0)
        return out[..., 0], mask

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("start"):
            pass
        t0 = time.perf_counter()
        with record_function("pass"):
            if phase == "log-probs":
                with torch.no_grad():
                    logp()
            else:
                lp, mask = logp()
                (-(lp * mask).sum() / mask.sum()).backward()
        seconds = time.perf_counter() - t0
    peaks = phase_peaks(prof, ["start", "pass"])
    return {"peak_gib": (peaks["pass"] - peaks["start"]) / 2**30, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--arm", nargs=2, help=argparse.SUPPRESS)  # internal: run one arm in this process
    a = p.parse_args()
    shape = [str(a.rows), str(a.prompt), str(a.response), str(a.layers)]
    if a.arm:
        print(json.dumps(arm(*a.arm, a.rows, a.prompt, a.response, a.layers)))
        return
    import torch

    tokens = a.rows * a.response
    logits_gib = tokens * SHAPE["vocab_size"] * 4 / 2**30
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {a.rows} rows x ({a.prompt} prompt + "
          f"{a.response} response) tokens, vocabulary {SHAPE['vocab_size']:,}, {a.layers} layers, float32")
    print(f"one float32 logits tensor of the response tokens: {logits_gib:.2f} GiB")
    print(f"{'phase':<10} {'plain peak':>11} {'fused peak':>11} {'ratio':>6} {'plain s':>8} {'fused s':>8}")
    for phase in ("log-probs", "update"):
        got = {}
        for path in ("plain", "fused"):
            out = subprocess.run([sys.executable, __file__, "--rows", shape[0], "--prompt", shape[1], "--response",
                                  shape[2], "--layers", shape[3], "--arm", path, phase],
                                 capture_output=True, text=True, check=True)
            got[path] = json.loads(out.stdout.strip().splitlines()[-1])
        pl, fu = got["plain"], got["fused"]
        print(f"{phase:<10} {pl['peak_gib']:>9.2f} G {fu['peak_gib']:>9.2f} G {fu['peak_gib'] / pl['peak_gib']:>6.2f} "
              f"{pl['seconds']:>8.2f} {fu['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
