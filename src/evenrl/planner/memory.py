"""Per-rank memory estimate from a local Hugging Face config.json, and the knobs that make a run fit.

    evenrl plan CONFIG --nproc-per-node 4 --device cuda --device-memory-gib 80   # shows the breakdown

Model: decoder-only Llama/Qwen2/Qwen3/Mistral-like (hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, vocab_size, tie_word_embeddings). Mixture-of-experts and
encoder-decoder configs are refused with a message; the planner then skips the estimate.

Bytes per rank, p = bytes of model.dtype, P = parameter count, T = training ranks, t = tokens of the largest
micro-batch, S = sharding divisor (T under fsdp, else 1):
  parameters       P*p/S                (0 with cpu_offload=full: FSDP keeps them on the host)
  gradients        P*p/S                (0 with cpu_offload=full)
  optimizer        P*(8 + 4*[p<4])/S    AdamW: two fp32 moments, plus an fp32 master copy when p is 16-bit
                                        (0 with cpu_offload=optimizer|full)
  fsdp gather      2 * max(layer, embedding) * p   unsharded units in flight (fsdp, T > 1)
  activations      t * L * a * p        a = 4h + 2*q_dim + 2*kv_dim + 4i  elements per token per layer
                   t * (L*h + a) * p    with gradient checkpointing: each layer's input, plus one layer recomputed
  logits           t * V * 12           fp32 logits, their log-softmax and its gradient (the usual hidden OOM)
  reference        P*p/S                when algo.kl_coef > 0 (frozen, no gradients or optimizer state)
  rollout reserve  memory_fraction * device memory
  KV cache         g * (prompt + new) * L * 2 * kv_dim * p   g = samples this rank generates (HF sampler)
  overhead         1 GiB on cuda (context, allocator), 0.3 GiB on cpu
peak = parameters + optimizer + gather + reference + reserve + overhead
       + max(gradients + activations + logits, KV cache)      (training and generation do not overlap)

The activation count adapts Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198, sec. 4.1: 34*s*b*h + 5*a*s^2*b bytes per layer for GPT in 16-bit) to SwiGLU MLPs
(gate, up, SiLU(gate), product: 4i), grouped-query attention (q, k, v, context: 2*q_dim + 2*kv_dim), RMSNorm
inputs (2h), the inputs of the QKV and MLP projections (2h), no dropout masks, and SDPA/flash attention (no
s^2 score matrix). Worst case: every sample is max_prompt_tokens + max_new_tokens long.
g comes from the trainer's own rollout split (evenrl.core.schedule.rollout_shares), so the estimate follows any
change to it; past SPLIT_MAX samples per step that split costs too much time for a preflight (the planner sizes
fixes by bisection, re-estimating each time), and g is the bound it keeps: within one sample of the busiest
rank's weighted share.
Pure Python: the planner imports this without torch.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evenrl.config import RunConfig, with_settings
from evenrl.core.schedule import rollout_shares
from evenrl.planner.layout import Layout

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGIT_BYTES = 12  # fp32 logits + fp32 log-softmax + fp32 gradient, per token per vocab entry
OVERHEAD_GIB = {"cuda": 1.0, "cpu": 0.3}
SPLIT_MAX = 20_000  # samples per step beyond which the rollout split is bounded, not computed (module docstring)
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    max_positions: int | None

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @property
    def act_elems(self) -> int:
        """Saved activation elements per token per layer (module docstring)."""
        h = self.hidden
        return 4 * h + 2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim + 4 * self.intermediate


def dims_from_config(hf: dict) -> ModelDims:
    """ModelDims from a config.json dict; ValueError names what is missing or unsupported."""
    if not isinstance(hf, dict):
        raise ValueError("config.json is not a JSON object")
    hf = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    kind = str(hf.get("model_type", "unknown"))
    moe = [k for k in _MOE_KEYS if hf.get(k)]
    if moe:
        raise ValueError(f"model_type {kind!r} is a mixture-of-experts model ({moe[0]}); "
                         "the estimate covers dense decoder-only models")
    need = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    missing = [k for k in need if not isinstance(hf.get(k), int) or hf.get(k) <= 0]
    if missing:
        raise ValueError(f"model_type {kind!r}: config.json lacks {', '.join(missing)}; the estimate covers "
                         "Llama/Qwen2/Mistral-like decoder-only models")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return ModelDims(kind, hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], heads, int(kv),
                     int(head_dim), hf["vocab_size"], bool(hf.get("tie_word_embeddings", False)),
                     bool(hf.get("attention_bias", kind == "qwen2")), kind in ("qwen3",),
                     hf.get("max_position_embeddings"))


def read_model_dims(model_path: str) -> ModelDims:
    """Dims from `<model_path>/config.json`; ValueError with a one-line reason otherwise."""
    p = Path(model_path).expanduser()
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file():
        raise ValueError(f"{cfg}: no such file")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg}: unreadable JSON ({e.__class__.__name__})") from None
    return dims_from_config(data)


# ------------------------------------------------------------------------------------------ estimate

@dataclass
class MemoryEstimate:
    breakdown: dict[str, float]  # GiB per component, display order
    total_gib: float
    capacity_gib: float  # 0 = unknown
    params: int
    micro_tokens: int
    rollout_samples: int
    host_gib: float  # offloaded to host memory (per rank)
    assumptions: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        return None if not self.capacity_gib else self.total_gib <= self.capacity_gib

    def to_dict(self) -> dict:
        return {"breakdown_gib": {k: round(v, 3) for k, v in self.breakdown.items()},
                "total_gib": round(self.total_gib, 3), "capacity_gib": round(self.capacity_gib, 3),
                "fits": self.fits, "params": self.params, "micro_tokens": self.micro_tokens,
                "rollout_samples_per_rank": self.rollout_samples, "host_gib": round(self.host_gib, 3),
                "assumptions": self.assumptions}


def worst_case_shape(cfg: RunConfig, layout: Layout) -> tuple[int, int]:
    """(tokens of the largest micro-batch, samples the busiest rank generates), all samples at max length."""
    t = max(layout.training_ranks, 1)
    w = layout.capacity_weights or cfg.parallel.capacity_weights
    weights = tuple(w) if w and len(w) == t else None
    share = max(weights) / sum(weights) if weights else 1 / t
    length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    per_mb = math.ceil(cfg.samples_per_step() / cfg.algo.minibatches_per_step)
    rows_rank = max(1, math.ceil(per_mb * share - 1e-9))
    rows = min(rows_rank, max(1, cfg.train.token_cap_per_micro_batch // length, cfg.train.min_rows_per_micro_batch))
    gen = _busiest_rollout(cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, length, t, weights)
    return rows * length, gen


@functools.lru_cache(maxsize=256)
def _busiest_rollout(prompts: int, k: int, length: int, world: int, weights: tuple[float, ...] | None) -> int:
    """Samples the busiest rank generates: the trainer's own split (rollout_shares) with every prompt at `length`.
    Past SPLIT_MAX samples, the bound that split keeps instead (within one sample of the rank's weighted share)."""
    if prompts * k > SPLIT_MAX:
        share = max(weights) / sum(weights) if weights else 1 / world
        return max(1, math.ceil(prompts * k * share - 1e-9))
    shares = rollout_shares([float(length)] * prompts, k, world, weights)
    return max(1, max(sum(count for _, _, count in mine) for mine in shares))


def estimate_memory(cfg: RunConfig, layout: Layout, dims: ModelDims) -> MemoryEstimate:
    p = DTYPE_BYTES[cfg.model.dtype]
    t = max(layout.training_ranks, 1)
    par = cfg.parallel
    shard = t if par.sharding == "fsdp" else 1
    offload = par.cpu_offload
    notes = [f"AdamW: 2 fp32 moments{' + fp32 master weights' if p < 4 else ''} per parameter",
             "attention via SDPA/flash (no s^2 scores); worst case: every sample at max length"]
    if offload == "full" and par.sharding != "fsdp":
        offload = "optimizer"
        notes.append("cpu_offload=full needs sharding=fsdp; estimated as cpu_offload=optimizer")
    tokens, gen = worst_case_shape(cfg, layout)
    P = dims.params
    params_b = 0 if offload == "full" else P * p / shard
    grads_b = 0 if offload == "full" else P * p / shard
    opt_b = P * (8 + (4 if p < 4 else 0)) / shard
    host = opt_b if offload != "none" else 0
    if offload == "full":
        host += 2 * P * p / shard
    if offload != "none":
        opt_b = 0
    gather = 2 * max(dims.layer_params, dims.vocab * dims.hidden) * p if shard > 1 else 0
    L = dims.layers
    if cfg.model.gradient_checkpointing:
        act = tokens * (L * dims.hidden + dims.act_elems) * p
    else:
        act = tokens * L * dims.act_elems * p
    logits = tokens * dims.vocab * LOGIT_BYTES
    ref = P * p / shard if cfg.algo.kl_coef > 0 else 0
    reserve = cfg.rollout.memory_fraction * layout.device_memory_gib * GIB
    length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    kv = gen * length * L * 2 * dims.kv_heads * dims.head_dim * p
    overhead = OVERHEAD_GIB[layout.device] * GIB
    parts = {"parameters": params_b, "gradients": grads_b, "optimizer": opt_b, "fsdp gather": gather,
             "activations": act, "logits": logits, "reference model": ref, "rollout reserve": reserve,
             "KV cache": kv, "overhead": overhead}
    total = params_b + opt_b + gather + ref + reserve + overhead + max(grads_b + act + logits, kv)
    return MemoryEstimate({k: v / GIB for k, v in parts.items()}, total / GIB, layout.device_memory_gib, P,
                          tokens, gen, host / GIB, notes)


# ------------------------------------------------------------------------------------------ fixes

@dataclass(frozen=True)
class MemoryFix:
    settings: dict[str, Any]  # dotted key -> value
    total_gib: float  # estimated peak after applying this fix alone
    fits: bool
    why: str = ""

    def text(self) -> str:
        s = " ".join(f"{k}={_show(v)}" for k, v in self.settings.items())
        return f"{s}{f' ({self.why})' if self.why else ''} -> {self.total_gib:.1f} GiB"


def _show(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def memory_fixes(cfg: RunConfig, layout: Layout, dims: ModelDims) -> list[MemoryFix]:
    """Each knob applied alone, with the estimated peak after it; best first. Knobs that do not lower the
    estimate are left out. Needs a known device memory to size the token cap and prompt count."""
    cap = layout.device_memory_gib
    base = estimate_memory(cfg, layout, dims).total_gib
    fixes: list[MemoryFix] = []

    def add(settings: dict, why: str = "") -> None:
        try:
            total = estimate_memory(with_settings(cfg, settings), layout, dims).total_gib
        except ValueError:  # a setting the config refuses (pydantic's ValidationError is a ValueError)
            return
        if total < base - 1e-6:
            fixes.append(MemoryFix(settings, total, bool(cap) and total <= cap, why))

    length = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    rows = estimate_memory(cfg, layout, dims).micro_tokens // length
    if rows > 1:
        key = "train.token_cap_per_micro_batch"
        best = _largest(1, rows - 1, lambda r: _fits(cfg, layout, dims, {key: r * length}))
        r = best or 1
        add({"train.token_cap_per_micro_batch": r * length}, f"{r} row{'s' if r > 1 else ''} per micro-batch")
    if not cfg.model.gradient_checkpointing:
        add({"model.gradient_checkpointing": True})
    if cfg.parallel.cpu_offload == "none":
        add({"parallel.cpu_offload": "optimizer"})
    if cfg.parallel.sharding == "replicated" and layout.training_ranks > 1:
        add({"parallel.sharding": "fsdp"}, f"over {layout.training_ranks} ranks")
    if cfg.parallel.cpu_offload != "full":
        add({"parallel.sharding": "fsdp", "parallel.cpu_offload": "full"} if cfg.parallel.sharding == "replicated"
            else {"parallel.cpu_offload": "full"})
    if cfg.algo.kl_coef > 0:
        add({"algo.kl_coef": 0.0}, "no reference model")
    if cfg.rollout.memory_fraction > 0:
        add({"rollout.memory_fraction": 0.0})
    if cfg.model.dtype == "float32" and layout.device == "cuda":
        add({"model.dtype": "bfloat16"})
    prompts = cfg.data.prompts_per_step
    if prompts > 1:
        best = _largest(1, prompts - 1, lambda n: _fits(cfg, layout, dims, {"data.prompts_per_step": n}))
        add({"data.prompts_per_step": best or 1}, "fewer samples per rank")
    fixes.sort(key=lambda f: f.total_gib)
    return fixes


def _fits(cfg: RunConfig, layout: Layout, dims: ModelDims, settings: dict) -> bool:
    if not layout.device_memory_gib:
        return False
    return estimate_memory(with_settings(cfg, settings), layout, dims).total_gib <= layout.device_memory_gib


def _largest(lo: int, hi: int, ok) -> int | None:
    """Largest n in [lo, hi] with ok(n), for ok monotone (true up to some n); None when ok(lo) is false."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
