"""Tensor parallelism in the plan: the trainer's (parallel.tensor_parallel_size = TP) and whether a vLLM engine holds
the model on its devices (rollout.tensor_parallel_size); two of planner.rules.RULES.

    evenrl plan CONFIG parallel.tensor_parallel_size=4 --nproc-per-node 8 --device cuda --device-memory-gib 80

The trainer's TP (evenrl.distributed.tensor_parallel, on the mesh of evenrl.distributed.mesh_shape: dp x sp x tp,
tp fastest): a TP group is TP consecutive training ranks, each holding 1/TP of every layer's heads, MLP width and
vocabulary (planner.split_model sizes it, planner.memory counts it). Hence: the model must be a decoder with q/k/v/o
and gate/up/down projections, or a mixture of experts of such layers beside expert parallelism, whose routed experts
stay whole here (no latent attention, attention sinks or q/k norms over the whole projection; a vision tower, experts
without expert parallelism, and FSDP2's CPU offload are config.compatibility's rows), TP must divide its attention
heads, KV heads, MLP widths (a mixture's dense layers', its shared experts') and vocabulary; SP x TP
must divide the training ranks (MeshShape.problems, the line the run would stop with); a group should sit on one node
(its all-gathers run every layer). The hf engine samples from the split model (a TP group generates together), so
its rollout needs no engine of its own. The smallest TP that fits a model too large for a rank is a memory fix
(planner.memory_fixes.tensor_parallel_fix), which --fit applies.
An engine's devices (rule_engine_memory): a vLLM engine on GPUs gets rollout.memory_fraction (0: 0.3) of each
device, which must hold its weights (the model in the compute dtype over rollout.tensor_parallel_size devices) and
at least one sample's KV cache and ~1 GiB of its own; where it does not, the finding names the smallest rollout.tensor_parallel_size that
does (an engine group over that many devices, engines.engine_group) and the share that would, and --fit applies
the first.
Pure Python: never imports torch.
"""

from __future__ import annotations

from evenrl.config import RunConfig
from evenrl.distributed import mesh_shape
from evenrl.distributed.mesh_shape import MeshShape
from evenrl.errors import UsageError
from evenrl.models.files import weight_names
from evenrl.planner.dims import ModelDims
from evenrl.planner.layout import Layout
from evenrl.planner.memory import GIB, VLLM_GPU_SHARE, compute_bytes
# the engines' sizes live in split_model (memory_fixes sizes engines too, below the planner's rules); named here too
from evenrl.planner.split_model import (ENGINE_EXTRA_GIB, engine_bytes, engine_devices, engine_need,  # noqa: F401
                                        engine_spans_nodes, engine_splits, share_needed, split_sizes, splittable,
                                        tensor_sizes)
from evenrl.planner.text import plural
from evenrl.planner.types import Finding, Plan

KEY = "parallel.tensor_parallel_size"
MOST_SHARE = 0.9  # the largest rollout.memory_fraction a fix proposes (vLLM's own default)


def rule_tensor_parallel(p: Plan) -> list[Finding]:
    c, lay, d = p.config, p.layout, p.dims
    tp, sp, t, out = c.parallel.tensor_parallel_size, c.parallel.sequence_parallel_size, lay.training_ranks, []
    if tp == 1 or t < 1:
        return []
    for problem in MeshShape(lay.world, lay.rollout_devices, sp, tp).problems():  # the line the run stops with
        near = _nearest([s for s in _sizes(c, lay, d, t // sp if t % sp == 0 else t) if s > 1], tp)
        out.append(Finding("error", "tensor-parallel-ranks", problem,
                           "; ".join([f"{KEY}={s}" for s in near] + [f"or {sp * tp * max(t // (sp * tp), 1)} "
                                                                      "training ranks"])))
    if d is None or d.vision is not None or d.experts and c.parallel.expert_parallel_size == 1:
        return out  # config.compatibility's tensor-parallel-model rows
    why = splittable(d) or _unsplit_layers(c.model.path)
    if why:
        out.append(Finding("error", "tensor-parallel-model",
                           f"{KEY}={tp} for {why}; the tensor-parallel plan covers decoders with q/k/v/o and "
                           "gate/up/down projections (Qwen2, Qwen2.5, Qwen3, Llama, Mistral; their mixtures of "
                           "experts beside expert parallelism)", f"{KEY}=1"))
        return out
    bad = {name: n for name, n in split_sizes(d).items() if n % tp}
    if bad:
        near = _nearest([s for s in _sizes(c, lay, d, t // sp if t % sp == 0 else t) if s > 1], tp)
        what = ", ".join(f"{n:,} {name}" for name, n in bad.items())
        out.append(Finding("error", "tensor-parallel-sizes",
                           f"{KEY}={tp} does not divide the model's {what}: each rank of a group holds 1/{tp} of them",
                           "; ".join(f"{KEY}={s}" for s in near) or f"{KEY}=1"))
    if lay.nnodes > 1 and lay.nproc_per_node % tp:
        inside = max(s for s in range(1, lay.nproc_per_node + 1) if tp % s == 0 and lay.nproc_per_node % s == 0)
        out.append(Finding("warning", "tensor-parallel-nodes",
                           f"{KEY}={tp} with {plural(lay.nproc_per_node, 'process')} per node: tensor-parallel groups "
                           "span nodes, and every layer's all-gathers and reductions cross the inter-node link",
                           f"{KEY}={inside} (each group inside a node)"))
    return out


def _nearest(values: list[int], want: int) -> list[int]:
    """The two of `values` nearest `want`, the smaller first on a tie."""
    return sorted(values, key=lambda v: (abs(v - want), v))[:2]


def _sizes(c: RunConfig, lay: Layout, d: ModelDims | None, ranks: int) -> list[int]:
    """TP values a fix may name: what the model and layout allow (split_model.tensor_sizes; any divisor of the
    ranks within a node when the model is unknown)."""
    if d is None:
        return [s for s in range(1, min(ranks, lay.nproc_per_node) + 1) if ranks % s == 0]
    return tensor_sizes(d, ranks, lay.nproc_per_node, lay.nnodes)


def _unsplit_layers(path: str) -> str:
    """Why the model's weights (their names, from the safetensors headers) have no layers the plan splits, as
    evenrl.distributed.tensor_parallel.supports reads its modules ('' when they do, or cannot be read)."""
    try:
        names = weight_names(path) if path else []
    except UsageError:
        return ""
    mlp = (".mlp.down_proj.", ".mlp.experts.")  # a dense MLP's, or a mixture's routed experts (expert parallelism's)
    if not names or any(".self_attn.q_proj." in n for n in names) and any(m in n for n in names for m in mlp):
        return ""
    return (f"{path}, whose weights have no self_attn.q_proj and mlp.down_proj (or mlp.experts) layers (fused or "
            "differently named)")


def engine_check(c: RunConfig, lay: Layout, d: ModelDims) -> tuple[float, float, float, int | None, float] | None:
    """For a vLLM engine on GPUs whose share of a device cannot hold its weights and one sample's KV cache:
    (weights GiB, KV GiB, share GiB, the smallest rollout.tensor_parallel_size whose share holds them or None,
    the smallest rollout.memory_fraction that would, 1.0 for none); None when it holds them or nothing is known."""
    devices, memory = engine_devices(lay)
    if c.rollout.engine != "vllm" or lay.device != "cuda" or not memory:
        return None
    c_bytes, length = compute_bytes(c.model.dtype), c.sample_tokens()
    share = (c.rollout.memory_fraction or VLLM_GPU_SHARE) * memory * GIB
    etp = c.rollout.tensor_parallel_size
    if engine_need(d, c_bytes, etp, length) <= share:
        return None
    smallest = next((s for s in engine_splits(lay, d) if engine_need(d, c_bytes, s, length) <= share), None)
    weights, kv = engine_bytes(d, c_bytes, etp, length)
    return weights / GIB, kv / GIB, share / GIB, smallest, share_needed(engine_need(d, c_bytes, etp, length), memory)


def rule_engine_memory(p: Plan) -> list[Finding]:
    c, lay, d = p.config, p.layout, p.dims
    found = engine_check(c, lay, d) if d else None
    if found is None:
        return []
    weights, kv, share, smallest, fraction = found
    etp, memory = c.rollout.tensor_parallel_size, engine_devices(lay)[1]
    key = "rollout.tensor_parallel_size"
    over = f" over {etp} devices" if etp > 1 else ""
    text = (f"rollout.engine=vllm: each device of an engine{over} holds {weights:.1f} GiB of weights ({c.model.dtype}) "
            f"and at least one {p.sample_tokens:,}-token sample's KV cache, {kv:.2f} GiB, and its own "
            f"activations (~{ENGINE_EXTRA_GIB:g} GiB), over vLLM's share of "
            f"{share:.1f} GiB (rollout.memory_fraction={c.rollout.memory_fraction or VLLM_GPU_SHARE:g} of "
            f"{memory:.0f} GiB)")
    fixes = []
    if smallest:
        fixes.append(f"{key}={smallest} (the smallest engine that holds it)")
    if fraction <= MOST_SHARE:
        fixes.append(f"rollout.memory_fraction={fraction:g}" + (" (colocated: taken from the trainer's memory while "
                                                                 "it generates)" if not lay.rollout_devices else ""))
    tp = c.parallel.tensor_parallel_size
    fixes.append("rollout.engine=hf (samples from the training model"
                 + (f", split over {tp} ranks)" if tp > 1 else f", which {KEY} splits)"))
    return [Finding("error", "engine-memory", text, "; ".join(fixes))]
