"""Step-time estimate of reserved placement: generation on the rollout devices, training on the others, the weight
push between them, and what overlapping generation with training (rollout.max_staleness >= 1) saves.

    evenrl plan examples/demo.yaml rollout.max_staleness=1 --nproc-per-node 4 --rollout-devices 1
    evenrl plan CONFIG --rollout-devices 2 --device cuda --device-tflops 300 --device-gbps 1800 --link-gbps 50

An estimate from FLOPs and bytes at assumed device rates, printed with the plan, never a measurement. It is there to
compare splits of one world and to see which side of a step dominates, not to predict wall-clock time.

Symbols: N = the model's matmul weights (ModelDims.linear_params: every weight a token multiplies, the LM head
included, an untied input embedding not; in FLOPs a mixture of experts' active ones, Na: a token's top-k experts
of each MoE layer, while a weight read or pushed is every expert's), P = all parameters, c = bytes of model.dtype (4 or 2), L = layers,
kv = 2 * kv_heads * head_dim (keys and values per layer and token); p = data.max_prompt_tokens,
g = tokens sampled per sample (rollout.max_new_tokens; with rollout.env the most its turns sample),
n = rollout.samples_per_prompt, S = samples per step, R = rollout devices, T = training ranks. Rates per device:
F FLOP/s, B bytes/s, f the shortest forward pass, link bytes/s for the push.
Lengths are the worst case the memory estimate uses: every prompt p tokens, every response g (a trajectory's
environment turns are prefilled, not decoded: they count in the training length, not in g).

Generation, on each of the R engine replicas (the step's samples spread evenly; the busiest holds b = ceil(S / R),
all in one batch; a prompt's samples share one prefill):
  prefill   max(2Na * ceil(b / n) * p / F,  cN / B,  f)
  decode    g steps of  max(2Na * b / F,  (cN + b * (p + g/2) * L * kv * c) / B,  f)
            every step reads the weights once and the KV cache (its mean length over the g steps), or runs b
            tokens through the weights, whichever is slower: memory-bound at small batches, compute-bound at large
  generation = prefill + decode
Training, on the busiest of the T ranks: each mini-batch of m samples gives it ceil(m / T) rows of p + g tokens
(t tokens over the step) in micro-batches of at most train.token_cap_per_micro_batch tokens (u micro-steps):
  passes    per epoch (algo.epochs_per_step): forward + backward = 3 forward passes, + 1 with
            model.gradient_checkpointing (the forward again); once per step: 1 for old log-probs when
            minibatches_per_step or epochs_per_step > 1, 1 for the reference when algo.kl_coef > 0 (kl_in=loss
            and kl_in=reward both run it), and with algo.advantage=gae the critic's values (1) and its own update
            (the policy's count again per epoch)
  training  max(2Na * t * passes / F,  u * passes * f)
Weight push: one broadcast of the model in model.dtype, trainer 0 to the rollout ranks, after each update:
  push      cP / link            (model.lora: its fp32 adapters, 4A / link)
Step: synchronous (max_staleness=0)  generation + push + training: each side waits for the other;
      overlapped (max_staleness >= 1)  max(generation, training) + push: the rollout devices generate the next step
      while this one trains, so the shorter side's time is no longer waited for (min(generation, training) saved).
Best split: the R in 1..world-1 whose overlapped step is shortest (the smallest such R on a tie).
Not counted: rewards, the optimizer step, gradient all-reduce / FSDP gathers, attention's s^2 FLOPs, the
gather of a sharded model before the push, stragglers. Capacity weights are ignored (the split changes T).
Mixed devices (`evenrl plan --nodes`, or what evenrl train gathered): each side of a split has its own devices'
rates (evenrl.planner.cluster: 40% of the datasheet's TFLOP/s and 60% of its bandwidth, or as given), the
assumed ones for a model without any. Generation is split evenly over the replicas, so the slowest one sets it;
training takes the slowest training device's rate, or their mean with capacity weights (then the work follows the
speeds). So "engines on the H100s, training on the A10s" and the reverse are each estimated at their own rates.

Assumed rates (per device; --device-tflops, --device-gbps, --link-gbps replace them):
  cuda  bfloat16  396 TFLOP/s (40% of an H100's 989 dense bf16; what tuned LLM training achieves), 2,010 GB/s
                  (60% of its 3.35 TB/s HBM3, near what a decoding engine's weight reads achieve)
        float32   27 TFLOP/s (40% of 67 dense fp32: torch leaves TF32 off for matmuls), 2,010 GB/s
        push      100 GB/s within one node (NVLink broadcast), 25 GB/s across nodes (one 200-400 Gb/s NIC)
        f         1 ms (kernel launches of one forward)
  cpu   float32   0.04 TFLOP/s, 10 GB/s; bfloat16 0.002 TFLOP/s, 4 GB/s; push 1 GB/s; f 5 ms.
        Measured with torch 2.13 on the 2-core CI machine (2 threads): fp32 matmuls and linear forward+backward ran
        at 0.03-0.056 TFLOP/s, a batch-1 linear over a 64 MiB weight read it at ~14 GB/s (fp32) and ~4 GB/s (bf16),
        bf16 matmuls at 0.0002-0.002 TFLOP/s (no bf16 matrix units: 20-100x slower than fp32), a gloo broadcast of
        64 MiB between two processes at ~0.8 GB/s, and one decode step of an 80 K-parameter model (hidden 64,
        batch 128) took 5-45 ms, all of it overhead. CPU processes on one host share its cores: with more
        processes per node than this machine has cores, each default rate is scaled by cores / processes (as the
        memory plan shares the host's memory); flags are taken as given.
Pure Python: never imports torch.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, replace

from evenrl.config import RunConfig
from evenrl.planner.cluster import achieved_rates
from evenrl.planner.layout import Layout, positive_number
from evenrl.planner.adapters import adapter_params
from evenrl.planner.dims import ModelDims
from evenrl.planner.memory import GIB, compute_bytes

# (device, model.dtype) -> (TFLOP/s, GB/s); the module docstring says where each number comes from
DEVICE_RATES = {("cuda", "bfloat16"): (396.0, 2010.0), ("cuda", "float32"): (27.0, 2010.0),
                ("cpu", "float32"): (0.04, 10.0), ("cpu", "bfloat16"): (0.002, 4.0)}
LINK_GBPS = {"cuda": 100.0, "cuda-nodes": 25.0, "cpu": 1.0}
FLOOR_S = {"cuda": 0.001, "cpu": 0.005}  # the shortest forward pass
MAX_RATE = 1e7  # TFLOP/s or GB/s above any device: a typo


@dataclass(frozen=True)
class RateFlags:
    """What the user told: each replaces the assumed rate of the same name (None: assumed)."""
    tflops: float | None = None
    gbps: float | None = None
    link_gbps: float | None = None


@dataclass(frozen=True)
class Rates:
    tflops: float  # achieved dense matmul throughput per device
    gbps: float  # achieved memory bandwidth per device (decode reads)
    link_gbps: float  # weight push, trainer 0 -> rollout ranks
    floor_s: float  # shortest forward pass
    basis: str  # where they come from, e.g. "cuda bfloat16 defaults"

    def describe(self) -> str:
        return (f"{_num(self.tflops)} TFLOP/s, {_num(self.gbps)} GB/s per device, push {_num(self.link_gbps)} GB/s, "
                f"a forward >= {self.floor_s * 1e3:.3g} ms ({self.basis})")


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def assumed_rates(layout: Layout, dtype: str, told: RateFlags | None = None, cpus: int | None = None) -> Rates:
    """The rates the estimate uses on this layout: the defaults (module docstring) with the flags in their place."""
    told = told or RateFlags()
    tflops, gbps = DEVICE_RATES[(layout.device, dtype)]
    link = LINK_GBPS["cuda-nodes" if layout.device == "cuda" and layout.nnodes > 1 else layout.device]
    floor = FLOOR_S[layout.device]
    basis = f"{layout.device} {dtype} defaults"
    cpus = cpus or os.cpu_count() or 1
    if layout.device == "cpu" and layout.nproc_per_node > cpus:  # processes share the cores
        share = cpus / layout.nproc_per_node
        tflops, gbps, floor = tflops * share, gbps * share, floor / share
        basis += f", {plural_cores(cpus)} shared by {layout.nproc_per_node} processes"
    given = [name for name, v in (("--device-tflops", told.tflops), ("--device-gbps", told.gbps),
                                  ("--link-gbps", told.link_gbps)) if v is not None]
    if given:
        basis += "; " + ", ".join(given) + " as given"
    return Rates(told.tflops or tflops, told.gbps or gbps, told.link_gbps or link, floor, basis)


def plural_cores(n: int) -> str:
    return f"{n} core{'' if n == 1 else 's'}"


# ------------------------------------------------------------------------------------------ the estimate

@dataclass(frozen=True)
class StepTime:
    """One split of the world: R rollout devices, T training ranks, and the estimated seconds of each part."""
    rollout_devices: int
    training_ranks: int
    samples_per_replica: int
    prefill_s: float
    decode_s: float
    training_tokens: int  # on the busiest training rank, over the step (one epoch)
    training_s: float
    push_s: float

    @property
    def generation_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def sync_s(self) -> float:
        return self.generation_s + self.push_s + self.training_s

    @property
    def overlapped_s(self) -> float:
        return max(self.generation_s, self.training_s) + self.push_s

    @property
    def saved_s(self) -> float:
        return self.sync_s - self.overlapped_s

    def to_dict(self) -> dict:
        r = {k: round(v, 6) for k, v in (("generation_s", self.generation_s), ("prefill_s", self.prefill_s),
                                         ("decode_s", self.decode_s), ("training_s", self.training_s),
                                         ("push_s", self.push_s), ("sync_step_s", self.sync_s),
                                         ("overlapped_step_s", self.overlapped_s), ("saved_s", self.saved_s))}
        return {"rollout_devices": self.rollout_devices, "training_ranks": self.training_ranks,
                "samples_per_replica": self.samples_per_replica, "training_tokens_per_rank": self.training_tokens,
                **r}


@dataclass(frozen=True)
class Overlap:
    rates: Rates
    passes: dict[str, float]  # forward-pass equivalents of the training side, by what runs them
    at: StepTime | None  # the planned split (None when no rollout device is reserved)
    best: StepTime  # the split of the same world with the shortest overlapped step
    max_staleness: int
    weights_gib: float  # one weight version in model.dtype (the push; a checkpoint keeps max_staleness more)

    def to_dict(self) -> dict:
        r = self.rates
        return {"estimate": True,
                "rates": {"device_tflops": r.tflops, "device_gbps": r.gbps, "link_gbps": r.link_gbps,
                          "forward_floor_s": r.floor_s, "basis": r.basis},
                "max_staleness": self.max_staleness, "passes": self.passes,
                "planned": self.at.to_dict() if self.at else None, "best_split": self.best.to_dict(),
                "step_s": round(self.at.overlapped_s if self.max_staleness else self.at.sync_s, 6) if self.at else None,
                "weights_gib": round(self.weights_gib, 4),
                "checkpoint_extra_gib": round(self.max_staleness * self.weights_gib, 4)}


def training_passes(cfg: RunConfig) -> dict[str, float]:
    """Forward-pass equivalents over the step's tokens on the training side (module docstring)."""
    a, e = cfg.algo, cfg.algo.epochs_per_step
    update = (3 + (1 if cfg.model.gradient_checkpointing else 0)) * e
    passes = {"update": update}
    if a.minibatches_per_step > 1 or e > 1:
        passes["old log-probs"] = 1
    if a.kl_coef > 0:
        passes["reference"] = 1
    if a.advantage == "gae":
        passes["critic"] = 1 + update
    return passes


def step_time(cfg: RunConfig, dims: ModelDims, minibatch_sizes: list[int], world: int, rollout: int,
              rates: Rates, train_rates: Rates | None = None) -> StepTime:
    """The estimate for `rollout` reserved devices out of `world` (module docstring); `rates` are the generating
    side's (and the push's), `train_rates` the training side's when they differ (mixed devices)."""
    c = compute_bytes(cfg.model.dtype)
    N, F, B, f = dims.active_linear_params, rates.tflops * 1e12, rates.gbps * 1e9, rates.floor_s
    p, g, n = cfg.data.max_prompt_tokens, cfg.sampled_tokens(), cfg.rollout.samples_per_prompt
    b = math.ceil(cfg.samples_per_step() / rollout)
    weights = c * dims.linear_params  # every expert is read: a batch's tokens pick most of them
    prefill = max(2 * N * math.ceil(b / n) * p / F, weights / B, f)
    kv = b * (p + g / 2) * dims.layers * 2 * dims.kv_heads * dims.head_dim * c
    decode = g * max(2 * N * b / F, (weights + kv) / B, f)
    t = world - rollout
    length = p + cfg.response_tokens()
    per_micro = max(1, cfg.train.token_cap_per_micro_batch // length)
    rows = [math.ceil(m / t) for m in minibatch_sizes]
    micro = sum(max(1, math.ceil(r / per_micro)) for r in rows)
    tokens = sum(rows) * length
    passes = sum(training_passes(cfg).values())
    tr = train_rates or rates
    train = max(2 * N * tokens * passes / (tr.tflops * 1e12), micro * passes * tr.floor_s)
    push = push_bytes(cfg, dims) / (rates.link_gbps * 1e9)
    return StepTime(rollout, t, b, prefill, decode, tokens, train, push)


def push_bytes(cfg: RunConfig, dims: ModelDims) -> float:
    """One policy version as pushed: the model in model.dtype, or with model.lora its fp32 adapters."""
    lora = cfg.model.lora
    if lora.rank:
        return 4 * adapter_params(dims, lora.rank, lora.target_modules, experts=lora.experts)
    return compute_bytes(cfg.model.dtype) * dims.params


def estimate_overlap(cfg: RunConfig, layout: Layout, dims: ModelDims, minibatch_sizes: list[int],
                     rates: Rates, told: RateFlags | None = None) -> Overlap | None:
    """The planned split's estimate (when rollout devices are reserved) and the best split of the same world;
    None when the world cannot be split (one device) or the step has no mini-batches."""
    world = layout.world
    if world < 2 or not minibatch_sizes:
        return None

    def split(r: int) -> StepTime:
        if layout.devices is None:
            return step_time(cfg, dims, minibatch_sizes, world, r, rates)
        devices, dtype = layout.devices, cfg.model.dtype
        balanced = cfg.parallel.capacity_weights is not None or layout.capacity_weights is not None
        gen = side_rates(rates, told, devices[world - r:], dtype, False)
        return step_time(cfg, dims, minibatch_sizes, world, r, gen, side_rates(rates, told, devices[:world - r], dtype,
                                                                              balanced))

    # more replicas than samples generate nothing more: the search stops there
    candidates = [split(r) for r in range(1, min(world - 1, cfg.samples_per_step()) + 1)]
    best = min(candidates, key=lambda s: (s.overlapped_s, s.rollout_devices))
    at = None
    if 1 <= layout.rollout_devices < world:
        at = split(layout.rollout_devices)
    weights_gib = push_bytes(cfg, dims) / GIB
    return Overlap(rates, training_passes(cfg), at, best, cfg.rollout.max_staleness, weights_gib)


def side_rates(base: Rates, told: RateFlags | None, devices, dtype: str, balanced: bool) -> Rates:
    """The rates of one side of a split on mixed devices: each device's own (evenrl.planner.cluster: as given in
    --nodes, or its datasheet's), `base` for a device without any and for what the flags gave; the slowest device's,
    or with `balanced` (capacity weights: the work follows the speeds) their mean TFLOP/s."""
    told = told or RateFlags()
    own = [achieved_rates(d, dtype) or (base.tflops, base.gbps) for d in devices]
    tflops = [base.tflops if told.tflops else t for t, _ in own]  # a flag replaces every device's rate
    gbps = [base.gbps if told.gbps else g for _, g in own]
    return replace(base, tflops=sum(tflops) / len(tflops) if balanced else min(tflops), gbps=min(gbps))


# ------------------------------------------------------------------------------------------ flags

def add_rate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("step-time estimate of reserved placement (default: assumed rates, see "
                             "evenrl.planner.timing)")
    g.add_argument("--device-tflops", type=_rate("--device-tflops", "TFLOP/s", "396"),
                   help="achieved dense matmul throughput per device, TFLOP/s")
    g.add_argument("--device-gbps", type=_rate("--device-gbps", "GB/s", "2010"),
                   help="achieved memory bandwidth per device while decoding, GB/s")
    g.add_argument("--link-gbps", type=_rate("--link-gbps", "GB/s", "100"),
                   help="bandwidth of the weight push from trainer 0 to the rollout devices, GB/s")


def rate_flags(ns: argparse.Namespace) -> RateFlags:
    return RateFlags(ns.device_tflops, ns.device_gbps, ns.link_gbps)


def _rate(flag: str, unit: str, example: str):
    parse = positive_number(unit, example, MAX_RATE)
    parse.__name__ = flag  # argparse names the flag's type in its messages
    return parse
