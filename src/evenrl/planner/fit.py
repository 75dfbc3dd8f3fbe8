"""`evenrl plan --fit`: the nearest config that runs well on the planned layout and keeps the experiment, and that
config as a short file.

    evenrl plan examples/plan_512x8.yaml --nproc-per-node 6 --fit
    evenrl plan --from verl run_qwen3-30b-a3b.sh --fit --write-config fitted.yaml

fit() changes only how the run is laid out and how much each rank holds at once (FIT_KEYS): never what is trained
(LoRA only where the run has it), its precision, the algorithm, the data, prompts or samples per step, sampling, or
the engine. It mends what the layout refuses: capacity weights that do not match the ranks, offload without
sharding, on CPU or beside tensor parallelism, a rollout reserve the HF sampler cannot use, parallel sizes the model
and layout refuse and a vLLM engine that cannot hold its weights (_parallel_sizes), a token cap under one sample (or
min_rows samples). Memory comes last: knobs from memory_fixes that keep the experiment, least speed lost first
(_PREFERENCE), until the estimate fits every device group (a smaller device at its own, lower, token cap). An error
only the experiment could mend (one sample per prompt under GRPO, staleness without reserved rollout devices, LoRA
or bf16 state to save memory) stays in the re-plan with its own fix; where nothing that keeps the experiment fits,
fit_verdict says so in one finding: the smallest cluster of the same nodes that fits, or what evenrl lacks. The
original config is never changed; the result is validated.
Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import yaml

from evenrl.config import MAX_TOKENS, RunConfig, flatten, with_settings
from evenrl.distributed import mesh_shape
from evenrl.planner.layout import Layout
from evenrl.planner.dims import ModelDims
from evenrl.planner.groups import plan_groups
from evenrl.planner.cluster import MAX_WORLD
from evenrl.planner.memory import GIB, compute_bytes, estimate_memory
from evenrl.planner.memory_fixes import expert_parallel_sizes
from evenrl.planner.plan import Plan
from evenrl.planner.split_model import engine_need, engine_splits, tensor_sizes
from evenrl.planner.text import plural
from evenrl.planner.types import Finding


# What --fit may change: how the run is laid out over the devices and how much each holds at once. Everything else
# is the experiment (what is trained and in which precision, the algorithm, the data, prompts and samples per step,
# the engine, sampling) and stays as the user wrote it; an error only such a change would mend stays in the fitted
# plan with its own fix.
FIT_KEYS = ("parallel.", "model.gradient_checkpointing", "train.token_cap_per_micro_batch", "rollout.memory_fraction",
            "rollout.tensor_parallel_size")


def keeps_the_experiment(key: str) -> bool:
    return key.startswith(FIT_KEYS)


def fit(plan: Plan) -> tuple[RunConfig, list[tuple[str, Any, Any]]]:
    """The nearest config that runs well on plan.layout and keeps the experiment (FIT_KEYS), and its changes as
    (key, old, new). Layout problems (no training ranks), missing files and what only the experiment could change
    cannot be fixed here; they stay in the re-plan."""
    cfg, lay, s = plan.config, plan.layout, {}
    t = max(lay.training_ranks, 1)
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
    mrows = cfg.train.min_rows_per_micro_batch
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
            assert keeps_the_experiment(key), key  # a fix outside FIT_KEYS would change what is run
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
    else nothing (the engine is the experiment's); expert_parallel_size to the largest size
    up to it the model and layout allow (planner.memory_fixes.expert_parallel_sizes: over the training ranks),
    1 with CPU offload; and a mixture of experts under tensor parallelism without expert parallelism (refused:
    config.compatibility) to the largest expert_parallel_size allowed, else tensor_parallel_size=1."""
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
        ep = s["parallel.expert_parallel_size"] = 1 if offload else max(e for e in allowed if e <= ep)
    if dims and dims.experts and tp > 1 and ep == 1:  # TP splits no routed expert: EP must (Megatron's layout)
        if max(allowed) > 1:
            s["parallel.expert_parallel_size"] = max(allowed)
        else:
            s["parallel.tensor_parallel_size"] = 1
    now = with_settings(cfg, s) if s else cfg
    found = engine_check(now, lay, dims) if dims else None
    if found:
        smallest, fraction = found[3], found[4]
        if smallest:
            s["rollout.tensor_parallel_size"] = smallest
        elif fraction <= MOST_SHARE:
            s["rollout.memory_fraction"] = fraction
        # else: no engine this layout allows holds the weights; the engine stays (the experiment's) and so does the
        # plan's engine-memory error, which --fit's verdict names (fit_verdict)
    return {k: v for k, v in s.items() if flatten(cfg.model_dump(mode="json")).get(k) != v}


# The memory knobs (all within FIT_KEYS), least speed lost first. Sequence parallelism before checkpointing: it
# recomputes nothing and its all-to-all is small next to the attention of the long samples it is for (it is only
# offered for a sample over one rank's token cap). Expert parallelism next: it recomputes nothing either, and where
# a mixture's experts are what does not fit, it moves each token (k copies) instead of gathering every expert for
# every block as FSDP2 does. Checkpointing (~30 % more update compute) and sharding (a gather per unit, overlapped)
# next; then a smaller engine share, offered only where generation is the phase over (less KV cache: fewer
# sequences decoded at once), or an engine over more devices (fewer engines, each split); then fewer tokens per
# micro-batch (more, smaller micro-steps). Tensor parallelism
# before offload: its collectives stay on a node's links, where offload moves every step's state over PCIe and
# runs AdamW on the host. bf16 weights and state, LoRA, a smaller batch, no KL reference: the plan's suggestions
# (memory-over), never --fit's: each changes what is run.
_PREFERENCE = ["parallel.sequence_parallel_size", "parallel.expert_parallel_size", "model.gradient_checkpointing",
               "parallel.sharding", "rollout.memory_fraction", "rollout.tensor_parallel_size",
               "train.token_cap_per_micro_batch",
               "parallel.tensor_parallel_size", "parallel.cpu_offload"]


def _fit_memory(cfg: RunConfig, lay: Layout, dims: ModelDims) -> RunConfig:
    """Memory fixes that keep the experiment until every device group fits (a smaller device at its lowered token
    cap: evenrl.planner.groups), the first group that does not fit choosing each: the least intrusive that fits
    alone, else the least intrusive that lowers its peak (then the next, on the config it leaves)."""
    for _ in range(2 * len(_PREFERENCE)):
        over = [g for g in plan_groups(cfg, lay, dims) if g.fits is False]
        if not over:
            return cfg
        fixes = [f for f in over[0].fixes if all(keeps_the_experiment(k) for k in f.settings)]
        if not fixes:
            return cfg
        pick = min([f for f in fixes if f.fits] or fixes, key=lambda f: (_intrusion(f.settings), f.total_gib))
        cfg = with_settings(cfg, pick.settings)
    return cfg


def _intrusion(settings: dict[str, Any]) -> int:
    """A fix's place in _PREFERENCE: its most intrusive key's. The token cap that comes with a
    sequence_parallel_size (one sample's slice per rank) is part of that fix, not a second knob."""
    rank = {key: i for i, key in enumerate(_PREFERENCE)}
    keys = [k for k in settings if not (k == "train.token_cap_per_micro_batch"
                                        and "parallel.sequence_parallel_size" in settings)]
    return max(rank.get(k, 99) for k in keys)


MOST_NODES = 16  # fit_verdict tries clusters of up to this many times the planned nodes


def fit_verdict(plan: Plan) -> Finding | None:
    """Where the fitted config (plan) still does not fit its devices (memory-over, or a vLLM engine that no share of
    a device holds), one finding: the smallest cluster of the same nodes (2, 4, ... MOST_NODES times as many) on
    which --fit keeps the experiment and fits, else the capability evenrl lacks for what does not fit. The largest
    cluster is tried first (a few tenths of a second at thousands of ranks): where it does not fit, nothing smaller
    is tried."""
    from evenrl.planner.tensor_parallel import MOST_SHARE, engine_check  # it imports the rules, as this module does

    errors = {f.rule for f in plan.findings if f.level == "error"}
    lay, cfg, dims = plan.layout, plan.config, plan.dims
    if not dims or len(plan.groups) > 1 or not {"memory-over", "engine-memory"} & errors:
        return None
    here = f"{plural(lay.training_ranks, 'training rank')} of {lay.device_memory_gib:g} GiB"
    engine = engine_check(cfg, lay, dims)
    splits = engine_splits(lay, dims)
    if engine and engine[3] is None and engine[4] > MOST_SHARE:  # no engine within a node holds it: nor will more nodes
        weights = engine_need(dims, compute_bytes(cfg.model.dtype), max(splits), plan.sample_tokens) / GIB
        return Finding("error", "fit-none", f"nothing that keeps the experiment fits {here}: a vLLM engine over "
                       f"{max(splits)} devices (the most one node's {lay.nproc_per_node} allow) still needs "
                       f"{weights:.0f} GiB of each, over {MOST_SHARE:.0%} of its memory; an engine across nodes "
                       "(vLLM's pipeline parallelism) is what evenrl lacks, and more nodes do not change it",
                       _CHANGE_IT)
    est = estimate_memory(cfg, lay, dims)
    gathered = est.breakdown.get("gathered model", 0.0)
    if gathered + est.breakdown.get("overhead", 0.0) > lay.device_memory_gib:  # the same on any number of ranks
        return Finding("error", "fit-none", f"nothing that keeps the experiment fits {here}, nor more of them: "
                       + _gathered(gathered, dims), _CHANGE_IT)

    def fitted_on(nodes: int) -> tuple[RunConfig, Layout, bool]:
        bigger = replace(lay, nnodes=nodes, capacity_weights=None)
        c = _fit_memory(with_settings(cfg, _parallel_sizes(cfg, bigger, dims)), bigger, dims)
        return c, bigger, all(g.fits for g in plan_groups(c, bigger, dims)) and not engine_check(c, bigger, dims)

    most = max(lay.nnodes, min(lay.nnodes * MOST_NODES, MAX_WORLD // lay.nproc_per_node))
    c, bigger, fits = fitted_on(most)  # the largest first: where it does not fit, no smaller cluster does
    if fits:
        nodes = lay.nnodes * 2
        while nodes < most and not (found := fitted_on(nodes))[2]:
            nodes *= 2
        c, bigger, _ = found if nodes < most else (c, bigger, fits)
        changed = {k: v for k, v in flatten(c.model_dump(mode="json")).items()
                   if flatten(cfg.model_dump(mode="json")).get(k) != v}
        how = " ".join(f"{k}={v}" for k, v in changed.items())
        return Finding("error", "fit-none", f"nothing that keeps the experiment fits {here}; {bigger.world} of them "
                       f"({bigger.nnodes} nodes) are the smallest power-of-two multiple of this cluster that fits"
                       + (f", with {how}" if how else ""), f"--nnodes {bigger.nnodes}" + (f" {how}" if how else ""))
    est = estimate_memory(c, bigger, dims)
    phase = max(est.phases, key=est.phases.get)
    gathered = est.breakdown.get("gathered model", 0.0)
    if phase == "rollout" and gathered > lay.device_memory_gib / 2:  # the hf sampler's whole copy of the model
        lacks = _gathered(gathered, dims)
    elif phase == "rollout" and est.breakdown.get("rollout engine", 0.0) > lay.device_memory_gib / 2:
        lacks = (f"each rank still needs {est.total_gib:.0f} GiB while it generates, "
                 f"{est.breakdown['rollout engine']:.0f} of them the vLLM engine's share, on engines of at most "
                 f"{lay.nproc_per_node} devices (one node); an engine across nodes (vLLM's pipeline parallelism) is "
                 "what evenrl lacks")
    else:
        lacks = (f"each rank still needs {est.total_gib:.0f} GiB in {phase} with every setting --fit has applied; "
                 "pipeline parallelism (each rank holding a share of the layers) is what evenrl lacks")
    return Finding("error", "fit-none", f"nothing that keeps the experiment fits {here}, nor on {bigger.nnodes} "
                   f"nodes: {lacks}", _CHANGE_IT)


_CHANGE_IT = ("devices with more memory; or a smaller model, batch or sample, or another engine (the experiment is "
              "yours to change: the memory-over finding lists what would fit)")


def _gathered(gib: float, dims: ModelDims) -> str:
    """What evenrl lacks where the hf sampler's gathered copy of the model is what does not fit."""
    return (f"the hf sampler gathers the whole model to generate ({gib:.0f} GiB); generating from a model split over "
            + ("ranks with its experts left split (the hf sampler gathers every expert) is what evenrl lacks for a "
               "mixture of experts" if dims.experts else
               "more ranks than one node's tensor parallelism allows is what evenrl lacks"))


ALWAYS_SHOWN = {"data": ("prompts_per_step",), "rollout": ("samples_per_prompt",), "algo": ("minibatches_per_step",)}


def minimal_yaml(cfg: RunConfig) -> str:
    """The batch keys and those that differ from the defaults, as a config file (defaults fill in the rest)."""
    default = RunConfig().model_dump(mode="json")
    full = cfg.model_dump(mode="json")
    diff = {sec: {k: v for k, v in vals.items() if default[sec].get(k) != v or k in ALWAYS_SHOWN.get(sec, ())}
            for sec, vals in full.items()}
    diff = {sec: vals for sec, vals in diff.items() if vals}
    return yaml.safe_dump(diff, sort_keys=False) if diff else "{}\n"
