"""Why two layouts' final weights differ by ~1e-6 when their gradients differ by ~1e-10: AdamW's slope near g = 0.

One tiny Qwen3-MoE (evenrl.testing.make_tiny_model, 8 experts, top 2), one GRPO step with one mini-batch, run on
1 process, on 2 (data parallel) and on 2 with expert parallelism (EP 2). The gradient each run applied is read back
from its checkpoint (AdamW's first step: exp_avg = (1 - beta1) g) and every weight entry more than --show apart
from the 1-process run's is printed beside its gradient |g|, the gradients' difference dg and what AdamW's first
update makes of it: lr * g / (|g| + eps) has slope lr * eps / (|g| + eps)^2, so

    predicted dW = lr * eps * dg / (|g| + eps)^2        (lr 1e-3, eps 1e-8: up to 1e5 * dg where |g| << eps)

An entry whose gradient is a near-cancellation (|g| ~ 1e-9, its terms ~1e-4) keeps the terms' absolute rounding
(~1e-11, set by the order the ranks' partial sums are added) and AdamW turns it into ~1e-6 of weight. Entries with
ordinary gradients (|g| >> eps) move by lr whatever their rounding. EP changes nothing here: the same entries,
the same amounts as plain data parallelism (its reduction's order is what differs from 1 process).

Run: .venv/bin/python benchmarks/layout_rounding.py [--lr 1e-3] [--show 1e-7]   (~3 min on 2 CPU cores)
Measured (2026-12-07, the project's 2-core machine) in docs/moe.md "Exactness".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

LAYOUTS = {"1 process": [], "DP 2": ["--nproc-per-node", "2"],
           "EP 2": ["--nproc-per-node", "2", "parallel.expert_parallel_size=2"]}
REWARD = '''
def digit_fraction(completion, answer, **_):
    """Share of the answer's digits the completion contains: a reward that tells tiny random models apart."""
    return sum(c in completion for c in str(answer)) / max(1, len(str(answer)))
'''


def _setup(root: Path, lr: float) -> Path:
    from evenrl.demo import write_addition_data
    from evenrl.testing import make_tiny_model

    model = make_tiny_model(str(root / "model"), arch="qwen3_moe", seed=3)
    write_addition_data(root / "addition.jsonl")
    (root / "bench_rewards.py").write_text(REWARD)
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {model}}}
data: {{path: {root / 'addition.jsonl'}, prompts_per_step: 4, max_prompt_tokens: 16}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4, router_replay: engine}}
rewards: {{functions: [{{name: 'bench_rewards:digit_fraction'}}]}}
algo: {{advantage: grpo, minibatches_per_step: 1, router_aux_loss_coef: 0.01, kl_coef: 0.01}}
train: {{steps: 1, lr: {lr}, token_cap_per_micro_batch: 24}}
checkpoint: {{every_steps: 1}}
log: {{progress: false, tensorboard: false}}
""")
    return cfg


def _run(cfg: Path, out: Path, args: list[str]) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cfg.parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "evenrl.cli", "train", str(cfg), f"log.run_dir={out}", *args],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    saved = out / "state.pt"
    dcp_to_torch_save(str(out / "checkpoints" / "step-000001" / "state"), str(saved))
    return dict(_flat(torch.load(saved, weights_only=False)))


def _flat(d: dict, pre: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, pre + k + ".")
        elif torch.is_tensor(v) and v.is_floating_point():
            yield pre + k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--show", type=float, default=1e-7, help="print entries at least this far apart")
    a = ap.parse_args()
    beta1, eps = 0.9, 1e-8  # evenrl's AdamW defaults (train.betas; eps is torch's)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = _setup(root, a.lr)
        runs = {name: _run(cfg, root / f"run{i}", args) for i, (name, args) in enumerate(LAYOUTS.items())}
    one = runs["1 process"]
    weights = [k for k in one if k.startswith("model.") and f"optimizer.{k[6:]}.exp_avg" in one]
    print(f"lr {a.lr:g}, eps {eps:g}; {sum(one[k].numel() for k in weights):,} weight entries with their own AdamW "
          f"state (a tied head shares its embedding's)\n")
    print(f"{'layout':<10}{'weight':<40}{'|g|':>10}{'dg':>10}{'dW':>10}{'predicted':>11}")
    for name, run in runs.items():
        if name == "1 process":
            continue
        worst, far, ordinary = 0.0, 0, 0.0
        for k in weights:
            g = one[f"optimizer.{k[6:]}.exp_avg"] / (1 - beta1)
            dg = (run[f"optimizer.{k[6:]}.exp_avg"] / (1 - beta1) - g).abs()
            dw = (run[k] - one[k]).abs()
            pred = a.lr * eps * dg / (g.abs() + eps) ** 2
            ordinary = max(ordinary, float(torch.cat([dw[g.abs() > 100 * eps], dw.new_zeros(1)]).max()))
            for i in (dw >= a.show).nonzero().tolist():
                i = tuple(i)
                far += 1
                worst = max(worst, abs(float(dw[i] - pred[i])) / float(dw[i]))
                print(f"{name:<10}{k[6:][-38:]:<40}{float(g[i].abs()):>10.2e}{float(dg[i]):>10.1e}"
                      f"{float(dw[i]):>10.2e}{float(pred[i]):>11.2e}")
        print(f"{name}: {far} entries >= {a.show:g} apart, max {max_abs(run, one, weights):.2e}; predicted within "
              f"{worst:.1%} each; entries with |g| > 100 eps at most {ordinary:.1e} apart (a weight's own rounding: an fp32 1.0's spacing is 1.2e-7)\n")


def max_abs(a: dict, b: dict, keys: list) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in keys)


if __name__ == "__main__":
    main()
