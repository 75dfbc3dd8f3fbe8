"""Mixtures of experts on CPU: the experts' throughput by transformers' experts backend, and the engine-trainer
mismatch a bf16 engine leaves, with and without router replay. Numbers side by side; nothing asserts.

Run: .venv/bin/python benchmarks/moe.py [--tokens 2048] [--repeats 5] [--prompts 32]
(~1 min on the shared 2-core project machine, 1 thread)

experts   One Qwen3-MoE-shaped experts layer (hidden 256, 16 experts of width 128, top 4, fp32), the same routed
          tokens through transformers' `grouped_mm` (torch.nn.functional.grouped_mm: one grouped GEMM per
          projection, the default when a model is built or loaded) and `eager` (a Python loop over the experts hit),
          forward alone and forward + backward: tokens/s, median of --repeats. `batched_mm` is left out: 5-20x slower
          than the loop on CPU (../shared FIELD_NOTES).
mismatch  A tiny model of each family with random weights, sampled by the hf engine on a bf16 copy of its weights
          (bf16 autocast: what a bf16 engine or rollout rank holds) for --prompts prompts x 4 samples x 16 tokens, the
          engine recording each token's routes; the fp32 trainer then routes the same tokens itself (no replay) and
          replays the engine's routes (rollout.router_replay=engine): the share of routed tokens whose top-k set
          differs (per layer, in any layer) and |engine - trainer| log-prob over the sampled tokens, mean and max,
          without and with replay (what evenrl.train.moe.probe and rollout/logprob_mismatch report per step).
EP        expert parallelism is not built yet: its rows (step time and memory at EP 1, 2, 4, planned beside
          measured) come with it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch


def experts_rows(tokens: int, repeats: int) -> list[tuple[str, float, float]]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 256, generator=g)
    logits = torch.randn(tokens, 16, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(4, dim=-1)
    rows = []
    for impl in ("grouped_mm", "eager"):
        cfg._experts_implementation = impl
        torch.manual_seed(0)
        layer = Qwen3MoeExperts(cfg)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        timed = {}
        for name, backward in (("forward", False), ("forward+backward", True)):
            runs = []
            for _ in range(repeats + 1):  # the first is a warm-up
                h = x.clone().requires_grad_(backward)
                start = time.perf_counter()
                if backward:
                    layer(h, ids, weights).sum().backward()
                else:
                    with torch.no_grad():
                        layer(h, ids, weights)
                runs.append(time.perf_counter() - start)
            timed[name] = tokens / statistics.median(runs[1:])
        rows.append((impl, timed["forward"], timed["forward+backward"]))
    return rows


def mismatch_row(arch: str, prompts: int, root: str) -> dict:
    from evenrl.core.batch import Batch, Ragged
    from evenrl.distributed.sequence import SequenceGroup, sequence_parallel
    from evenrl.engines.base import SamplingParams
    from evenrl.engines.hf import HFEngine
    from evenrl.models import routing
    from evenrl.models.loading import load_policy, set_autocast
    from evenrl.testing import make_tiny_model
    from evenrl.train import moe
    from evenrl.train.update import compute_logprobs

    trainer, tok = load_policy(make_tiny_model(f"{root}/{arch}", arch=arch, seed=3))
    sequence_parallel(trainer, SequenceGroup(None, 1, 0))
    engine_model = copy.deepcopy(trainer)
    set_autocast(engine_model, torch.bfloat16)
    engine = HFEngine(engine_model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id,
                      record_routes=True)
    ids = [tok(f"{i}+{3 * i + 1}=")["input_ids"] for i in range(prompts)]
    res = engine.generate(ids, list(range(prompts)), SamplingParams(max_new_tokens=16, samples_per_prompt=4, seed=2),
                          step=1)
    rows = [(p, c) for p, r in zip(ids, res) for c in r]
    batch = Batch({"tokens": Ragged.of([torch.tensor(p + c.token_ids) for p, c in rows], torch.long),
                   "response_len": torch.tensor([len(c.token_ids) for _, c in rows]),
                   "engine_logp": Ragged.of([torch.tensor(c.logprobs) for _, c in rows], torch.float32),
                   "routes": Ragged.of([c.routes for _, c in rows], routing.routing(trainer).dtype)})
    micro = [list(range(i, min(i + 16, len(batch)))) for i in range(0, len(batch), 16)]
    live = moe.probe(trainer, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
    with routing.options(trainer, replay=False):
        own = compute_logprobs(trainer, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
    replayed = compute_logprobs(trainer, batch, micro, temperature=1.0, pad_token_id=tok.pad_token_id)
    gaps = {name: torch.cat([(t - torch.tensor(c.logprobs)).abs() for t, (_, c) in zip(lp, rows)])
            for name, lp in (("own", own), ("replay", replayed))}
    return {"arch": arch, "tokens": sum(len(p) + len(c.token_ids) - 1 for p, c in rows),
            "per_layer": live["moe/routes_differ"], "any": live["moe/routes_differ_any_layer"],
            **{f"{k}_{s}": float(getattr(v, s)()) for k, v in gaps.items() for s in ("mean", "max")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    print(f"\nexperts layer: {args.tokens} tokens, hidden 256, 16 experts x 128, top 4, fp32 (tokens/s)")
    print(f"  {'backend':<12} {'forward':>12} {'fwd+bwd':>12}")
    for impl, fwd, both in experts_rows(args.tokens, args.repeats):
        print(f"  {impl:<12} {fwd:12,.0f} {both:12,.0f}")
    print(f"\nbf16 engine vs fp32 trainer: {args.prompts} prompts x 4 samples x 16 tokens")
    print(f"  {'family':<12} {'tokens':>7} {'differ/layer':>20} {'any':>7}   {'|dlogp| mean':>20} {'|dlogp| max':>20}")
    print(f"  {'':<12} {'':>7} {'':>20} {'':>7}   {'no replay / replay':>20} {'no replay / replay':>20}")
    with tempfile.TemporaryDirectory() as root:
        for arch in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"):
            r = mismatch_row(arch, args.prompts, root)
            layers = " ".join(f"{x:.2%}" for x in r["per_layer"])
            print(f"  {r['arch']:<12} {r['tokens']:>7} {layers:>20} {r['any']:>7.2%}   "
                  f"{r['own_mean']:>9.2e} / {r['replay_mean']:.2e} {r['own_max']:>9.2e} / {r['replay_max']:.2e}")
    print("\nexpert parallelism: EP 1 / 2 / 4 rows come with expert parallelism (not built yet)")


if __name__ == "__main__":
    main()
