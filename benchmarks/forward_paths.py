"""The training forward's paths side by side on CPU: forward + backward of one micro-batch (log-probs through the
fused head, as the update runs them) for a plain Qwen2 at a few shapes, fp32, the fastest of repeats taken in turn
(on a shared machine the minimum is what the code costs).

    python benchmarks/forward_paths.py --threads 1 --reps 9      # ~1 min
    python benchmarks/forward_paths.py --hidden 256 --layers 4
    python benchmarks/forward_paths.py --arch qwen3 --threads 1 --reps 9

Paths (evenrl.models.forward): `packed` (models/split_forward.py at sequence-parallel size 1: the model's own forward
over the rows back to back, attention within each row; what a plain Qwen2/Llama trains with), `shared` (each
distinct prompt once, its keys/values copied to its samples; `-` where no prompt repeats), `masked` (the model's own
left-padded masked forward, the reference). Shapes: equal short rows (GRPO groups at a few new tokens), mixed
lengths, a long tail (lognormal, one row at the limit), and groups of 8 samples sharing a 96-token prompt. Each
path's log-probs are printed against `masked`'s.

What it measured before the hand-written packed forward and the right-padded one went (issue 43; the fastest of 27
at --threads 1, fp32), packed-through-the-model / hand-written / right-padded / masked: 32 x 8 new (equal) 0.061 s,
0.054, 0.053, 0.052; 16 x 16..128 (mixed) 0.148, 0.155, 0.212, 0.212; 32 long-tail <= 256: 0.365, 0.557, 1.018,
1.055. On one H200 (benchmarks/results/gpu-suite-2026-11-27.md, bf16, 32 long-tail rows): 0.566 s, 0.674, 0.824,
0.883.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from evenrl.core.batch import Batch, Ragged  # noqa: E402
from evenrl.core.fused_head import head_logprobs  # noqa: E402
from evenrl.distributed.sequence import SequenceGroup, sequence_parallel  # noqa: E402
from evenrl.models import forward as fw  # noqa: E402
from evenrl.models.loading import load_policy  # noqa: E402
from evenrl.testing import make_tiny_model  # noqa: E402


def _head(layer, hidden, targets):
    logp, _ = head_logprobs(hidden, layer.weight, layer.bias, targets, 1.0)
    return logp[..., None]


def batch_of(lengths: list[int], prompt: int, vocab: int, group: int = 1, seed: int = 0) -> Batch:
    """Rows of a `prompt`-token prompt and lengths[i] response tokens; `group` consecutive rows share a prompt."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab, (prompt,), generator=g) for _ in range(-(-len(lengths) // group))]
    rows = [torch.cat([prompts[i // group], torch.randint(4, vocab, (n,), generator=g)]) for i, n in enumerate(lengths)]
    return Batch({"tokens": Ragged.of(rows, torch.long), "response_len": torch.tensor(lengths)})


def shapes(longest: int) -> dict[str, tuple[list[int], int, int]]:
    """name -> (response lengths, prompt tokens, rows per prompt)"""
    g = torch.Generator().manual_seed(3)
    tail = torch.exp(torch.randn(32, generator=g) * 0.8 + torch.log(torch.tensor(longest / 6.0))).clamp(8, longest)
    tail[0] = longest
    return {"32 x 8 new (equal)": ([8] * 32, 12, 1),
            "16 x 16..128 (mixed)": (torch.linspace(16, 128, 16).long().tolist(), 12, 1),
            f"32 long-tail <= {longest}": (tail.long().tolist(), 12, 1),
            "4 x 8 on a 96-token prompt": (torch.randint(4, 33, (32,), generator=g).tolist(), 96, 8)}


def shared(model, batch, head):
    prefixes = fw._shared_prefixes(model, batch)
    return None if prefixes is None else fw._response_logits_shared(model, batch, 0, head, *prefixes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2", help="a text family of evenrl.testing.make_tiny_model")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--longest", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        model, _ = load_policy(make_tiny_model(d + "/m", arch=args.arch, hidden=args.hidden, layers=args.layers,
                                               heads=4, seed=0, max_positions=args.longest + 128))
    model.train()
    sequence_parallel(model, SequenceGroup(None, 1, 0))  # what evenrl.train.parallelize.split_sequences gives it
    vocab = model.config.vocab_size
    paths = {"packed": lambda m, b, h: fw.split_forward(m, b, h, fw._output_layer_computes), "shared": shared,
             "masked": lambda m, b, h: fw._response_logits_model(m, b, 0, h)}
    print(f"{args.arch} hidden {args.hidden}, {args.layers} layers, fp32, {args.threads} threads; forward + backward "
          f"seconds, the fastest of {args.reps} taken in turn (max |log-prob - masked's|)")
    print(f"{'micro-batch':<28}{'padding':>8}" + "".join(f"{p:>20}" for p in paths))
    for name, (lengths, prompt, group) in shapes(args.longest).items():
        batch = batch_of(lengths, prompt, vocab, group)
        n = batch["tokens"].lengths
        padding = 1 - float(n.sum()) / (len(n) * int(n.max()))

        def once(f):
            model.zero_grad(set_to_none=True)
            out = f(model, batch, _head)
            if out is None:
                return None
            logp, _, mask = out
            (logp[..., 0] * mask).sum().backward()
            return logp[..., 0].detach()[mask]

        ref = once(paths["masked"])
        runs = {p: f for p, f in paths.items() if once(f) is not None}
        diff = {p: float((once(f) - ref).abs().max()) for p, f in runs.items()}  # and a warm-up of each
        secs: dict[str, list[float]] = {p: [] for p in runs}
        for r in range(args.reps):  # the paths in turn, each rep in another order: a busy moment hits all alike
            for p in list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]:
                t = time.perf_counter()
                once(runs[p])
                secs[p].append(time.perf_counter() - t)
        cells = {p: f"{min(secs[p]):.4f} ({diff[p]:.0e})" if p in runs else "-" for p in paths}
        print(f"{name:<28}{padding:>8.0%}" + "".join(f"{cells[p]:>20}" for p in paths), flush=True)


if __name__ == "__main__":
    main()
