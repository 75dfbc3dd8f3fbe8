"""Tensor parallelism applied to a model from outside it (parallel.tensor_parallel_size = T): free functions over the
mesh's `tp` DeviceMesh, the model class untouched (torchtitan's `parallelize`, NeMo-RL's DTensor plans).

    tensor_parallel(model, mesh["tp"])      # Qwen2 / Qwen2.5 / Qwen3 / Llama / Mistral-style decoders, LoRA too,
                                            # and their mixtures of experts beside expert parallelism

The plan (`PLAN`, data: module pattern -> style; each rank holds 1/T of every projection and of the vocabulary; the
residual stream, the norms and the rotary tables are whole on every rank of the group):
  q_proj, k_proj, v_proj, gate_proj, up_proj   column-wise: each rank computes its heads / its slice of the MLP
  o_proj, down_proj                            column-wise too, on the gathered input, output gathered whole: the
                                               numerically stable plan (NeMo-RL): every output element is one
                                               rank's full dot product, so no layer output is a sum of partial
                                               products across ranks and the result does not move with T beyond
                                               the matmul kernel's own blocking
  embed_tokens                                 row-wise over the vocabulary (each token's row lives on one rank;
                                               the others add exact zeros)
  q_norm, k_norm (per head: Qwen3, Gemma 3)    whole on every rank, each applied to the rank's own heads: their
                                               gradients summed over the group (PER_HEAD); a q_norm / k_norm over
                                               the whole projection (OLMo 2), which the split cuts, is refused
  lm_head                                      an evenrl.distributed.tensor_parallel.VocabParallelHead over the same
                                               vocabulary rows (tied embeddings stay one parameter): its plain
                                               forward gathers whole logits (generation), and `logprobs`
                                               computes log-probs and entropies from the rank's own vocabulary slice
                                               with one all-reduce of per-token numbers (no [tokens, vocabulary]
                                               tensor is ever gathered; core.fused_head with a VocabShard)

What the row-wise plan (Megatron's: o_proj and down_proj split by input, one all-reduce of partial outputs per
block) would change: half the bytes per block (an all-reduce of [tokens, hidden] twice, against all-gathers of
[tokens, heads x head_dim], [tokens, hidden], [tokens, intermediate] and [tokens, hidden]) and 1/T of the MLP's
gathered input in memory, for outputs that are sums over T ranks in an order that changes with T
(benchmarks/parallelism.py measures both).

Every rank of a tensor-parallel group trains the same samples and computes the same loss; gradients of a sharded
weight are its rank's own, of a whole one that sees whole inputs (the decoder's norms) the same on every rank of
the group: neither is summed across the group (the data-parallel reduction runs over the `data` dimension). A
whole weight applied to the rank's heads alone (PER_HEAD) is the exception: each rank's gradient is its heads'
part, summed over the group in the backward, so every rank holds the whole model's gradient (the same bits on every
rank: an all-reduce gives all its ranks one result) and the clip norm counts it once, as any replicated one.

A mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral: Megatron's layout with expert tensor parallelism 1): the plan
splits attention, the dense layers' MLPs and a shared expert (Qwen2-MoE's `mlp.shared_expert`: a dense MLP beside
the routed ones) as above; the router stays whole on every rank (it sees the whole hidden states, like the norms) and
the routed experts are split by expert parallelism (distributed.expert_parallel, applied after this), which every
MoE layer needs (config.compatibility refuses TP on a mixture without it). Every rank of a tensor-parallel group
holds the same whole hidden states after attention (o_proj's output is gathered whole), so each routes the same
tokens the same way; each then dispatches its own 1/TP of them to their experts and the group gathers the outputs
(distributed.expert_parallel says why that and not every rank dispatching every token).
A family whose attention has weights outside these projections (gpt-oss's per-head sinks) or whose q/k norms span
the whole projection (OLMoE, OLMo 2) is refused (`check`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from evenrl.core.fused_head import VocabShard, head_logprobs
from evenrl.core.model_plan import plan_of, record
from evenrl.errors import UsageError

# The plan as data: a module pattern under the decoder (`model.model`; transformers' `base_model_tp_plan` names the
# same projections, colwise and rowwise, in every family here: its rowwise is STABLE in evenrl's plan) -> its style.
COLWISE = "colwise"  # split by output columns: each rank computes its heads / its slice of the MLP
STABLE = "stable"  # column-wise on the gathered input, output gathered whole (the stable plan of the docstring)
VOCAB_ROWS = "vocab_rows"  # an embedding split by vocabulary rows: each token's row on one rank, exact zeros elsewhere
# a norm over each head (head_dim wide: Qwen3's, Gemma 3's q_norm / k_norm) after a column-wise projection: whole on
# every rank, applied to the rank's own heads, so each rank's gradient covers its heads only; the weight enters each
# forward through _CopyToGroup, whose backward sums the gradient over the group (transformers'
# replicated_with_grad_allreduce). Optional: a family without one (Qwen2, Llama) has nothing to apply it to.
PER_HEAD = "per_head"
PLAN = {
    "layers.*.self_attn.q_proj": COLWISE, "layers.*.self_attn.k_proj": COLWISE, "layers.*.self_attn.v_proj": COLWISE,
    "layers.*.self_attn.o_proj": STABLE,
    "layers.*.self_attn.q_norm": PER_HEAD, "layers.*.self_attn.k_norm": PER_HEAD,
    "layers.*.mlp.gate_proj": COLWISE, "layers.*.mlp.up_proj": COLWISE,
    "layers.*.mlp.down_proj": STABLE,
    # a mixture's shared expert: a dense MLP beside the routed experts (Qwen2-MoE; its scalar gate stays whole)
    "layers.*.mlp.shared_expert.gate_proj": COLWISE, "layers.*.mlp.shared_expert.up_proj": COLWISE,
    "layers.*.mlp.shared_expert.down_proj": STABLE,
    "embed_tokens": VOCAB_ROWS,
}  # and the output layer: a VocabParallelHead over the same vocabulary rows (tensor_parallel)
OPTIONAL = (PER_HEAD,)
# Patterns a layer may lack: the MLP's of a mixture's MoE layers (routed experts instead: expert parallelism's), a
# shared expert's of a family without one. Every layer must have the attention's.
PER_LAYER = ("layers.*.mlp.",)


def supports(model) -> bool:
    """Whether the plan knows this model's modules: every decoder layer has the attention projections PLAN names
    (self_attn.{q,k,v,o}_proj) and either a dense MLP (mlp.{gate,up,down}_proj) or a mixture's routed experts
    (split by expert parallelism, not here: a mixture may keep only its first layers dense, DeepSeek-V3), beside
    token embeddings and an output layer over the vocabulary."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or getattr(inner, "embed_tokens", None) is None:
        return False
    try:
        for pattern in (p for p, style in PLAN.items() if style not in OPTIONAL and not p.startswith(PER_LAYER)):
            for name in _named(inner, pattern):
                inner.get_submodule(name)
    except AttributeError:
        return False
    dense = [p.removeprefix("layers.*.") for p in PLAN if p.startswith("layers.*.mlp.") and p.count(".") == 3]
    return all(_has(layer, dense) or _routed(layer) for layer in layers)


def _has(module, names: list[str]) -> bool:
    return all(_find(module, name) is not None for name in names)


def _routed(layer) -> bool:
    """Whether the layer's MLP is a mixture's block: routed experts (transformers' fused experts module)."""
    from evenrl.distributed.expert_parallel import experts_modules

    return bool(experts_modules(getattr(layer, "mlp", torch.nn.Module())))


def check(model, size: int) -> None:
    """One line (UsageError) for a model the plan cannot split `size` ways."""
    key = "parallel.tensor_parallel_size"
    if not supports(model):
        raise UsageError(f"{key}: got {size} for {type(model).__name__}; tensor parallelism covers decoders with "
                         "q/k/v/o and gate/up/down projections (Qwen2, Qwen2.5, Qwen3, Llama, Mistral; their "
                         "mixtures of experts with expert parallelism); use 1")
    cfg = model.config.get_text_config()
    dims = {"attention heads": cfg.num_attention_heads,
            "KV heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            "vocabulary": cfg.vocab_size}
    for name, module in _targets(model.model):  # the MLPs' widths (a mixture's dense layers', its shared expert's)
        if ".mlp." in name and PLAN[_pattern(name)] == COLWISE:
            dims.setdefault("shared expert's width" if ".shared_expert." in name else "intermediate size",
                            module.out_features)
    for what, n in dims.items():
        if n % size:
            raise UsageError(f"{key}: got {size}, which does not divide the model's {what} ({n}); use a divisor of "
                             f"{n}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for name, norm in _present(model.model, PER_HEAD):
        if norm.weight.numel() != head_dim:  # OLMo 2's q_norm / k_norm: over the whole projection, which is split
            raise UsageError(f"{key}: got {size} for {type(model).__name__}, whose {name} normalises the whole "
                             f"projection ({norm.weight.numel()} wide, not one head's {head_dim}), which tensor "
                             "parallelism splits; use 1")
    planned = {n.rpartition(".")[2] for n in PLAN if n.startswith("layers.*.self_attn.")}
    for name, _ in model.model.layers[0].self_attn.named_parameters(recurse=False):  # gpt-oss's sinks: per head
        raise UsageError(f"{key}: got {size} for {type(model).__name__}, whose attention has {name!r} beside its "
                         f"projections ({', '.join(sorted(planned))}), which the plan does not split; use 1")


def tensor_parallel(model, tp_mesh) -> None:
    """Split `model` in place over the tensor-parallel DeviceMesh `tp_mesh` (its parameters become DTensors sharded
    on it) by PLAN. Call after the model is on its device and after LoRA adapters are added, before FSDP2 and before
    the optimizer is built."""
    check(model, tp_mesh.size())
    inner = model.model
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is inner.embed_tokens.weight
    for name, module in _targets(inner):
        _apply(module, PLAN[_pattern(name)], tp_mesh)
    if head is not None and head.weight.shape[0] == model.config.get_text_config().vocab_size:
        weight = inner.embed_tokens.weight if tied else _shard_rows(head.weight, tp_mesh)
        model.set_output_embeddings(VocabParallelHead(weight, head.bias, tp_mesh))
    record(model).tensor_parallel = tp_mesh


def _named(inner, pattern: str) -> list[str]:
    """The modules a pattern names ("layers.*.x": x of every decoder layer, in order)."""
    return [pattern.replace("*", str(i)) for i in range(len(inner.layers))] if "*" in pattern else [pattern]


def _pattern(name: str) -> str:
    """The PLAN pattern a module name matches ("layers.3.mlp.up_proj" -> "layers.*.mlp.up_proj")."""
    parts = name.split(".")
    return ".".join(["layers", "*", *parts[2:]]) if parts[0] == "layers" else name


def _targets(inner) -> list[tuple[str, torch.nn.Module]]:
    """Every module the plan splits in this model, by name, in PLAN's order: each pattern's modules, where a layer
    may lack it (OPTIONAL styles, PER_LAYER patterns) only those present."""
    found = []
    for pattern, style in PLAN.items():
        if style in OPTIONAL or pattern.startswith(PER_LAYER):
            found += [(n, m) for n in _named(inner, pattern) if (m := _find(inner, n)) is not None]
        else:
            found += [(n, inner.get_submodule(n)) for n in _named(inner, pattern)]
    return found


def _find(inner, name: str) -> torch.nn.Module | None:
    try:
        return inner.get_submodule(name)
    except AttributeError:
        return None


def _present(inner, style: str) -> list[tuple[str, torch.nn.Module]]:
    """The modules of `style`'s patterns this model has (an optional style's may be absent)."""
    return [(n, m) for pattern, s in PLAN.items() if s == style for n in _named(inner, pattern)
            if (m := _find(inner, n)) is not None]


def _apply(module, style: str, tp_mesh) -> None:
    """One module split in `style`; a LoRA-wrapped projection's base layer and its adapter's B with it (A stays
    whole: it reads the replicated input)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    base = getattr(module, "base_layer", None)
    if style == PER_HEAD:
        _sum_grad_over(module, tp_mesh.get_group())
    elif style == VOCAB_ROWS:
        parallelize_module(module, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    elif style == COLWISE:
        parallelize_module(base if base is not None else module, tp_mesh, ColwiseParallel())
        for lora_b in _adapters(module, "lora_B") if base is not None else ():
            parallelize_module(lora_b, tp_mesh, ColwiseParallel())
    elif base is None:  # STABLE: the input gathered whole, each rank's output columns gathered
        parallelize_module(module, tp_mesh, ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate()))
    else:  # LoRA: the adapter's A reads the same gathered input as the base layer
        parallelize_module(module, tp_mesh, PrepareModuleInput(input_layouts=(Shard(-1),),
                                                               desired_input_layouts=(Replicate(),),
                                                               use_local_output=True))
        parallelize_module(base, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
        for lora_b in _adapters(module, "lora_B"):
            parallelize_module(lora_b, tp_mesh, ColwiseParallel(output_layouts=Replicate()))


def _sum_grad_over(module, group) -> None:
    """`module.weight` enters each forward through _CopyToGroup (the same values; its backward sums the gradient
    over `group`): swapped in by a forward pre-hook, the parameter put back by a forward hook, so its name, its
    place in the state dict and FSDP2's own swaps (whose unsharded parameter is what the pre-hook finds) are as
    they were. A recomputed forward (activation checkpointing) passes through the hooks again."""
    held = []

    def enter(mod, args):
        held.append(mod._parameters["weight"])
        mod._parameters["weight"] = _CopyToGroup.apply(held[-1], group)

    def leave(mod, args, output):
        mod._parameters["weight"] = held.pop()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _adapters(proj, kind: str) -> list:
    return list(getattr(proj, kind, {}).values()) if hasattr(proj, kind) else []


def _shard_rows(weight: Tensor, tp_mesh) -> torch.nn.Parameter:
    from torch.distributed.tensor import Shard, distribute_tensor

    return torch.nn.Parameter(distribute_tensor(weight.detach(), tp_mesh, [Shard(0)]),
                              requires_grad=weight.requires_grad)


def is_tensor_parallel(model) -> bool:
    return plan_of(model).tensor_parallel is not None


class VocabParallelHead(torch.nn.Module):
    """The output layer over a vocabulary split by rows over a tensor-parallel group: `weight` a DTensor sharded on
    dim 0 (the embedding's own parameter when tied). `forward(hidden)` returns whole logits (each rank's slice
    all-gathered: generation); `logprobs(...)` (what evenrl.models.output_head's installed head calls) the log-probs
    and entropies of targets from the local slice, exact up to float rounding (tests/test_tensor_parallel.py)."""

    def __init__(self, weight: torch.nn.Parameter, bias: Tensor | None, tp_mesh):
        super().__init__()
        self.weight = weight
        self.bias = bias  # Qwen2/Llama heads have none; a bias would need the same row split
        if bias is not None:
            raise UsageError("parallel.tensor_parallel_size: an output layer with a bias is not split; use 1")
        self.mesh = tp_mesh
        self.group = tp_mesh.get_group()
        rows = weight.to_local().shape[0]
        self.offset = tp_mesh.get_local_rank() * rows  # Shard(0) of a divisible vocabulary: equal slices in order

    def forward(self, hidden: Tensor) -> Tensor:
        local = torch.nn.functional.linear(hidden, self.weight.to_local())
        return _GatherVocab.apply(local, self.group)

    def logprobs(self, hidden: Tensor, targets: Tensor, temperature: float, *, entropy: bool,
                        entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
        return head_logprobs(_CopyToGroup.apply(hidden, self.group), self.weight.to_local(), None, targets,
                             temperature, entropy=entropy, entropy_grad=entropy_grad,
                             vocab_shard=VocabShard(self.offset, self.weight.shape[0],
                                                    lambda t, op: _all_reduce(t, op, self.group)))


def _all_reduce(t: Tensor, op: str, group) -> Tensor:
    import torch.distributed as tdist

    tdist.all_reduce(t, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM, group=group)
    return t


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group: the hidden states are whole on every rank,
    and each rank's vocabulary slice adds its part of their gradient (Megatron's copy-to-region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.contiguous().clone(), "sum", ctx.group), None


class _GatherVocab(torch.autograd.Function):
    """Each rank's [..., V/T] logits -> [..., V] on every rank; the backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx, local, group):
        import torch.distributed as tdist

        n = tdist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(n)]
        tdist.all_gather(parts, local.contiguous(), group=group)
        ctx.group, ctx.width, ctx.index = group, local.shape[-1], tdist.get_rank(group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.index * ctx.width:(ctx.index + 1) * ctx.width].contiguous(), None
