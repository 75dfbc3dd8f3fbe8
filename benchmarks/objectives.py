"""Loss modes and rollout-correction modes side by side: a tiny run of each, and each correction's policy-gradient
bias under a bf16 engine against an fp64 reference.

Run: .venv/bin/python benchmarks/objectives.py [--steps 20 --skip-runs --skip-bias --warm DIR]

Part 1, runs. The demo's task (one-digit addition, exact-match reward) and model (a random Qwen2 with a character
tokenizer, given the demo's supervised warm start once, so the reward can move), then the same GRPO run (same
prompts, samples, seed, steps; algo.minibatches_per_step=2 so the second optimizer step is off-policy and the clips
can bite; model.dtype=bfloat16, so the engine's log-probs differ from the trainer's) with each algo.policy_loss and
each importance level x mode on every sample (importance_correction=all). Per run: the median step time (the first
step left out), the mean clip share, the mean shares of tokens and sequences truncated or masked, and the mean reward
of the first and last 5 steps.

Part 2, bias. The warm-started model's distribution over every 2-token completion of a few prompts is enumerated
exactly (no sampling noise): pi in fp64 (the trainer's policy and the reference), mu the same weights cast to bf16 (a
bf16 engine samples from mu). For a reward r(y) (exact match of the answer's first digit) with baseline E_pi[r],
the true policy gradient is g = sum_y pi(y) A(y) sum_t grad log pi(y_t | y_<t). Sampling from mu, each correction mode
estimates sum_y mu(y) sum_t w_t(y) A(y) grad log pi(y_t | y_<t) with evenrl.core.importance's weights (w = 1: no
correction; "no threshold": the plain ratio, where sequence-level weights are exactly unbiased, a check of the
method). Printed: the relative bias |E - g| / |g| and the cosine between them, and E_mu[w^2] averaged over tokens
(the weights' second moment: the variance they add). Prints numbers only; nothing here asserts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from overlap import run  # evenrl CLI in a subprocess (this script's folder is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parents[1]

LOSSES = {
    "ppo": [],
    "ppo dual clip c=3": ["algo.clip_ratio_c=3"],
    "gspo (3e-4/4e-4, seq-mean-token-mean)": ["algo.policy_loss=gspo", "algo.clip_low=0.0003",
                                              "algo.clip_high=0.0004", "algo.loss_aggregation=seq-mean-token-mean"],
    "cispo (clip_low 10, clip_high 4)": ["algo.policy_loss=cispo", "algo.clip_low=10", "algo.clip_high=4"],
    "dr_grpo + seq-mean-token-sum-norm": ["algo.advantage=dr_grpo", "algo.loss_aggregation=seq-mean-token-sum-norm"],
}
CORRECTIONS = {
    "none": ["algo.importance_correction=none"],
    "token truncate [0, 2]": ["algo.importance_correction=all"],
    "token mask [0.5, 2]": ["algo.importance_correction=all", "algo.importance_mode=mask", "algo.importance_floor=0.5"],
    "token mask [0.99, 1.01]": ["algo.importance_correction=all", "algo.importance_mode=mask",
                                "algo.importance_floor=0.99", "algo.importance_cap=1.01"],
    "sequence truncate [0, 2]": ["algo.importance_correction=all", "algo.importance_level=sequence"],
    "sequence mask [0.5, 2]": ["algo.importance_correction=all", "algo.importance_level=sequence",
                               "algo.importance_mode=mask", "algo.importance_floor=0.5"],
    "geometric mask [0.99, 1.01]": ["algo.importance_correction=all", "algo.importance_level=geometric",
                                    "algo.importance_mode=mask", "algo.importance_floor=0.99",
                                    "algo.importance_cap=1.01"],
}
# (level, mode, floor, cap) of part 2; None: no correction
BIAS_MODES = {"none": None, "token, no threshold": ("token", "truncate", 0.0, float("inf")),
              "token truncate [0, 2]": ("token", "truncate", 0.0, 2.0),
              "token truncate [0, 1.01]": ("token", "truncate", 0.0, 1.01),
              "token mask [0.99, 1.01]": ("token", "mask", 0.99, 1.01),
              "sequence, no threshold": ("sequence", "truncate", 0.0, float("inf")),
              "sequence truncate [0, 2]": ("sequence", "truncate", 0.0, 2.0),
              "sequence truncate [0, 1.01]": ("sequence", "truncate", 0.0, 1.01),
              "sequence mask [0.99, 1.01]": ("sequence", "mask", 0.99, 1.01),
              "geometric truncate [0, 2]": ("geometric", "truncate", 0.0, 2.0),
              "geometric mask [0.99, 1.01]": ("geometric", "mask", 0.99, 1.01)}


def summary(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows]

    def mean(key):
        return statistics.mean(r.get(key, 0.0) for r in rows)

    return {"step_s": statistics.median(r["time/step"] for r in rows[1:]), "clip": mean("policy/clip_fraction"),
            "dual": mean("policy/dual_clip_fraction"), "is_cut": mean("policy/is_clipped_fraction"),
            "is_masked": mean("policy/is_masked_fraction"), "seq_cut": mean("policy/is_clipped_seq_fraction"),
            "seq_masked": mean("policy/is_masked_seq_fraction"), "mismatch": mean("rollout/logprob_mismatch"),
            "first": statistics.mean(rewards[:5]), "last": statistics.mean(rewards[-5:])}


def runs_table(out: Path, model: Path, data: Path, steps: int, env: dict) -> None:
    cfg = str(ROOT / "examples" / "demo.yaml")
    shape = ["eval.path=''", "log.samples_every_steps=0", "log.progress=false", "log.tensorboard=false",
             f"model.path={model}", f"data.path={data}", f"train.steps={steps}", "checkpoint.every_steps=0",
             "model.dtype=bfloat16", "algo.minibatches_per_step=2"]
    arms = {**{f"loss: {k}": v for k, v in LOSSES.items()},
            **{f"correction: {k}": v for k, v in CORRECTIONS.items()}}
    print(f"\n{'arm':46s} {'step ms':>8s} {'clip':>6s} {'dual':>6s} {'IS cut tok/seq':>15s} "
          f"{'masked tok/seq':>15s} {'reward first5 -> last5':>23s}", flush=True)
    for name, extra in arms.items():
        run_dir = out / name.replace(" ", "_").replace(":", "").replace("/", "_")
        run(["train", cfg, *shape, *extra, f"log.run_dir={run_dir}", "--overwrite"], env)
        s = summary(run_dir)
        print(f"{name:46s} {s['step_s'] * 1e3:8.0f} {s['clip']:6.3f} {s['dual']:6.3f} "
              f"{s['is_cut']:7.3f}/{s['seq_cut']:.3f} {s['is_masked']:7.3f}/{s['seq_masked']:.3f} "
              f"{s['first']:10.3f} -> {s['last']:.3f}", flush=True)
    print(f"(engine/trainer mismatch, mean |log-prob diff| of sampled tokens, last arm: {s['mismatch']:.2e})")


def bias_table(model_dir: Path, prompts: list[str], answers: list[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evenrl.core.importance import importance_weights

    tok = AutoTokenizer.from_pretrained(model_dir)
    pi = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    mu = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(torch.bfloat16).eval()
    vocab = len(tok)
    params = [p for p in pi.parameters() if p.requires_grad]
    parts: dict[str, list] = {name: [] for name in BIAS_MODES}
    second: dict[str, float] = {name: 0.0 for name in BIAS_MODES}
    reference = []
    for prompt, answer in zip(prompts, answers):
        ids = tok(prompt, return_tensors="pt")["input_ids"][0]
        ys = torch.tensor(list(itertools.product(range(vocab), repeat=2)))  # every 2-token completion
        seqs = torch.cat([ids.expand(len(ys), -1), ys], dim=1)
        p = len(ids)

        def token_logp(model, dtype):
            logits = model(seqs).logits[:, p - 1:-1].to(dtype)
            return torch.log_softmax(logits, -1).gather(-1, ys[..., None]).squeeze(-1)  # [N, 2]

        with torch.no_grad():
            mu_t = token_logp(mu, torch.float64)
        logp = token_logp(pi, torch.float64)  # with grad
        pi_seq = logp.detach().sum(-1).exp()
        mu_seq = mu_t.sum(-1).exp()
        reward = torch.tensor([float(tok.decode(y[:1]).strip() == answer[:1]) for y in ys], dtype=torch.float64)
        adv = reward - (pi_seq * reward).sum()  # baseline: E_pi[r]
        mask = torch.ones_like(logp, dtype=torch.bool)
        objectives = {"__true__": (pi_seq[:, None] * adv[:, None] * logp).sum()}
        for name, how in BIAS_MODES.items():
            w = torch.ones_like(logp) if how is None else importance_weights(
                logp.detach(), mu_t, how[3], mask, level=how[0], mode=how[1], floor=how[2])[0]
            objectives[name] = (mu_seq[:, None] * w * adv[:, None] * logp).sum()
            second[name] += float((mu_seq[:, None] * w.square()).sum() / 2) / len(prompts)
        for name, obj in objectives.items():
            grads = torch.autograd.grad(obj, params, retain_graph=True)
            flat = torch.cat([g.reshape(-1) for g in grads])
            (reference if name == "__true__" else parts[name]).append(flat)
        gap = float((logp.detach() - mu_t).abs().max())
        print(f"prompt {prompt!r}: E_pi[r] = {float((pi_seq * reward).sum()):.3f}, total mass of mu "
              f"{float(mu_seq.sum()):.6f}, max |log pi - log mu| per token {gap:.3g}", flush=True)
    g = torch.stack(reference).sum(0)
    print(f"\n{'correction (sampling from bf16 mu)':34s} {'|E - g| / |g|':>14s} {'cos(E, g)':>10s} {'E_mu[w^2]':>10s}")
    for name in BIAS_MODES:
        e = torch.stack(parts[name]).sum(0)
        rel = float((e - g).norm() / g.norm())
        cos = float(torch.dot(e, g) / (e.norm() * g.norm()))
        print(f"{name:34s} {rel:14.3e} {cos:10.6f} {second[name]:10.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4, help="prompts whose completions part 2 enumerates")
    ap.add_argument("--skip-runs", action="store_true")
    ap.add_argument("--skip-bias", action="store_true")
    ap.add_argument("--out", default="", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--warm", default="", help="a warm-started model directory (OUT/sft/final of an earlier run) to "
                                               "reuse instead of running the demo's SFT again")
    args = ap.parse_args()
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": path}
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from evenrl.demo import write_addition_data
    from evenrl.testing import make_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        data = out / "addition.jsonl"
        write_addition_data(data)
        warm = Path(args.warm) if args.warm else out / "sft" / "final"
        if not args.warm:
            model = make_tiny_model(str(out / "model"), arch="qwen2", seed=0)
            t0 = time.perf_counter()
            run(["sft", str(ROOT / "examples" / "demo.yaml"), "eval.path=''", "log.progress=false",
                 "log.tensorboard=false", f"model.path={model}", f"data.path={data}", f"log.run_dir={out / 'sft'}",
                 "--overwrite"], env)
            print(f"warm start (evenrl sft, the demo's): {time.perf_counter() - t0:.0f} s", flush=True)
        if not args.skip_runs:
            runs_table(out, warm, data, args.steps, env)
        if not args.skip_bias:
            rows = [json.loads(x) for x in data.read_text().splitlines()][:args.prompts]
            bias_table(warm, [r["prompt"] for r in rows], [str(r["answer"]) for r in rows])
    print(f"\nCPU, {os.cpu_count()} cores, 1 thread; torch {torch.__version__}; {args.steps} steps per run")


if __name__ == "__main__":
    main()
