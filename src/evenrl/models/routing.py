"""The one seam between evenrl and a mixture of experts' routers: which experts each token goes to, recorded, replayed
or counted, from outside the model (a forward hook on each router; the model's classes are untouched).

Every mixture of experts evenrl trains routes the way transformers 5 writes it: `layers[i].mlp.gate` (gpt-oss:
`.router`) is a router module whose forward returns (router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])
and `layers[i].mlp.experts` takes (hidden, top_k_index, top_k_weights) through transformers' experts interface
(`grouped_mm` on CPU), the expert weights in their fused 3-D layout. The families differ only in how the weights
come from the logits (FAMILIES, by router class): a hook that swaps the top-k selection for recorded ids recomputes
the weights from the router's own logits by the family's rule, so the router keeps its gradient (router replay, R3).

A forward call's `RoutePlan` says what the hooks do: replay ids at some tokens, record the ids used, count each
expert's tokens and keep each layer's probability sums (the load-balancing loss). The plan of the last forward stays
on the model until the next one replaces it, so activation checkpointing's recompute (the router called again
inside the backward) replays the same ids; what the hooks keep is keyed by the router's layer, so a second call
overwrites rather than appends.

An expert-parallel backend plugs in below this seam (transformers' `ExpertsInterface`, which the experts' forward
already dispatches through): the hooks see only the router's outputs.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from evenrl.core.batch import Batch, Ragged
from evenrl.core.moe import route_dtype


def _softmax_topk(router, logits: Tensor, ids: Tensor) -> Tensor:
    """Qwen3-MoE, Qwen2-MoE, OLMoE: softmax over all experts in float32, the chosen ones' probabilities,
    renormalised with norm_topk_prob, in the logits' dtype."""
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    if router.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


def _softmax_topk_normalised(router, logits: Tensor, ids: Tensor) -> Tensor:
    """Qwen3-VL-MoE: as _softmax_topk, always renormalised (its router has no norm_topk_prob), in the logits' dtype."""
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    return (w / w.sum(dim=-1, keepdim=True)).to(logits.dtype)


def _softmax_topk_renormalised(router, logits: Tensor, ids: Tensor) -> Tensor:
    """Mixtral: as _softmax_topk, always renormalised, left in float32."""
    w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    return w / w.sum(dim=-1, keepdim=True)


def _sigmoid_topk(router, logits: Tensor, ids: Tensor) -> Tensor:
    """DeepSeek-V3: sigmoid scores (chosen with the correction bias added, weighted without it), renormalised with
    norm_topk_prob, times routed_scaling_factor."""
    w = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


def _topk_softmax(router, logits: Tensor, ids: Tensor) -> Tensor:
    """gpt-oss: a softmax over the chosen experts' logits."""
    top = logits.gather(1, ids)
    return torch.softmax(top, dim=1, dtype=top.dtype)


@dataclass(frozen=True)
class Family:
    """How a router family turns its logits into the chosen experts' weights, and into the per-expert probabilities
    the load-balancing loss averages (None: the family trains without one)."""

    weights: Callable[[torch.nn.Module, Tensor, Tensor], Tensor]
    balance_probs: Callable[[Tensor], Tensor] | None


def _all_softmax(logits: Tensor) -> Tensor:
    """transformers' load_balancing_loss_func: a softmax over every expert's logit."""
    return torch.softmax(logits.float(), dim=-1)


# Router classes of transformers 5.19 by name; tests/test_moe.py checks each rule against the router's own output.
FAMILIES: dict[str, Family] = {
    "Qwen3MoeTopKRouter": Family(_softmax_topk, _all_softmax),
    "Qwen2MoeTopKRouter": Family(_softmax_topk, _all_softmax),
    "OlmoeTopKRouter": Family(_softmax_topk, _all_softmax),
    "Qwen3VLMoeTextTopKRouter": Family(_softmax_topk_normalised, _all_softmax),
    "MixtralTopKRouter": Family(_softmax_topk_renormalised, _all_softmax),
    # aux-loss-free: balanced by e_score_correction_bias, which the checkpoint fixes (a buffer: no optimizer sees it)
    "DeepseekV3TopkRouter": Family(_sigmoid_topk, None),
    "GptOssTopKRouter": Family(_topk_softmax, _all_softmax),
}


@dataclass
class RoutePlan:
    """What the routers do in one forward call; [n] is the call's tokens in the order the model flattens them
    (batch-major). Filled by the hooks, per MoE layer (0..L-1): `used` the ids each token went to (record), `loads`
    the counted tokens per expert, `differs` where a replayed token's live top-k set is another one (stats),
    `prob_sums` the counted tokens' probability sums [E] with their gradient (balance)."""

    replay: Tensor | None = None    # [n, L, k] recorded expert ids
    replayed: Tensor | None = None  # [n] bool: the tokens `replay` holds (others route live); None: all
    counted: Tensor | None = None   # [n] bool: the tokens loads and prob_sums count; None: all
    apply: bool = True              # use `replay` instead of the router's choice (False: only compare, stats)
    record: bool = False
    stats: bool = False
    balance: bool = False
    used: dict[int, Tensor] = field(default_factory=dict)
    loads: dict[int, Tensor] = field(default_factory=dict)
    differs: dict[int, Tensor] = field(default_factory=dict)
    prob_sums: dict[int, Tensor] = field(default_factory=dict)
    rows: Ragged | None = None  # record, set by the packed forward: the routes of the call's rows (route_rows)

    def stacked(self, name: str) -> Tensor:
        """`used`, `loads` or `differs` of every layer, stacked on dim 1 (used: [n, L, k]) or 0 (loads: [L, E],
        differs: [L, n])."""
        got = getattr(self, name)
        return torch.stack([got[layer] for layer in sorted(got)], dim=1 if name == "used" else 0)


@dataclass
class Options:
    """What the training code wants of the next forwards (`options`): replay the micro-batch's routes column (or,
    with stats, only compare the live choice with it), record the routes used, keep statistics, keep the
    probability sums of the load-balancing loss."""

    replay: bool = True
    record: bool = False
    stats: bool = False
    balance: bool = False


class Routing:
    """A model's routers, their hooks and the plan of the current forward."""

    def __init__(self, model):
        self.layer_of: dict[torch.nn.Module, int] = {}
        self.families: list[Family] = []
        for module in model.modules():
            family = FAMILIES.get(type(module).__name__)
            if family is not None:
                self.layer_of[module] = len(self.families)
                self.families.append(family)
                module.register_forward_hook(self._hook)
        routers = list(self.layer_of)
        self.experts, self.top_k = int(routers[0].num_experts), int(routers[0].top_k)
        if any((int(r.num_experts), int(r.top_k)) != (self.experts, self.top_k) for r in routers):
            raise ValueError("routing: the MoE layers differ in experts or top-k; evenrl records one shape per token")
        self.dtype = route_dtype(self.experts)
        self.plan: RoutePlan | None = None
        self.options = Options()

    @property
    def layers(self) -> int:
        return len(self.families)

    def _hook(self, module, args, output):
        plan = self.plan
        if plan is None:
            return None
        layer = self.layer_of[module]
        family = self.families[layer]
        logits, weights, ids = output
        if plan.replay is not None:
            want = plan.replay[:, layer].to(device=ids.device, dtype=ids.dtype)
            if plan.replayed is not None:
                replayed = plan.replayed.to(ids.device)
                want = torch.where(replayed[:, None], want, ids)
            if plan.stats:
                differs = (want.sort(dim=-1).values != ids.sort(dim=-1).values).any(dim=-1)
                plan.differs[layer] = (differs if plan.replayed is None else differs & replayed).cpu()
            if plan.apply:
                weights, ids = family.weights(module, logits, want), want
        counted = None if plan.counted is None else plan.counted.to(ids.device)
        if plan.record:
            plan.used[layer] = ids.detach().to(self.dtype)
        if plan.stats:
            chosen = ids if counted is None else ids[counted]
            plan.loads[layer] = torch.bincount(chosen.flatten(), minlength=self.experts).cpu()
        if plan.balance:
            probs = family.balance_probs(logits)
            plan.prob_sums[layer] = (probs if counted is None else probs[counted]).sum(dim=0)
        return logits, weights, ids


# each model's Routing, kept beside the model (not set on it)
_ROUTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def routing(model) -> Routing | None:
    """The model's Routing (its hooks installed on first use), or None for a model without known routers."""
    state = _ROUTING.get(model)
    if state is None and is_moe(model):
        state = _ROUTING[model] = Routing(model)
    return state


def decoder_layers(model) -> list[int]:
    """Each MoE layer's decoder-layer index, in the routes' order: the number after `layers.` in its router's name
    (an engine that numbers every decoder layer, dense ones too, gives its routes by it: vLLM)."""
    state = routing(model)
    names = {module: name for name, module in model.named_modules()}
    return [int(re.search(r"(?:^|\.)layers\.(\d+)\.", names[r]).group(1)) for r in state.layer_of]


def is_moe(model) -> bool:
    """Whether the model routes tokens through routers evenrl knows (FAMILIES)."""
    if model in _ROUTING:
        return True
    return any(type(m).__name__ in FAMILIES for m in model.modules())


def unknown_routers(model) -> list[str]:
    """Router-like classes of the model that FAMILIES does not know (a mixture of experts evenrl cannot replay or
    balance)."""
    return sorted({type(m).__name__ for m in model.modules()
                   if "router" in type(m).__name__.lower() and type(m).__name__ not in FAMILIES})


@contextlib.contextmanager
def options(model, **changes):
    """Within the block the training forwards of `model` (its packed forward: packed_plan) use these Options; a
    no-op for a dense model."""
    state = routing(model)
    if state is None:
        yield None
        return
    old = state.options
    state.options = Options(**{**old.__dict__, **changes})
    try:
        yield state
    finally:
        state.options = old


@contextlib.contextmanager
def recording(model, record: bool = True):
    """Within the block (generation) no training plan reaches the routers (a stale one must never reach a decoding
    step), and with `record` every forward records the ids its routers chose: the recorder's `take()` returns those
    of the last forward, [n, L, k]. None for a dense model or without `record`."""
    state = routing(model)
    if state is None:
        yield None
        return
    state.plan = None
    try:
        yield _Recorder(state) if record else None
    finally:
        state.plan = None


class _Recorder:
    def __init__(self, state: Routing):
        self.state = state
        state.plan = RoutePlan(record=True)

    def take(self) -> Tensor:
        plan = self.state.plan
        self.state.plan = RoutePlan(record=True)
        return plan.stacked("used")


def clear(model) -> None:
    """Forget the last forward's plan (nothing will recompute it)."""
    state = _ROUTING.get(model)
    if state is not None:
        state.plan = None


def packed_plan(model, batch: Batch, lo: int, n: int, padded: int) -> RoutePlan | None:
    """The plan of a packed forward over `batch`'s rows back to back (padded to `padded` tokens at the end) of which
    this call runs positions lo..lo+n, with the model's current Options; set on the model (it stays for a
    recompute). Counted: every real token but each row's last, whose output predicts nothing kept; replayed: the
    same tokens, from the batch's `routes` column (a row's routes cover all its tokens but the last)."""
    state = routing(model)
    if state is None:
        return None
    opts = state.options
    lengths = batch["tokens"].lengths
    T = int(lengths.sum())
    counted = torch.zeros(padded, dtype=torch.bool)
    counted[:T] = True
    counted[torch.cumsum(lengths, 0) - 1] = False
    plan = RoutePlan(counted=counted[lo:lo + n], record=opts.record, stats=opts.stats, balance=opts.balance)
    if (opts.replay or opts.stats) and "routes" in batch:
        routes = batch["routes"]
        if not torch.equal(routes.lengths, lengths - 1):
            raise RuntimeError("routes: a row's routes must cover its tokens but the last")
        if tuple(routes.values.shape[1:]) != (state.layers, state.top_k):
            raise RuntimeError(f"routes: recorded for {tuple(routes.values.shape[1:])} (layers, top-k), the model "
                               f"has ({state.layers}, {state.top_k})")
        replay = torch.zeros((padded, state.layers, state.top_k), dtype=routes.values.dtype)
        replay[counted] = routes.values
        plan.replay, plan.replayed, plan.apply = replay[lo:lo + n], plan.counted, opts.replay
    state.plan = plan
    return plan


def route_rows(full: Tensor, lengths: Tensor) -> Ragged:
    """The routes of packed rows ([padded, L, k] ids of every position) as a routes column: each row's positions but
    its last."""
    T = int(lengths.sum())
    keep = torch.ones(T, dtype=torch.bool)
    keep[torch.cumsum(lengths, 0) - 1] = False
    return Ragged(full[:T][keep], lengths - 1)
