"""bf16 weights and AdamW state (model.weights_dtype=bfloat16) against fp32 AdamW: memory per parameter, step time,
and how far the weights drift from fp32 AdamW's over N steps on a tiny model. Measured, one CPU process.

Run: .venv/bin/python benchmarks/bf16_state.py [--steps 200] [--lrs 1e-5,1e-6] [--json OUT]
(the defaults: ~1 min of CPU on the shared 2-core project machine)

Every run trains the same tiny Qwen2-shaped model (evenrl.testing.make_tiny_model, 80 K parameters; its weights
rounded to bf16 first, so every run starts from the same numbers) on the same batches (random token rows, next-token
loss, a fixed seed), with AdamW at each learning rate (betas 0.9/0.999, eps 1e-8, no weight decay):
  fp32           fp32 weights, fp32 compute, torch.optim.AdamW (fused): the reference
  fp32 state     fp32 weights, bf16 autocast compute (evenrl's model.dtype=bfloat16): what the bf16 state replaces
  bf16 Kahan     bf16 weights and compute, evenrl.train.optimizer's AdamW (torch-optimi, Kahan-compensated, bf16
                 moments and compensation): model.weights_dtype=bfloat16
  bf16 plain     bf16 weights and compute, torch.optim.AdamW on them (bf16 moments, every update rounded to bf16):
                 what verl's fsdp_config.model_dtype=bf16 or EasyR1's torch_dtype=bf16 with optim.strategy=adamw run

Drift: the weights after N steps against the reference's, as |w - w_ref| over |w_ref - w0| (root mean squares over
every element: 0 is the reference's update exactly, 1 an error as large as the whole update), and the share of
the reference's moved elements that moved at all (an update below a bf16 weight's spacing that rounds away does
not move it). bf16 Kahan's "weights" are its bf16 parameters (what a checkpoint's final/ holds), without the
compensation ("+comp": with it, the weights its next updates build on). The drift from fp32 compute alone is the "fp32 state" row's; bf16 Kahan's beyond it is the state's.

Memory: bytes of the parameters, their gradients and the optimizer's state per parameter, counted from the tensors
after a step (what evenrl.planner.memory counts: 16 and 10). Step time: the optimizer step alone, median of 20, on a
larger flat set of tensors (--timing-params, 20 M by default) so that kernels, not Python, are timed; CPU only here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from evenrl.config import load_config  # noqa: E402
from evenrl.testing import make_tiny_model  # noqa: E402
from evenrl.train.optimizer import make_adamw  # noqa: E402

MODES = ("fp32", "fp32 state", "bf16 Kahan", "bf16 plain")


def optimizer(mode: str, params, lr: float):
    if mode == "bf16 Kahan":
        cfg = load_config(None, ["model.dtype=bfloat16", "model.weights_dtype=bfloat16", f"train.lr={lr}"])
        return make_adamw(params, cfg, lr)
    if mode == "bf16 plain":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=True)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)


def train(model_dir: str, mode: str, lr: float, steps: int, seed: int = 0):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(mode, params, lr)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    losses = []
    for _ in range(steps):
        ids = torch.randint(4, vocab, (8, 32), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "fp32 state"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.numel() > 1)
    n = sum(p.numel() for p in params)
    per_param = (sum(p.numel() * p.element_size() for p in params) * 2 + state) / n  # weights, gradients, state
    weights = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    # the Kahan run's weights with the compensation it still carries (what its next updates build on)
    carried = {name: weights[name] + opt.state[p]["kahan_comp"].float() for name, p in model.named_parameters()} \
        if mode == "bf16 Kahan" else None
    return weights, losses, per_param, carried


def drift(w: dict, ref: dict, start: dict) -> tuple[float, float]:
    err = torch.cat([(w[k] - ref[k]).flatten() for k in ref])
    move = torch.cat([(ref[k] - start[k]).flatten() for k in ref])
    moved_ref = move != 0
    moved = torch.cat([(w[k] != start[k]).flatten() for k in ref])
    return float(err.norm() / move.norm()), float((moved & moved_ref).sum() / moved_ref.sum())


def step_time(mode: str, numel: int) -> float:
    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // 16, dtype=dtype) * 0.02) for _ in range(16)]
    opt = optimizer(mode, params, 1e-5)
    times = []
    for _ in range(22):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lrs", default="1e-5,1e-6")
    ap.add_argument("--timing-params", type=int, default=20_000_000)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers.utils import logging

    logging.disable_progress_bar()
    out: dict = {"steps": args.steps, "runs": {}, "step_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(tmp + "/model", arch="qwen2", seed=0)
        from safetensors.torch import load_file, save_file

        f = Path(model_dir) / "model.safetensors"
        save_file({k: v.to(torch.bfloat16).float() for k, v in load_file(str(f)).items()}, str(f))
        for lr in map(float, args.lrs.split(",")):
            runs = {mode: train(model_dir, mode, lr, args.steps) for mode in MODES}
            start = {k: v.to(torch.bfloat16).float() for k, v in load_file(str(f)).items()}
            start = {name: start.get(name, start.get("model.embed_tokens.weight")) for name in runs["fp32"][0]}
            ref = runs["fp32"][0]
            for mode, (w, losses, per_param, carried) in runs.items():
                rel, kept = drift(w, ref, start)
                out["runs"][f"{mode} lr={lr:g}"] = {"bytes_per_param": round(per_param, 2), "drift": rel,
                                                    "moved_share": kept, "loss_first": losses[0],
                                                    "loss_last": losses[-1]}
                if carried is not None:
                    out["runs"][f"{mode} lr={lr:g}"]["drift_with_compensation"] = drift(carried, ref, start)[0]
    for mode in ("fp32", "bf16 Kahan", "bf16 plain"):
        out["step_s"][mode] = step_time(mode, args.timing_params)
    print(f"{'run':<22} {'B/param':>7} {'drift':>8} {'+comp':>8} {'moved':>7} {'loss last':>10}")
    for name, r in out["runs"].items():
        comp = f"{r['drift_with_compensation']:.4f}" if "drift_with_compensation" in r else "-"
        print(f"{name:<22} {r['bytes_per_param']:>7.2f} {r['drift']:>8.4f} {comp:>8} {r['moved_share']:>7.3f} "
              f"{r['loss_last']:>10.5f}")
    print(f"optimizer step, {args.timing_params / 1e6:.0f} M parameters: " +
          ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in out["step_s"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
