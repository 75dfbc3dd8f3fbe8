"""Rollout correction: importance weights of the policy-gradient term between the trainer's policy at the start of
the step (old_logp) and the engine's log-probs of the sampled tokens (behavior_logp), as a pure function.

Level (algo.importance_level) x mode (algo.importance_mode), thresholds floor <= 1 <= cap:
  token       w_t = exp(old_t - behavior_t)                         (verl rollout_is=token, TRL token_*)
  sequence    w_i = exp(sum_t (old_t - behavior_t)), on every token  (verl rollout_is=sequence, TRL sequence_*)
  geometric   w_i = exp(mean_t (old_t - behavior_t)), on every token (verl rollout_rs=geometric)
  truncate    w clamped to [floor, cap]                               (TIS; TRL *_truncate with clip_min/clip_max)
  mask        w where floor <= w <= cap, else 0: the token or sequence is rejected (TRL *_mask, OpenRLHF icepop)
Log-weights are clamped to [-20, 20] before exp (as the PPO ratio). A rejected token keeps its place in the loss
denominators (its loss is 0), as in TRL and OpenRLHF, so the denominators stay the step's global counts.

Sequence and geometric levels use `evenrl.core.aggregation.row_sums` of the log-weight: the loss sees whole rows
(under sequence parallelism the group's per-token outputs are gathered to each of its ranks first).
"""

from __future__ import annotations

import torch

from evenrl.core.aggregation import row_sums
from evenrl.errors import bad

_LOG_RATIO_CLAMP = 20.0
LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")

Stats = dict[str, tuple[torch.Tensor, torch.Tensor]]


def importance_weights(old_logp: torch.Tensor, behavior_logp: torch.Tensor, cap: float, mask: torch.Tensor, *,
                       level: str = "token", mode: str = "truncate", floor: float = 0.0
                       ) -> tuple[torch.Tensor, Stats]:
    """Importance weights per token, detached, 0 outside `mask`.  old_logp, behavior_logp, mask [B, R]
    -> (w [B, R], stats {name: (sum, count)}).

    old_logp is the trainer's policy at the start of the step (the PPO ratio's denominator, AReaL's proximal
    policy), behavior_logp the engine's log-probs of the same tokens under the policy that sampled them (decoupled
    PPO, Hilton et al. arXiv:2110.00641). A row whose behavior_logp equals old_logp gets weight exactly 1 at every
    level (exp(0)), which floor <= 1 <= cap keeps, so uncorrected samples are untouched.
    stats: policy/is_weight (mean weight per token), policy/is_clipped_fraction and policy/is_masked_fraction
    (tokens whose weight was truncated / rejected), policy/is_clipped_seq_fraction and policy/is_masked_seq_fraction
    (rows with at least one such token, over rows with at least one token)."""
    if level not in LEVELS:
        raise bad("importance_level", level, "one of " + ", ".join(LEVELS))
    if mode not in MODES:
        raise bad("importance_mode", mode, "one of " + ", ".join(MODES))
    mask = mask.bool()
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    log_w = torch.where(mask, old_logp.detach() - behavior_logp.to(old_logp.dtype), zero)
    if level != "token":
        total, count = row_sums(log_w, mask)
        log_w = (total if level == "sequence" else total / count.clamp(min=1))[:, None].expand_as(log_w)
    raw = log_w.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    outside = ((raw > cap) | (raw < floor)) & mask
    if mode == "truncate":
        w, clipped, rejected = raw.clamp(min=floor, max=cap), outside, torch.zeros_like(outside)
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
