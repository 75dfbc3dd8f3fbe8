"""Expert parallelism (parallel.expert_parallel_size = EP) applied to a mixture of experts from outside it: each
rank of an `ep` group (evenrl.distributed.mesh_shape) holds 1/EP of every MoE layer's experts, and every token goes
to its experts' ranks and back by all-to-all.

    expert_parallel(model, dist.expert_mesh(device))   # before FSDP2 (sharding.shard) and the optimizer

The layout is torchtitan's and prime-rl's: the ep group borrows training ranks, the ranks holding the same
experts (`edata`) reduce their gradients (or, with FSDP2, shard them), and the dense layers keep the usual mesh.
- Weights stay in transformers' fused layout: each experts module's 3-D tensors (gate_up_proj [E, ...], down_proj
  [E, ...], gpt-oss's biases [E, ...], LoRA's per-expert adapters [E, ...]: models.expert_lora) become DTensors
  sharded on dim 0 over "ep" (rank j of a group holds experts j*E/EP .. (j+1)*E/EP - 1). DCP saves and loads them by global shape, so a checkpoint resumes at any EP, and
  `full_tensor()` gives engines and the final save the whole tensors.
- The forward goes through transformers' `ExpertsInterface`: the backend "evenrl_ep" is registered there and set
  as the model's experts implementation; no class or forward is patched. Per MoE layer: the (token, expert) pairs
  sorted by expert, their counts per expert exchanged by all-to-all; the tokens sent to their experts' ranks (a
  differentiable all-to-all with uneven splits); the local experts run as one grouped GEMM (transformers'
  `grouped_mm` backend, each pair top-1 with weight 1; with LoRA on the experts each local expert's weight has its
  adapters folded in first: `_adapted`); the outputs sent back by the reverse all-to-all; then each
  pair's output times its routing weight, summed per token as the `grouped_mm` backend sums them, so one process
  and EP add the same products in the same order.
- Every rank makes the same collectives whatever the routing. A rank that receives no tokens still runs its experts
  on one zero row cut to none: its output then depends on the received tensor and the local weights, so its
  backward reaches the reverse all-to-all (without that it skips it and the other ranks wait for ever).
- The routers' hooks (evenrl.models.routing: record, replay, count) see the router's outputs before the experts are
  called, so router replay and the load-balancing loss work unchanged.
- Generation (evenrl's sampler on the training model, greedy evaluation) runs each rank on its own prompts for as
  many tokens as they take, so it cannot meet in per-layer all-to-alls: `gathered_experts` (inside
  distributed.weights.gathered, as FSDP2 gathers its units there) all-gathers every layer's experts once per
  generation, and the backend runs them all locally until the block ends.
- Gradients: an expert weight's gradient is complete on its rank after the backward all-to-all (every token routed
  to the expert contributed), so it is summed over `edata` only (distributed.ops.all_reduce_grads; FSDP2
  reduce-scatters it there), never over the whole data group; the clip norm sums its squares over "ep"
  (distributed.ops.clip_grad_norm).
- train.reproducibility=bitwise (`per_source`, replicated, without TP or SP): the tokens each source rank sent run
  apart, each expert's rows a call of their own, on leaves of the local weights per source, so each micro-batch's
  expert gradient is its own term of the fixed-point sum (take_terms, distributed.exact); a model without EP
  computes its experts in the same order, its experts' weights reallocated as the shards are (canonical_experts).
  EP e is then the one-process run bit for bit (measured: Qwen3-MoE, gpt-oss).

With tensor parallelism (Megatron's layout with expert tensor parallelism 1: distributed.tensor_parallel splits
attention and the dense MLPs, this the routed experts): after attention every rank of a tp group holds the same whole
hidden states, routes them with the same whole router (so router replay, the load statistics and the router's
gradient are those without TP) and hands the same (token, expert) pairs to its experts module. Each rank then
dispatches only its own 1/tp of the tokens (`_split_tokens`: contiguous slices, uneven where tp does not divide
them) over an ep group that may span tp ranks (distributed.mesh_shape), and the tp group all-gathers the slices'
outputs: every token meets its experts once and its output is one rank's arithmetic, the same bits on every rank
of the group, as the next layer's replicated input must be; the backward gathers the slices' input and routing-weight
gradients the same way. Simpler would be each tp rank dispatching every token over an ep group of its own tp index:
exact too, but the experts then held again at every tp index (Pe / (world / tp) per rank under FSDP2 instead of
Pe / world) and run tp times, which defeats TP for the model it is for (a 235B mixture is mostly experts).

transformers 5.19's own EP plan (a config's `base_model_ep_plan`, `ep_dispatch_experts`, DistributedConfig(ep_size))
computes the same (measured here on 2 gloo ranks: logits equal, gradients within 1e-9) but replaces each experts
module's forward with one that always dispatches, which generation cannot use: hence a backend of evenrl's own in
the same interface. The local experts run through `grouped_mm` whatever the model's experts implementation was.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import Tensor

from evenrl.core.model_plan import plan_of, record
from evenrl.distributed.guard import guard
from evenrl.errors import UsageError

BACKEND = "evenrl_ep"  # the name registered in transformers' ExpertsInterface


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of a mixture (transformers' `use_experts_implementation` classes: fused 3-D weights, a
    forward through the ExpertsInterface); [] for a dense model."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


@dataclass
class ExpertShard:
    """What an experts module's forward needs under expert parallelism (`shard_of(module)`)."""

    group: Any  # this rank's ep process group
    size: int  # EP
    index: int  # this rank's place in its ep group: it holds experts index*local .. (index+1)*local - 1
    local: int  # experts per rank (E / EP)
    names: tuple[str, ...]  # the module's per-expert tensors (gate_up_proj, down_proj, biases, adapters.lora_A...)
    whole: dict[str, Tensor] | None = None  # every expert, while gathered_experts holds them (generation)
    tp: Any = None  # this rank's tensor-parallel group (None: no TP): its ranks split the tokens they share
    tp_size: int = 1
    tp_index: int = 0
    per_source: bool = False  # train.reproducibility=bitwise: each source rank's tokens a GEMM of their own (`exact`)


# under `per_source`: (split parameter, the leaf one source's tokens computed with) since the last take_terms()
_TERMS: list[tuple[torch.nn.Parameter, Tensor]] = []
# experts modules of a model not split that compute in the canonical order (`canonical_experts`)
_CANONICAL: weakref.WeakSet = weakref.WeakSet()


# each split experts module's ExpertShard, kept beside the module (not set on it): transformers' ExpertsInterface hands
# the backend the module alone
_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shard_of(module: torch.nn.Module) -> ExpertShard | None:
    """The ExpertShard of an experts module split by `expert_parallel` (None: not split)."""
    return _SHARDS.get(module)


def is_expert_parallel(model: torch.nn.Module) -> bool:
    return plan_of(model).expert_parallel > 1


def expert_parallel(model: torch.nn.Module, mesh, tp_group=None, exact: bool = False) -> None:
    """Split every experts module of `model` over the "ep" dimension of `mesh` (distributed.mesh.expert_mesh), in
    place: its per-expert tensors become DTensors sharded on dim 0, and its forward dispatches (module docstring).
    tp_group: the rank's tensor-parallel group when the model is split by tensor parallelism too (its ranks then
    dispatch a slice each of the tokens they share). exact: train.reproducibility=bitwise (ExpertShard.per_source).
    Call after the model is on its device, after LoRA adapters are added and after tensor parallelism, before FSDP2
    and the optimizer. A model whose experts EP does not divide is
    one line (UsageError), the mesh's own wording."""
    from torch.distributed.tensor import DTensor, Shard
    from transformers.integrations.moe import ExpertsInterface

    from evenrl.distributed.mesh import shape

    ep_mesh = mesh["ep"]
    ep, index = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = experts_modules(model)
    wrong = shape().experts_problem(modules[0].num_experts if modules else 0)
    if wrong:
        raise UsageError(wrong)
    ExpertsInterface.register(BACKEND, experts_forward)
    for m in modules:
        experts = int(m.num_experts)
        local = experts // ep
        names = tuple(n for n, _ in m.named_parameters())  # its adapters' too
        for n in names:
            p = m.get_parameter(n)
            if p.shape[0] != experts:
                raise UsageError(f"parallel.expert_parallel_size: {type(m).__name__}.{n} is not laid out by expert "
                                 f"(shape {tuple(p.shape)}, {experts} experts); use 1")
            mine = p.detach()[index * local:(index + 1) * local].clone()
            split = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            owner, _, attr = n.rpartition(".")
            m.get_submodule(owner).register_parameter(attr, torch.nn.Parameter(split, requires_grad=p.requires_grad))
        tp = {} if tp_group is None else dict(tp=tp_group, tp_size=tdist.get_world_size(tp_group),
                                              tp_index=tdist.get_rank(tp_group))
        _SHARDS[m] = ExpertShard(ep_mesh.get_group(), ep, index, local, names, **tp, per_source=exact)
    model.set_experts_implementation(BACKEND)
    record(model).expert_parallel = ep


def canonical_experts(model: torch.nn.Module) -> None:
    """train.reproducibility=bitwise on a mixture without expert parallelism: its experts compute as a split model's do
    under bitwise (`_canonical`: the (token, expert) pairs in stable expert order, each expert's rows a GEMM of
    their own, the pairs' outputs weighted and summed after), so that EP e can be one process's run bit for bit
    (measured: Qwen3-MoE, gpt-oss; docs/reproducibility.md). transformers' grouped_mm backend alone would not do:
    it orders the pairs with torch.sort, which is not stable on CPU past 16 elements (measured: rows of one
    expert reordered, its weight gradient summed in another order, 1.5e-8 apart)."""
    from transformers.integrations.moe import ExpertsInterface

    modules = [m for m in experts_modules(model) if m not in _SHARDS]
    with torch.no_grad():
        for p in (p for m in modules for p in m.parameters()):
            # in memory of the allocator's alignment, as expert_parallel's shards are (clones): a weight loaded from
            # safetensors may start anywhere (measured: 56 bytes past a 64-byte boundary), and the backward GEMM
            # through gpt-oss's [E, in, out] experts gives other bits for another alignment (3.7e-9 in dx)
            p.data = p.data.clone()
    if modules:
        ExpertsInterface.register(BACKEND, experts_forward)
        _CANONICAL.update(modules)
        model.set_experts_implementation(BACKEND)


@contextlib.contextmanager
def gathered_experts(model: torch.nn.Module):
    """Within the block every experts module runs all its experts locally, gathered once over its ep group (a
    collective every rank joins at the same point: generation, evaluation). A no-op without expert parallelism."""
    shards = [(m, _SHARDS[m]) for m in model.modules() if m in _SHARDS]
    if shards:
        with torch.no_grad(), guard("expert all-gather"):
            for m, s in shards:
                s.whole = {n: m.get_parameter(n).full_tensor() for n in s.names}
    try:
        yield model
    finally:
        for _, s in shards:
            s.whole = None


class _Weights:
    """An experts module seen with other weights (its own, its local shard, or every expert gathered) by
    transformers' grouped_mm backend, which reads the weights and num_experts from the object it is given; all else
    (the activation, the gate, the layout flags) is the module's own."""

    def __init__(self, module: torch.nn.Module, weights: dict[str, Tensor], experts: int):
        self.__dict__.update(weights)
        self.num_experts, self._is_expert_parallel, self._module = experts, False, module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _adapted(module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The weights the experts compute with: with LoRA on the experts (models.expert_lora, whose adapters sit on the
    module as `adapters`, split here with the experts), each target with its adapters folded in; else `tensors`.
    Found on the module, not imported: models/ is a layer beside this one."""
    adapters = getattr(module, "adapters", None)
    return tensors if adapters is None else adapters.fold_into(tensors)


def experts_forward(module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The "evenrl_ep" experts backend: hidden [N, H], top_k_index / top_k_weights [N, k] -> [N, H]."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    shard = _SHARDS.get(module)
    if shard is None:  # a model not split (or a copy built from the same config object)
        if module in _CANONICAL:
            return _canonical(module, dict(module.named_parameters()), module.num_experts, hidden, top_k_index,
                              top_k_weights)
        own = _Weights(module, _adapted(module, dict(module.named_parameters())), module.num_experts)
        return grouped_mm_experts_forward(own, hidden, top_k_index, top_k_weights)
    if shard.whole is not None:  # generation: every expert is here
        if shard.per_source:
            return _canonical(module, shard.whole, shard.local * shard.size, hidden, top_k_index, top_k_weights)
        return grouped_mm_experts_forward(_Weights(module, _adapted(module, shard.whole), shard.local * shard.size),
                                          hidden, top_k_index, top_k_weights)
    if shard.tp_size > 1:
        return _split_tokens(module, shard, hidden, top_k_index, top_k_weights)
    return _dispatch(module, shard, hidden, top_k_index, top_k_weights)


def _split_tokens(module, shard: ExpertShard, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """Under tensor parallelism: this rank's contiguous 1/tp of the tokens its tp group shares dispatched, the
    group's outputs all-gathered (module docstring)."""
    n, tp = hidden.shape[0], shard.tp_size
    sizes = [n // tp + (j < n % tp) for j in range(tp)]
    lo = sum(sizes[:shard.tp_index])
    hi = lo + sizes[shard.tp_index]
    out = _dispatch(module, shard, _TpSlice.apply(hidden, lo, hi, sizes, shard.tp), top_k_index[lo:hi],
                    _TpSlice.apply(top_k_weights, lo, hi, sizes, shard.tp))
    return _TpGather.apply(out, lo, hi, sizes, shard.tp)


def _gather_rows(x: Tensor, sizes: list[int], group) -> Tensor:
    """Each tp rank's rows (sizes[j] of them on rank j), concatenated in rank order on every rank."""
    most = max(sizes)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[:len(x)] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    tdist.all_gather(parts, padded, group=group)
    return torch.cat([p[:k] for p, k in zip(parts, sizes)])


class _TpSlice(torch.autograd.Function):
    """This rank's rows lo:hi of a tensor every rank of its tp group holds whole; the backward gathers every rank's
    rows' gradients, so the whole tensor's gradient is the same on every rank."""

    @staticmethod
    def forward(ctx, x: Tensor, lo: int, hi: int, sizes: list[int], group) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return x[lo:hi]

    @staticmethod
    def backward(ctx, g: Tensor):
        return _gather_rows(g.contiguous(), ctx.sizes, ctx.group), None, None, None, None


class _TpGather(torch.autograd.Function):
    """Every rank's rows of the tp group concatenated; the backward keeps this rank's rows (their gradient is the
    same on every rank: what follows is replicated)."""

    @staticmethod
    def forward(ctx, x: Tensor, lo: int, hi: int, sizes: list[int], group) -> Tensor:
        ctx.lo, ctx.hi = lo, hi
        return _gather_rows(x.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g[ctx.lo:ctx.hi], None, None, None, None


class _Exchange(torch.autograd.Function):
    """Rows to the ranks of a group with uneven splits (send[i] rows to rank i, recv[i] from it); the backward sends
    the gradients back the same way reversed. (torch.distributed.nn's differentiable all_to_all_single is
    deprecated in torch 2.13, and _functional_collectives' is differentiable only in recent releases.)"""

    @staticmethod
    def forward(ctx, x: Tensor, group, send: list[int], recv: list[int]) -> Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = x.new_empty((sum(recv), *x.shape[1:]))
        tdist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        return _Exchange.apply(g, ctx.group, ctx.recv, ctx.send), None, None, None


def _dispatch(module, shard: ExpertShard, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    k = top_k_index.shape[1]
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)  # pairs by expert, hence by the rank that holds it
    send = hidden[order // k]
    counts = torch.bincount(ids, minlength=shard.local * shard.size)
    got = torch.empty_like(counts)
    tdist.all_to_all_single(got, counts, group=shard.group)  # [source rank x local expert]
    got = got.view(shard.size, shard.local)
    send_sizes, recv_sizes = counts.view(shard.size, shard.local).sum(dim=1).tolist(), got.sum(dim=1).tolist()
    received = _Exchange.apply(send, shard.group, send_sizes, recv_sizes)
    local_ids = torch.arange(shard.local, device=ids.device).repeat(shard.size).repeat_interleave(got.reshape(-1))
    out = _local_experts(module, shard, received, local_ids, recv_sizes)
    back = _Exchange.apply(out, shard.group, recv_sizes, send_sizes)
    return _weighted_sum(back, order, top_k_weights, hidden.dtype)


def _weighted_sum(out: Tensor, order: Tensor, top_k_weights: Tensor, dtype: torch.dtype) -> Tensor:
    """The pairs' outputs (in `order`, the pairs sorted by expert) back in token order, each times its weight, summed
    over a token's k pairs: the grouped_mm backend's own arithmetic. [N, H]."""
    n, k = top_k_weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    return (out[inverse].view(n, k, out.shape[-1]) * top_k_weights.unsqueeze(-1)).sum(dim=1).to(dtype)


def _local_experts(module, shard: ExpertShard, tokens: Tensor, ids: Tensor, sources: list[int]) -> Tensor:
    """This rank's experts over the tokens sent to them (ids: the local expert of each; sources: how many came from
    each rank of the ep group, in rank order), one grouped GEMM; under `per_source`, one per source rank."""
    if not len(tokens):  # nothing routed here: one zero row, cut to none, keeps this rank in the backward exchange
        row = tokens.sum(dim=0, keepdim=True)
        return _grouped(module, shard, row, ids.new_zeros((1,)))[:0]
    if not shard.per_source:
        return _grouped(module, shard, tokens, ids)
    parts, at = [], 0
    for n in sources:
        if n:
            parts.append(_grouped(module, shard, tokens[at:at + n], ids[at:at + n], terms=torch.is_grad_enabled()))
        at += n
    return torch.cat(parts)


def _grouped(module, shard: ExpertShard, tokens: Tensor, ids: Tensor, terms: bool = False) -> Tensor:
    """tokens through this rank's experts (ids: each row's local expert), top-1 with weight 1; under `per_source`
    each expert's rows (ids ascending) a call of their own (`_by_expert`). terms: on leaves of the local weights of
    their own, kept in _TERMS for take_terms (the parameters themselves get no gradient)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    weights = {n: module.get_parameter(n).to_local() for n in shard.names}
    if terms:
        for n, w in weights.items():
            p = module.get_parameter(n)
            if p.requires_grad:
                weights[n] = w.detach().requires_grad_()
                _TERMS.append((p, weights[n]))
    if shard.per_source:
        return _by_expert(module, weights, shard.local, tokens, ids)
    local = _Weights(module, _adapted(module, weights), shard.local)
    return grouped_mm_experts_forward(local, tokens, ids[:, None], tokens.new_ones((len(tokens), 1)))


def _by_expert(module, weights: dict[str, Tensor], experts: int, tokens: Tensor, ids: Tensor) -> Tensor:
    """Rows sorted by expert (ids ascending) through their experts, each expert's rows one call of transformers'
    grouped_mm backend (top-1, weight 1): an expert's rows keep their order whatever other experts' rows share the
    micro-batch or the rank (the backend's own sort is not stable), and its GEMM sees its rows alone."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    local = _Weights(module, _adapted(module, weights), experts)
    parts, at = [], 0
    for count in torch.bincount(ids, minlength=experts).tolist():
        if count:
            rows = slice(at, at + count)
            parts.append(grouped_mm_experts_forward(local, tokens[rows], ids[rows, None],
                                                    tokens.new_ones((count, 1))))
        at += count
    return torch.cat(parts) if parts else tokens[:0]


def _canonical(module, weights: dict[str, Tensor], experts: int, hidden: Tensor, top_k_index: Tensor,
               top_k_weights: Tensor) -> Tensor:
    """Every expert here, in the order a split model's bitwise dispatch uses (`_dispatch` with `per_source`): the
    pairs in stable expert order, `_by_expert`, each pair's output times its weight, summed per token."""
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    out = _by_expert(module, weights, experts, hidden[order // top_k_index.shape[1]], ids[order])
    return _weighted_sum(out, order, top_k_weights, hidden.dtype)


def take_terms() -> list[tuple[torch.nn.Parameter, Tensor]]:
    """Under `per_source` (train.reproducibility=bitwise): each (split parameter, one source rank's gradient of its
    local shard) that the backward passes since the last call reached; forgets them. Why per source: an expert's
    tokens from the micro-batches of its ep group's ranks in one GEMM add their products to its weight gradient in
    one float sum, which the layout groups (which micro-batches meet in a wave); one GEMM per source rank (one
    micro-batch's tokens, or its slice under sequence or tensor parallelism) gives each micro-batch's gradient as on
    one process, and the fixed-point sum (distributed.exact) adds them in any order. Their forward is per source too,
    so a token's output does not depend on the GEMM's other rows either (old and reference log-probs included)."""
    got = [(p, leaf.grad) for p, leaf in _TERMS if leaf.grad is not None]
    _TERMS.clear()
    return got
