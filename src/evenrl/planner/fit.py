"""`evenrl plan --fit`: the nearest config that runs well on the planned layout, and that config as a short file.

    evenrl plan examples/plan_512x8.yaml --nproc-per-node 6 --fit

fit() changes only what a finding asks for: group size and temperature for group advantages, capacity weights
that do not match the ranks, offload without sharding, on CPU or beside tensor parallelism, a rollout reserve the HF
sampler cannot use, the parallel sizes the model and layout refuse and a vLLM engine that cannot hold its weights
(_parallel_sizes), then the batch (enough prompts that every rank trains and generates, a multiple of ranks x mini-batches when the split
is uneven) and the token cap (one sample, or min_rows samples, must fit); rollout.max_staleness=0 without reserved
rollout devices, algo.filter_groups=false with them. Memory comes last: knobs from memory_fixes, least intrusive
first, until the estimate fits every device group (a smaller device at its own, lower, token cap; LoRA,
model.lora.rank=16, only when full fine-tuning fits no other way; the smallest tensor_parallel_size that fits
before offload). Layout problems and missing files stay in the
re-plan: no setting fixes them. The original config is never changed; the result is validated.
Pure Python: never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import yaml

from evenrl.config import MAX_COUNT, MAX_TOKENS, RunConfig, flatten, with_settings
from evenrl.distributed import mesh_shape
from evenrl.planner.layout import Layout
from evenrl.planner.split_model import tensor_sizes
from evenrl.planner.dims import ModelDims
from evenrl.planner.batches import GROUP_ADVANTAGES
from evenrl.planner.groups import plan_groups
from evenrl.planner.memory import estimate_memory
from evenrl.planner.memory_fixes import expert_parallel_sizes, memory_fixes
from evenrl.planner.plan import Plan


def fit(plan: Plan) -> tuple[RunConfig, list[tuple[str, Any, Any]]]:
    """The nearest config that runs well on plan.layout, and its changes as (key, old, new).
    Layout problems (no training ranks) and missing files cannot be fixed here; they stay in the re-plan."""
    cfg, lay, s = plan.config, plan.layout, {}
    t = max(lay.training_ranks, 1)
    if cfg.algo.advantage in GROUP_ADVANTAGES and cfg.rollout.samples_per_prompt == 1:
        s["rollout.samples_per_prompt"] = 4
    if cfg.rollout.temperature == 0 and cfg.algo.advantage in GROUP_ADVANTAGES:
        s["rollout.temperature"] = 1.0
    fixed = cfg.parallel.fixed_capacity_weights()
    if fixed and len(fixed) != t:
        s["parallel.capacity_weights"] = None
    # offload needs an accelerator, and no tensor parallelism (the TP asked for stays)
    if cfg.parallel.cpu_offload == "full" and (lay.device == "cpu" or cfg.parallel.tensor_parallel_size > 1):
        s["parallel.cpu_offload"] = "none"
    elif cfg.parallel.cpu_offload == "full" and cfg.parallel.sharding != "fsdp":  # and fsdp (even on one rank)
        s["parallel.sharding"] = "fsdp"
    if cfg.rollout.memory_fraction > 0 and cfg.rollout.engine == "hf":
        s["rollout.memory_fraction"] = 0.0
    s.update(_parallel_sizes(cfg, lay, plan.dims))
    # Overlap needs reserved rollout devices, which are the layout's to give (--rollout-devices): without them
    # the run stays synchronous. With them, dynamic sampling's extra rounds cannot run, so it goes.
    if cfg.rollout.max_staleness and not lay.rollout_devices:
        s["rollout.max_staleness"] = 0
    if cfg.algo.filter_groups and lay.rollout_devices:
        s["algo.filter_groups"] = False
    t = t // (s.get("parallel.sequence_parallel_size", cfg.parallel.sequence_parallel_size)  # units: replicas
              * s.get("parallel.tensor_parallel_size", cfg.parallel.tensor_parallel_size))
    k = s.get("rollout.samples_per_prompt", cfg.rollout.samples_per_prompt)
    prompts, m, mrows = cfg.data.prompts_per_step, cfg.algo.minibatches_per_step, cfg.train.min_rows_per_micro_batch
    m = min(m, prompts)
    need = max(prompts, m * math.ceil(t * mrows / k))  # every rank trains and generates (>= 1 sample each)
    if plan.imbalance and plan.imbalance >= 1.10:
        step = t * m // math.gcd(t * m, k)
        even = math.ceil(need / step) * step
        need = even if even <= 2 * need else need
    if need != prompts:
        s["data.prompts_per_step"] = min(need, MAX_COUNT)
    if m != cfg.algo.minibatches_per_step:
        s["algo.minibatches_per_step"] = m
    length = -(-plan.sample_tokens // s.get("parallel.sequence_parallel_size", cfg.parallel.sequence_parallel_size))
    if cfg.train.token_cap_per_micro_batch < max(length, mrows * length):
        s["train.token_cap_per_micro_batch"] = min(max(length, mrows * length), MAX_TOKENS)
    new = with_settings(cfg, s) if s else cfg
    if plan.dims and lay.training_ranks >= 1 and lay.device_memory_gib:
        new = _fit_memory(new, replace(lay, capacity_weights=plan.weights and tuple(plan.weights)), plan.dims)
    changes = []
    old_d, new_d = flatten(cfg.model_dump(mode="json")), flatten(new.model_dump(mode="json"))
    for key, value in new_d.items():
        if old_d.get(key) != value:
            changes.append((key, old_d.get(key), value))
    return new, changes


def _parallel_sizes(cfg: RunConfig, lay: Layout, dims: ModelDims | None) -> dict[str, Any]:
    """The parallel sizes the rules refuse, mended: parallel.tensor_parallel_size to the largest size up to it the
    model and layout allow (planner.split_model.tensor_sizes), else 1; sequence_parallel_size to the nearest size
    below it they allow beside that TP, else 1; rollout.tensor_parallel_size to 1 where the engine cannot span
    devices (the hf engine: its TP is the trainer's) or the model is a vision-language one (config.compatibility),
    else to the largest size up to it whose engines sit on one node and divide the heads and MLP width
    (tensor_parallel.engine_splits); then, for a vLLM engine whose share of a GPU does not hold its weights
    (planner.tensor_parallel.engine_check), the smallest engine that does, else the share that does (up to 0.9),
    else the hf engine, which samples from the (split) training model; expert_parallel_size to the largest size
    up to it the model and layout allow (planner.memory_fixes.expert_parallel_sizes: none above 1 beside TP), 1
    with CPU offload."""
    from evenrl.planner.model_parallel import divisors_near  # it imports the planner's rules, as this module does
    from evenrl.planner.tensor_parallel import MOST_SHARE, engine_check, engine_splits

    s: dict[str, Any] = {}
    t, sp, tp = max(lay.training_ranks, 1), cfg.parallel.sequence_parallel_size, cfg.parallel.tensor_parallel_size
    if tp > 1:
        ok = [d for d in (tensor_sizes(dims, t // sp if t % sp == 0 else t, lay.nproc_per_node, lay.nnodes) if dims
                          else divisors_near(t, tp)) if d <= tp]
        if max(ok, default=1) != tp:
            tp = s["parallel.tensor_parallel_size"] = max(ok, default=1)
    heads = dims.heads // tp if dims else 0
    if sp > 1 and (dims and dims.vision or (t // tp) % sp or heads % max(sp, 1)):
        ok = [d for d in divisors_near(t // tp, sp, lambda d: not heads or heads % d == 0) if d <= sp]
        s["parallel.sequence_parallel_size"] = 1 if dims and dims.vision else max(ok, default=1)
    etp = cfg.rollout.tensor_parallel_size
    if etp > 1 and (cfg.rollout.engine not in mesh_shape.ENGINES_OVER_DEVICES or dims and dims.vision):
        s["rollout.tensor_parallel_size"] = 1
    elif etp > 1:
        s["rollout.tensor_parallel_size"] = max([d for d in engine_splits(lay, dims) if d <= etp], default=1)
    ep, offload = cfg.parallel.expert_parallel_size, cfg.parallel.cpu_offload == "full" and lay.device != "cpu"
    allowed = expert_parallel_sizes(with_settings(cfg, s) if s else cfg, lay, dims) if dims else [ep]
    if ep > 1 and (ep not in allowed or offload):  # (fit() turns offload off on CPU)
        s["parallel.expert_parallel_size"] = 1 if offload else max(e for e in allowed if e <= ep)
    now = with_settings(cfg, s) if s else cfg
    found = engine_check(now, lay, dims) if dims else None
    if found:
        smallest, fraction = found[3], found[4]
        if smallest:
            s["rollout.tensor_parallel_size"] = smallest
        elif fraction <= MOST_SHARE:
            s["rollout.memory_fraction"] = fraction
        else:
            s["rollout.engine"], s["rollout.memory_fraction"] = "hf", 0.0
    return {k: v for k, v in s.items() if flatten(cfg.model_dump(mode="json")).get(k) != v}


# Least intrusive first; what trains (LoRA) and algorithm-changing knobs (kl, prompts) only when nothing else fits.
# Sequence parallelism before checkpointing: it recomputes nothing and its all-to-all is small next to the
# attention of the long samples it is for (it is only offered for a sample over one rank's token cap).
# Expert parallelism next: it recomputes nothing either, and where a mixture's experts are what does not fit, it
# moves each token (k copies) instead of gathering every expert for every block as FSDP2 does. Tensor parallelism
# before offload: its collectives stay on a node's links (a group inside a node), where offload moves every step's
# state over PCIe and runs AdamW on the host; after the knobs that cost nothing per step.
_PREFERENCE = ["parallel.sequence_parallel_size", "parallel.expert_parallel_size", "model.gradient_checkpointing",
               "parallel.sharding",
               "train.token_cap_per_micro_batch", "model.dtype", "parallel.tensor_parallel_size",
               "parallel.cpu_offload", "rollout.memory_fraction", "model.lora.rank", "algo.kl_coef",
               "data.prompts_per_step"]


def _fit_memory(cfg: RunConfig, lay: Layout, dims: ModelDims) -> RunConfig:
    """Fixes until every device group fits (a smaller device at its lowered token cap: evenrl.planner.groups),
    the first group that does not fit choosing each."""
    for _ in range(len(_PREFERENCE)):
        over = [g for g in plan_groups(cfg, lay, dims) if g.fits is False]
        if not over:
            return cfg
        fixes = list(over[0].fixes)
        if not fixes:
            return cfg
        fitting = [f for f in fixes if f.fits]
        pick = (min(fitting, key=lambda f: (_intrusion(f.settings), len(f.settings))) if fitting
                else next((f for f in fixes if not {"model.lora.rank", "algo.kl_coef", "data.prompts_per_step"}
                           & set(f.settings)), fixes[0]))
        cfg = with_settings(cfg, pick.settings)
    return cfg


def _intrusion(settings: dict[str, Any]) -> int:
    """A fix's place in _PREFERENCE: its most intrusive key's. The token cap that comes with a
    sequence_parallel_size (one sample's slice per rank) is part of that fix, not a second knob."""
    rank = {key: i for i, key in enumerate(_PREFERENCE)}
    keys = [k for k in settings if not (k == "train.token_cap_per_micro_batch"
                                        and "parallel.sequence_parallel_size" in settings)]
    return max(rank.get(k, 99) for k in keys)


ALWAYS_SHOWN = {"data": ("prompts_per_step",), "rollout": ("samples_per_prompt",), "algo": ("minibatches_per_step",)}


def minimal_yaml(cfg: RunConfig) -> str:
    """The batch keys and those that differ from the defaults, as a config file (defaults fill in the rest)."""
    default = RunConfig().model_dump(mode="json")
    full = cfg.model_dump(mode="json")
    diff = {sec: {k: v for k, v in vals.items() if default[sec].get(k) != v or k in ALWAYS_SHOWN.get(sec, ())}
            for sec, vals in full.items()}
    diff = {sec: vals for sec, vals in diff.items() if vals}
    return yaml.safe_dump(diff, sort_keys=False) if diff else "{}\n"
