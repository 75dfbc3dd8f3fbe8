"""Rules for splitting the model's work over devices: Ulysses sequence parallelism in training
(parallel.sequence_parallel_size) and tensor parallelism in the vLLM engine (rollout.tensor_parallel_size).

    evenrl plan CONFIG parallel.sequence_parallel_size=4 --nproc-per-node 8 --device cuda --device-memory-gib 80

Sequence parallelism (SP): the training ranks are data-parallel groups of SP consecutive ranks (a group's
all-to-all stays inside a node where SP <= processes per node); each sample's tokens are split evenly over its
group, and attention trades tokens for heads with an all-to-all, so each rank computes heads / SP query heads
over the whole sequence. Hence: SP divides the training ranks, SP divides the query heads, KV heads that SP does
not divide are repeated (lcm(KV heads, SP) of them), vision-language models are not supported yet, and neither is
attention the packed path does not implement (logit softcapping; also under checkpointing and for a mixture of
experts, which pack rows the same way; sliding windows and attention sinks it implements). The memory it saves is evenrl.planner.memory's; the smallest SP that fits is found here
and offered by evenrl.planner.memory_fixes.
Tensor parallelism in the engine (rollout.tensor_parallel_size): one vLLM engine over that many devices (vLLM's
tensor_parallel_size), on the reserved rollout devices or, colocated, over the trainers of each engine group
(engines.engine_group); refused above 1 for an engine that cannot span devices (evenrl.distributed.mesh_shape.
ENGINES_OVER_DEVICES). The hf engine's is the trainer's (parallel.tensor_parallel_size, planner.tensor_parallel).
What the ranks that sample together cannot do is config.compatibility's (read by the plan and the run alike).
Pure Python: never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import replace

from evenrl.config import RunConfig, with_settings
from evenrl.distributed import mesh_shape
from evenrl.planner.dims import ModelDims
from evenrl.planner.groups import group_layout
from evenrl.planner.layout import Layout
from evenrl.planner.memory import MemoryEstimate, estimate_memory
from evenrl.planner.memory_fixes import TIGHT, sequence_settings, sequence_sizes
from evenrl.planner.tensor_parallel import engine_spans_nodes, engine_splits
from evenrl.planner.text import plural
from evenrl.planner.types import Finding, Plan


def divisors_near(n: int, want: int, ok=lambda d: True) -> list[int]:
    """Divisors of n that pass `ok`, nearest to `want` first (the smaller first on a tie); at most two."""
    ds = sorted((d for d in range(1, n + 1) if n % d == 0 and ok(d)), key=lambda d: (abs(d - want), d))
    return ds[:2]


def rule_sequence_parallel(p: Plan) -> list[Finding]:
    c, lay, d = p.config, p.layout, p.dims
    sp, t, out = c.parallel.sequence_parallel_size, lay.training_ranks, []
    tp = p.tensor_parallel
    packed = sp > 1 or (d is not None and (d.experts > 0 or d.vision is None and (c.model.gradient_checkpointing
                                                                                   or tp > 1)))
    if d and d.attention_extras and packed:  # evenrl.distributed.sequence refuses it at the first forward
        why = ("sequence parallelism" if sp > 1 else "a mixture of experts (rows packed back to back, always)"
               if d.experts else "tensor parallelism (rows packed back to back)" if tp > 1
               else "activation checkpointing (rows packed back to back)")
        out.append(Finding("error", "packed-attention",
                           f"the model's attention uses {d.attention_extras} (config.json), which the packed "
                           f"attention of {why} does not implement",
                           "none: a mixture of experts trains packed whatever the settings" if d.experts and sp == 1 else
                           "parallel.sequence_parallel_size=1 model.gradient_checkpointing=false"
                           + (" parallel.tensor_parallel_size=1" if tp > 1 else "")))
    if sp == 1 or t < 1:
        return out + _sample_too_long(p)
    heads = d.heads // tp if d else 0  # Ulysses splits the heads this rank holds under tensor parallelism
    heads_ok = (lambda s: heads % s == 0) if d else (lambda s: True)
    key = "parallel.sequence_parallel_size"
    if t % sp and tp == 1:  # with TP, the mesh's product is rule_tensor_parallel's
        near = divisors_near(t, sp, heads_ok)
        out.append(Finding("error", "sequence-parallel-ranks",
                           f"{key}={sp} does not divide the {plural(t, 'training rank')}: the ranks form groups "
                           f"of {sp}", "; ".join(f"{key}={s}" for s in near)
                           + f"; or {t - t % sp or sp} training ranks"))
    if d and d.vision is not None:
        return out  # refused: config.compatibility's sequence-parallel-vision
    whose = "the model's" if tp == 1 else f"a tensor-parallel rank's (1/{tp} of the model's)"
    kv_heads = d.kv_heads // tp if d else 0
    if d and heads % sp:
        near = divisors_near(heads, sp, lambda s: (t // tp) % s == 0)
        out.append(Finding("error", "sequence-parallel-heads",
                           f"{key}={sp} does not divide {whose} {heads} query heads: Ulysses gives each rank "
                           f"heads / {sp} of them", "; ".join(f"{key}={s}" for s in near)))
    elif d and kv_heads % sp:
        kv = math.lcm(kv_heads, sp)
        out.append(Finding("note", "sequence-parallel-kv-heads",
                           f"{key}={sp} does not divide {whose} {kv_heads} KV heads: the runtime repeats each "
                           f"{kv // kv_heads} times ({kv} KV heads, {kv // sp} per rank), so k and v cost "
                           f"{kv // kv_heads}x in the all-to-all and in attention's memory (counted above)",
                           "; ".join(f"{key}={s}" for s in divisors_near(t // tp, sp, lambda s: kv_heads % s == 0
                                                                         and s > 1)) or ""))
    if lay.nnodes > 1 and sp > lay.nproc_per_node and not t % sp:
        out.append(Finding("warning", "sequence-parallel-nodes",
                           f"{key}={sp} spans {math.ceil(sp / lay.nproc_per_node)} nodes of {lay.nproc_per_node} "
                           "processes: every layer's all-to-all crosses the inter-node link",
                           f"{key}={math.gcd(sp, lay.nproc_per_node)} (inside a node)"
                           + ("" if c.model.gradient_checkpointing else
                              ", with model.gradient_checkpointing=true if it then does not fit")))
    return out + _sample_too_long(p)


def _training_gib(est: MemoryEstimate) -> float:
    """The peak of the phases a sample's length sets: its log-probs and its update (generation is not split)."""
    return max(est.phases.get("update", 0.0), est.phases.get("log-probs", 0.0))


def _sample_too_long(p: Plan) -> list[Finding]:
    """When one sample per micro-batch does not fit a rank's training phases, or fills more than TIGHT of the
    device: the smallest sequence_parallel_size below that, alone or with activation checkpointing (--fit applies
    it where it is the least intrusive fix)."""
    c, mem, d = p.config, p.memory, p.dims
    if mem is None or not mem.capacity_gib or _training_gib(mem) <= TIGHT * mem.capacity_gib or d is None \
            or not p.groups:
        return []
    over = _training_gib(mem) > mem.capacity_gib
    sp = p.sequence_parallel
    if mem.micro_tokens * sp > p.sample_tokens + sp:  # more than one sample per micro-batch: the token cap first
        return []
    tight = min(p.groups, key=lambda g: g.group.device.memory_gib)
    lay, ranks = group_layout(replace(p.layout, capacity_weights=p.weights and tuple(p.weights)), tight.group), \
        tight.group.ranks
    key, cfg = "parallel.sequence_parallel_size", c
    sizes = [s for s in sequence_sizes(c, p.layout, d) if s > c.parallel.sequence_parallel_size]
    limit = lay.device_memory_gib * (1 if over else TIGHT)
    split = next((s for s in sizes if _fits(cfg, lay, d, s, ranks, limit)), None)
    if split is None and sizes and not c.model.gradient_checkpointing:
        cfg = with_settings(c, {"model.gradient_checkpointing": True})
        split = next((s for s in sizes if _fits(cfg, lay, d, s, ranks, limit)), None)
    head = (f"one sample of {p.sample_tokens:,} tokens per micro-batch needs an estimated {_training_gib(mem):.1f} "
            f"GiB per rank in training at {key}={sp}, "
            + (f"over {lay.device_memory_gib:.1f} GiB" if over else
               f"over {TIGHT:.0%} of {lay.device_memory_gib:.1f} GiB"))
    if split is None:
        sizes = sequence_sizes(c, p.layout, d)
        why = ("not supported yet for vision-language models" if d.vision else
               f"{key} up to {sizes[-1]} (divisors of the {plural(p.layout.training_ranks, 'training rank')} that "
               f"divide the {d.heads} query heads) {'does not fit' if over else 'leaves no room'} either")
        more = "" if d.vision else f"more training ranks (a larger {key}); or "
        return [Finding("note", "sample-too-long", f"{head}; sequence parallelism: {why}",
                        f"{more}a shorter rollout.max_new_tokens")]
    est = estimate_memory(_at(cfg, d, split), lay, d, ranks)
    extra = " with model.gradient_checkpointing=true" if cfg is not c else ""
    fix = " ".join(f"{k}={str(v).lower()}" for k, v in {**sequence_settings(cfg, d, split), **(
        {"model.gradient_checkpointing": True} if extra else {})}.items())
    return [Finding("note", "sample-too-long",
                    f"{head}: the smallest {key} that {'fits' if over else 'leaves room'}{extra} is {split} "
                    f"(est. {_training_gib(est):.1f} GiB; "
                    f"{plural(p.layout.training_ranks // split, 'data-parallel group')} of {split} ranks, each "
                    f"rank ~{math.ceil(p.sample_tokens / split):,} tokens of a sample)", fix)]


def _at(cfg: RunConfig, dims: ModelDims, sp: int) -> RunConfig:
    """cfg split over sp ranks (memory_fixes.sequence_settings: the token cap lowered to one sample's slice)."""
    return with_settings(cfg, sequence_settings(cfg, dims, sp))


def _fits(cfg: RunConfig, lay: Layout, dims: ModelDims, sp: int, ranks, limit: float) -> bool:
    return _training_gib(estimate_memory(_at(cfg, dims, sp), lay, dims, ranks)) <= limit


def rule_rollout_parallel(p: Plan) -> list[Finding]:
    """What the ranks that sample together cannot do (distributed.lockstep: the runtime refuses the same), and where
    a vLLM engine over rollout.tensor_parallel_size devices is placed: consecutive ranks of one node (colocated:
    trainers, every one of them a worker; reserved: rollout ranks, the first of each group starting the engine over
    the group's devices), its slices of the attention heads and the MLP whole."""
    c, lay, d = p.config, p.layout, p.dims
    tp, key = c.rollout.tensor_parallel_size, "rollout.tensor_parallel_size"
    out: list[Finding] = []
    if tp == 1 or c.rollout.engine not in mesh_shape.ENGINES_OVER_DEVICES:  # the hf engine's: the table's finding
        return out
    devices = lay.rollout_devices or lay.world
    where = (f"the {plural(devices, 'reserved rollout device')}" if lay.rollout_devices
             else f"the {plural(devices, 'device')} (colocated: every rank trains and generates)")
    flag = "--rollout-devices" if lay.rollout_devices else "--nproc-per-node"
    splits = engine_splits(lay, d)
    if devices % tp:
        out.append(Finding("error", "tensor-parallel-devices",
                           f"{key}={tp} does not divide {where}: each engine takes {tp} of them",
                           "; ".join(f"{key}={s}" for s in divisors_near(devices, tp, splits.__contains__)) +
                           f"; or {flag} a multiple of {tp}"))
    elif engine_spans_nodes(lay, tp):
        out.append(Finding("error", "tensor-parallel-node",
                           f"{key}={tp} with {plural(lay.nproc_per_node, 'process')} per node: some engine's "
                           f"{tp} devices would span two nodes (an engine's workers must share one)",
                           "; ".join(f"{key}={s}" for s in divisors_near(devices, tp, splits.__contains__))))
    if d and (d.heads % tp or d.intermediate % tp):
        what = f"{d.heads} attention heads" if d.heads % tp else f"MLP width {d.intermediate}"
        out.append(Finding("error", "tensor-parallel-heads",
                           f"{key}={tp} does not divide the model's {what}: vLLM gives each worker an equal slice",
                           "; ".join(f"{key}={s}" for s in divisors_near(devices, tp, splits.__contains__))))
    return out
