"""Two of benchmarks/gpu_suite.py's in-process sections (run in gpu_suite_kernels.py's process, on its model):

  attention  the training forward + backward of one variable-length micro-batch by evenrl's two paths for a plain
             Qwen2/Llama: `segments` (models/split_forward.py at sequence-parallel size 1: the model's own forward
             over one packed row, attention within each row, rows of about one length in one SDPA call) and `masked`
             (the model's own left-padded masked forward, the reference path). Tokens/s over real tokens, the padding
             share, and the log-probs against `masked`. The hand-written packed forward and the right-padded one went
             with issue 43 (benchmarks/results/gpu-suite-2026-11-27.md has all four on one H200).
  moe        one Qwen3-30B-A3B-shaped mixture-of-experts block (transformers' Qwen3MoeSparseMoeBlock: 128 experts,
             top-8, hidden 2048, expert width 768) forward + backward in bf16 by transformers' experts backends
             `grouped_mm` and `eager` (a loop over experts): tokens/s and TFLOP/s of the active experts, outputs
             against `grouped_mm`. What expert parallelism's local compute will run on.

On CPU (the rehearsal) both run at small sizes; their numbers say nothing about a GPU.
"""

from __future__ import annotations

import statistics

import torch

from evenrl.core.batch import Batch, Ragged
from evenrl.core.fused_head import head_logprobs
from evenrl.core.model_plan import record
from evenrl.models import forward as fw
from evenrl.models.loading import autocast, set_autocast
from gpu import one_line


def _head(layer, hidden, targets):
    logp, _ = head_logprobs(hidden, layer.weight, layer.bias, targets, 1.0)
    return logp[..., None]


def _varlen_batch(ctx, rows: int, longest: int, seed: int = 3) -> Batch:
    """`rows` prompts + responses whose lengths are lognormal (median longest/6, clipped to [8, longest]): the
    long tail of reasoning RL, where one micro-batch mixes short and long samples."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.exp(torch.randn(rows, generator=g) * 0.8 + torch.log(torch.tensor(longest / 6.0)))
    lens = lens.clamp(8, longest).long()
    lens[0] = longest  # one sample at the limit, as a long-tail batch has
    tokens, resp = [], []
    for i in range(rows):
        p = ctx.prompts[i % len(ctx.prompts)]
        tokens.append(torch.tensor(p + torch.randint(4, len(ctx.tok) - 1, (int(lens[i]),), generator=g).tolist()))
        resp.append(int(lens[i]))
    return Batch({"tokens": Ragged.of(tokens, torch.long), "response_len": torch.tensor(resp)})


def sec_attention(ctx) -> dict:
    cuda = ctx.dev.type == "cuda"
    rows, longest = (32, 1024) if cuda else (8, 48)
    batch = _varlen_batch(ctx, rows, longest)
    lengths = batch["tokens"].lengths
    real, padded = int(lengths.sum()), rows * int(lengths.max())
    model = ctx.model
    set_autocast(model, torch.bfloat16) if cuda else None
    paths = {"masked": lambda m, b, h: fw._response_logits_model(m, b, ctx.pad, h),  # Ctx's model trains packed
             "segments": lambda m, b, h: fw.split_forward(m, b, h, fw._output_layer_computes)}
    out, ref = {}, None
    try:
        for name, path in paths.items():
            def once():
                model.zero_grad(set_to_none=True)
                with autocast(model):
                    logp, _, mask = path(model, batch, _head)
                (logp[..., 0] * mask).sum().backward()
                return logp[..., 0].detach().float()[mask]
            try:
                lp = once()  # warm-up
                secs = []
                for _ in range(max(2, ctx.spec["reps"] + 1)):
                    s, lp = ctx.timed(once)
                    secs.append(s)
                ref = lp if ref is None else ref
                s = statistics.median(secs)
                out[name] = {"fwd_bwd_s": s, "real_tokens_per_s": real / s,
                             "max_abs_dlogp_vs_masked": float((lp - ref).abs().max())}
            except Exception as e:  # noqa: BLE001 - one path failing leaves the others' numbers
                out[name] = {"error": one_line(e)}
    finally:
        model.zero_grad(set_to_none=True)
        record(model).autocast = None
        ctx.free()
    return {"rows": rows, "longest_response": longest, "real_tokens": real, "padded_tokens": padded,
            "padding_share": 1 - real / padded, "precision": "bf16-autocast" if cuda else "fp32", "paths": out}


def sec_moe(ctx) -> dict:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cuda = ctx.dev.type == "cuda"
    # Qwen3-30B-A3B's block on the GPU; a narrow one on CPU
    hidden, inter, experts, top_k, tokens = (2048, 768, 128, 8, 8192) if cuda else (64, 32, 8, 2, 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).to(ctx.dev, dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, hidden, device=ctx.dev, dtype=dtype)
    g = torch.randn_like(x)
    flop = 3 * 2 * tokens * top_k * 3 * hidden * inter  # forward + backward, three expert matmuls per token-expert
    out, ref = {}, None
    for impl in ("grouped_mm", "eager"):  # batched_mm gathers a weight copy per token-expert pair: 412 GB here
        cfg._experts_implementation = impl
        xi = x.clone().requires_grad_()

        def once():
            block.zero_grad(set_to_none=True)
            xi.grad = None
            y = block(xi)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(g)
            return y.detach().float()
        try:
            once()
            secs = []
            for _ in range(max(2, ctx.spec["reps"] + 1)):
                s, y = ctx.timed(once)
                secs.append(s)
            ref = y if ref is None else ref
            s = statistics.median(secs)
            out[impl] = {"fwd_bwd_s": s, "tokens_per_s": tokens / s, "expert_tflops": flop / s / 1e12,
                         "max_abs_dy_vs_first": float((y - ref).abs().max())}
        except Exception as e:  # noqa: BLE001 - an unavailable backend leaves the others' numbers
            out[impl] = {"error": one_line(e)}
        ctx.free()
    del block, x, g
    ctx.free()
    return {"hidden": hidden, "expert_width": inter, "experts": experts, "top_k": top_k, "tokens": tokens,
            "dtype": str(dtype).removeprefix("torch."), "backends": out}
