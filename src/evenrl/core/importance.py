"""Rollout correction as pure functions: importance weights of the policy-gradient term between the policy they
correct towards (`target_logp`: the trainer's policy at the start of the step, or with algo.old_policy=engine the
current one) and the engine's log-probs of the sampled tokens (behavior_logp), and rejection criteria on the same
log-ratio d_t = target_t - behavior_t.

Weights, level (algo.importance_level) x mode (algo.importance_mode), thresholds floor <= 1 <= cap:
  token       w_t = exp(d_t)                                        (verl rollout_is=token, TRL token_*)
  sequence    w_i = exp(sum_t d_t), on every token                  (verl rollout_is=sequence, TRL sequence_*)
  geometric   w_i = exp(mean_t d_t), on every token
  truncate    w clamped to [floor, cap]                               (TIS; TRL *_truncate with clip_min/clip_max)
  mask        w where floor <= w <= cap, else 0: the token or sequence is rejected (TRL *_mask, OpenRLHF icepop)
  none        1: no weight (only the rejection criteria act; verl rollout_rs without rollout_is)
Rejection (algo.rejection, `rejection_keep`): every criterion must pass, as verl's chained rollout_rs. k1 bounds the
weight itself, low <= exp(s) <= high, s = d_t (token_k1), sum_t d_t (seq_sum_k1) or mean_t d_t (seq_mean_k1); k2
(d^2 / 2) and k3 (exp(d) - 1 - d) bound a divergence from above: per token, its sum, mean or max over the row.
Log-weights are clamped to [-20, 20] before exp (as the PPO ratio). A rejected token keeps its place in the loss
denominators (its loss is 0), as in TRL and OpenRLHF, so the denominators stay the step's global counts (verl takes
rejected tokens out of its response mask, and so out of its token counts).

Sequence and geometric levels use `evenrl.core.aggregation.row_sums` of the log-weight: the loss sees whole rows
(under sequence parallelism the group's per-token outputs are gathered to each of its ranks first).
"""

from __future__ import annotations

import math

import torch

from evenrl.core.aggregation import row_sums
from evenrl.errors import bad

_LOG_RATIO_CLAMP = 20.0
LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "none")
CRITERIA = ("token_k1", "seq_sum_k1", "seq_mean_k1", "token_k2", "seq_sum_k2", "seq_mean_k2", "seq_max_k2",
            "token_k3", "seq_sum_k3", "seq_mean_k3", "seq_max_k3")

Stats = dict[str, tuple[torch.Tensor, torch.Tensor]]


def importance_weights(target_logp: torch.Tensor, behavior_logp: torch.Tensor, cap: float, mask: torch.Tensor, *,
                       level: str = "token", mode: str = "truncate", floor: float = 0.0
                       ) -> tuple[torch.Tensor, Stats]:
    """Importance weights per token, detached, 0 outside `mask`.  target_logp, behavior_logp, mask [B, R]
    -> (w [B, R], stats {name: (sum, count)}).

    target_logp is the trainer's policy at the start of the step (the PPO ratio's denominator, AReaL's proximal
    policy; with algo.old_policy=engine the current policy), behavior_logp the engine's log-probs of the same
    tokens under the policy that sampled them (decoupled PPO, Hilton et al. arXiv:2110.00641). A row whose
    behavior_logp equals target_logp gets weight exactly 1 at every level (exp(0)), which floor <= 1 <= cap keeps,
    so uncorrected samples are untouched.
    stats: policy/is_weight (mean weight per token), policy/is_clipped_fraction and policy/is_masked_fraction
    (tokens whose weight was truncated / rejected), policy/is_clipped_seq_fraction and policy/is_masked_seq_fraction
    (rows with at least one such token, over rows with at least one token)."""
    if level not in LEVELS:
        raise bad("importance_level", level, "one of " + ", ".join(LEVELS))
    if mode not in MODES:
        raise bad("importance_mode", mode, "one of " + ", ".join(MODES))
    mask = mask.bool()
    zero = torch.zeros((), dtype=target_logp.dtype, device=target_logp.device)
    log_w = torch.where(mask, target_logp.detach() - behavior_logp.to(target_logp.dtype), zero)
    if level != "token":
        total, count = row_sums(log_w, mask)
        log_w = (total if level == "sequence" else total / count.clamp(min=1))[:, None].expand_as(log_w)
    raw = log_w.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    outside = ((raw > cap) | (raw < floor)) & mask
    if mode == "truncate":
        w, clipped, rejected = raw.clamp(min=floor, max=cap), outside, torch.zeros_like(outside)
    elif mode == "none":
        w, clipped, rejected = torch.ones_like(raw), torch.zeros_like(outside), torch.zeros_like(outside)
    else:
        w, clipped, rejected = torch.where(outside, zero, raw), torch.zeros_like(outside), outside
    w = torch.where(mask, w, zero)
    n, rows = mask.sum(), (mask.sum(-1) > 0).sum()
    stats = {"policy/is_weight": (w.sum(), n),
             "policy/is_clipped_fraction": (clipped.sum(), n),
             "policy/is_masked_fraction": (rejected.sum(), n),
             "policy/is_clipped_seq_fraction": (clipped.any(-1).sum(), rows),
             "policy/is_masked_seq_fraction": (rejected.any(-1).sum(), rows)}
    return w, stats


def rejection_keep(log_w: torch.Tensor, mask: torch.Tensor, criteria) -> tuple[torch.Tensor, Stats]:
    """Tokens every criterion keeps.  log_w [B, R] (target - behavior, detached), mask [B, R], criteria: (name, low,
    high) triples, name one of CRITERIA -> (keep [B, R] bool, False outside mask; stats {name: (sum, count)}).

    k1: keep low <= exp(s) <= high (bounds on the weight; verl's rollout_rs_threshold bounds 1 / weight);
    k2, k3: keep s <= high. s per token (token_*), or the row's sum, mean or max over its tokens (seq_*), the whole
    row kept or rejected together. d is clamped to [-20, 20] first, as verl does. A row with no tokens is kept.
    stats: policy/rejected_fraction (tokens), policy/rejected_seq_fraction (rows with at least one, over rows with
    at least one token)."""
    mask = mask.bool()
    d = torch.where(mask, log_w.detach().double(), 0.0).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    keep = mask.clone()
    for name, low, high in criteria:
        if name not in CRITERIA:
            raise bad("rejection criterion", name, "one of " + ", ".join(CRITERIA))
        level, kind = name.rsplit("_", 1)
        per_token = {"k1": d, "k2": 0.5 * d.square(), "k3": d.exp() - 1.0 - d}[kind]
        if level == "token":
            s = per_token
        elif level == "seq_max":
            s = torch.where(mask, per_token, float("-inf")).amax(-1, keepdim=True).clamp(min=0.0)
        else:
            total, n = row_sums(per_token, mask)
            s = (total if level == "seq_sum" else total / n.clamp(min=1))[:, None]
        passed = (math.log(low) <= s) & (s <= math.log(high)) if kind == "k1" else s <= high
        keep &= passed.expand_as(mask)
    rejected = mask & ~keep
    rows = (mask.sum(-1) > 0).sum()
    return keep, {"policy/rejected_fraction": (rejected.sum(), mask.sum()),
                  "policy/rejected_seq_fraction": (rejected.any(-1).sum(), rows)}


def weight_sums(w: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(sum, count) of the weights algo.importance_normalize averages, float64 [2]: over tokens at token level, one
    per row (with >= 1 token) at sequence and geometric level, as verl's rollout_is_batch_normalize. Added over
    every row of the step, sum / count is the mean the weights are divided by (`normalized`)."""
    mask = mask.bool()
    if level == "token":
        return torch.stack([torch.where(mask, w.double(), 0.0).sum(), mask.sum().double()])
    total, n = row_sums(w.double(), mask)
    has = n > 0
    return torch.stack([(total[has] / n[has]).sum(), has.sum().double()])


def normalized(w: torch.Tensor, mean: float) -> torch.Tensor:
    """Weights divided by the step's mean weight; a mean of 1e-8 or less leaves them as they are (as verl)."""
    return w / mean if mean > 1e-8 else w
