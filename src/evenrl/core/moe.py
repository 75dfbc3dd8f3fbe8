"""Mixture-of-experts arithmetic: the dtype routes travel in, the load-balancing loss from global counts and the
routing metrics. Pure functions; the counts come from evenrl.models.routing's hooks and the collectives from the
trainer.

The load-balancing loss is transformers' `load_balancing_loss_func` (Switch Transformer's, every MoE layer's
tokens pooled) over the whole mini-batch on every rank and micro-batch: with C_e the top-k assignments to expert e
summed over layers and R the routed token-layers, both summed over all ranks (no gradient), and P_e the
probability sums, E * sum_e (C_e / R) * (P_e / R). P is a plain sum over tokens, so each forward adds its own
tokens' share and the shares sum to the whole batch's loss and gradient on any layout; averaging each rank's own
loss instead is not the same function (its counts are the rank's, and the loss is a product of two means).
"""

from __future__ import annotations

import torch
from torch import Tensor


def route_dtype(experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids 0..experts-1 (uint8 up to 256 experts)."""
    if experts <= 256:
        return torch.uint8
    if experts <= 1 << 15:
        return torch.int16
    return torch.int32


ROUTE_DTYPES = (torch.uint8, torch.int16, torch.int32)


def balance_loss(prob_sums: Tensor, counts: Tensor, routed: float, experts: int) -> Tensor:
    """This forward's share of the whole mini-batch's load-balancing loss: prob_sums [E] (this forward's tokens'
    router probabilities summed over tokens and MoE layers, with gradient), counts [E] (the mini-batch's top-k
    assignments per expert over all ranks and layers), routed (its tokens x MoE layers over all ranks)."""
    if routed <= 0:
        return prob_sums.sum() * 0.0
    return experts * ((counts.to(prob_sums.dtype) / routed) * (prob_sums / routed)).sum()


def load_metrics(loads: Tensor) -> dict:
    """Expert load per MoE layer: its busiest expert's tokens over the mean (1.0: perfectly even; E: one expert
    takes all), from loads [L, E] (top-k assignments summed over the step's ranks)."""
    total = loads.sum(dim=1).double()
    mean = total / loads.shape[1]
    ratio = torch.where(total > 0, loads.max(dim=1).values.double() / mean.clamp(min=1e-12), torch.ones_like(mean))
    return {"moe/load_max_over_mean": [round(float(x), 4) for x in ratio],
            "moe/load_max_over_mean_worst": float(ratio.max()) if len(ratio) else 1.0}


def mismatch_metrics(differ: Tensor, any_layer: int, tokens: int, prefix: str = "moe/") -> dict:
    """The share of the replayed tokens (the engine's routes, or those the update replays) whose experts the
    trainer would choose differently: per MoE layer (differ [L]: tokens whose top-k set differs there) and in any
    layer (any_layer), out of `tokens`."""
    n = max(tokens, 1)
    return {f"{prefix}routes_differ": [round(float(x) / n, 6) for x in differ],
            f"{prefix}routes_differ_any_layer": any_layer / n}
