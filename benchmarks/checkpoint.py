"""What a checkpoint costs: `evenrl.train.checkpoint.save` (DCP, synchronous, atomic) on one process, for the demo's
model and for benchmarks/memory.py's, each with AdamW state, timed N times; and what the default cadence
(checkpoint.every_steps=500, checkpoint.every_minutes=30) adds to a run of a given step time.

Run: .venv/bin/python benchmarks/checkpoint.py [--repeats 7] [--demo-step-s 0.1] [--memory-step-s 3.66]
(~1 min on the shared 2-core machine)

The default cadence saves every 500 steps and whenever 30 minutes have passed since the last save; so per step it
costs save_s / min(500, steps in 30 minutes). The step times to put in are measured elsewhere: the demo's
(`time/step` in its metrics.jsonl) and memory.py's "step s".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from e2e import Saved  # noqa: E402  (the least a checkpoint holds: models, optimizers, a small state)

from evenrl.train import checkpoint  # noqa: E402

MEMORY_MODEL = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
                "num_key_value_heads": 2, "vocab_size": 16384, "tie_word_embeddings": True,
                "max_position_embeddings": 512}  # benchmarks/memory.py's MODEL


def models() -> dict[str, torch.nn.Module]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from evenrl.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        demo = Qwen2ForCausalLM.from_pretrained(make_tiny_model(d))  # the demo's 81 K-parameter model
    torch.manual_seed(0)
    return {"demo": demo, "memory.py": Qwen2ForCausalLM(Qwen2Config(**MEMORY_MODEL))}


def save_seconds(model: torch.nn.Module, repeats: int) -> tuple[float, float, int]:
    """(median, min) seconds of a save with AdamW state, and the checkpoint's bytes."""
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).logits.sum().backward()
    opt.step()  # AdamW's moments exist, as in a checkpoint after any step
    times = []
    with tempfile.TemporaryDirectory() as root:
        state = Saved({"policy": (model, opt)}, {"rng": checkpoint.rng_state()})
        for step in range(1, repeats + 1):
            state.step = step
            t0 = time.perf_counter()
            path = checkpoint.save(root, state, keep=2)
            times.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return statistics.median(times), min(times), size


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--demo-step-s", type=float, default=0.1, help="the demo's seconds per GRPO step")
    ap.add_argument("--memory-step-s", type=float, default=3.66,
                    help="memory.py's model's seconds per step (docs/performance.md: float32, 1 process)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    step_s = {"demo": args.demo_step_s, "memory.py": args.memory_step_s}
    print(f"{'model':<10} {'params':>10} {'checkpoint':>11} {'save s (median, min)':>22} {'step s':>7} "
          f"{'default cadence per step':>25}")
    for name, model in models().items():
        median, least, size = save_seconds(model, args.repeats)
        every = min(500, max(1, int(30 * 60 / step_s[name])))  # steps between saves under the default cadence
        params = sum(p.numel() for p in model.parameters())
        print(f"{name:<10} {params:>10,} {size / 2**20:>9.1f} MiB {median:>12.3f}, {least:.3f} {step_s[name]:>7.2f} "
              f"{median / every:>12.4f} s = {100 * median / every / step_s[name]:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
