"""Advantage estimators as pure functions: one scalar reward per sample -> one advantage per sample.

Shapes: N completions in a step; every function maps rewards [N] and group ids [N] to advantages [N]. They run on
the whole step's rewards (on every rank), so an advantage does not depend on how samples are spread over ranks.

Conventions are verl's (its core algorithms' names are given where they differ) unless a docstring says otherwise.
"""

from __future__ import annotations

import torch

from evenrl.errors import bad

# ---------------------------------------------------------------------------------------------------------------------
# Advantages: rewards [N] float, groups [N] int (completions of one prompt share an id) -> advantages [N]
# ---------------------------------------------------------------------------------------------------------------------


def _check_rewards(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 1 or groups.shape != rewards.shape:
        raise ValueError(f"rewards and groups must both be [N]; got {tuple(rewards.shape)} and {tuple(groups.shape)}")
    if groups.dtype.is_floating_point or groups.dtype.is_complex:
        raise ValueError(f"groups must be an integer tensor; got {groups.dtype}")
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32))


def _group_mean_std(x: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased group std (0 for a group of one) and group size, each [N].

    Groups are found with `torch.unique`, so ids need not be contiguous, sorted or dense.
    """
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    counts = counts.to(x.dtype)
    mean = torch.zeros_like(counts).index_add_(0, inverse, x) / counts
    dev = x - mean[inverse]
    # Two-pass variance: summing squared deviations is exact for all-equal groups, where E[x^2]-E[x]^2 is not.
    var = torch.zeros_like(counts).index_add_(0, inverse, dev * dev) / (counts - 1).clamp(min=1)
    return mean[inverse], var.sqrt()[inverse], counts[inverse]


def _batch_std(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the whole batch; 0 when there is a single sample (torch.std would give NaN)."""
    if x.numel() < 2:
        return x.new_zeros(())
    return x.std(unbiased=True)


def grpo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, std_scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantage: A_i = (r_i - mean_g(r)) / (std + eps).  rewards [N], groups [N] -> [N].

    std_scale:
      "group"  std of the completion's own group (DeepSeekMath GRPO, arXiv:2402.03300; verl `grpo`);
      "batch"  std of the raw rewards over the whole batch (TRL `scale_rewards="batch"`, arXiv:2508.08221);
      "none"   no division (Dr. GRPO, arXiv:2503.20783; verl `norm_adv_by_std_in_grpo=False`).
    The std is unbiased (Bessel-corrected), as `torch.std` in verl and `nanstd` in TRL compute it.
    A group of one has no baseline, so its advantage is 0 (verl instead uses mean 0, std 1 there, which hands it
    the raw reward); a group whose rewards are all equal also gets 0 (0 / (0 + eps)).
    """
    r = _check_rewards(rewards, groups)
    mean, group_std, _ = _group_mean_std(r, groups)
    centred = r - mean
    if std_scale == "group":
        return centred / (group_std + eps)
    if std_scale == "batch":
        return centred / (_batch_std(r) + eps)
    if std_scale == "none":
        return centred
    raise bad("std_scale", std_scale, "one of 'group', 'batch', 'none'")


def dr_grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantage (Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783): r_i - mean_g(r).

    rewards [N], groups [N] -> [N].  Same as `grpo_advantages(..., std_scale="none")`.  Dr. GRPO's other half is
    dividing the summed token losses by a constant (the maximum generation length) instead of each response's
    length; that is a loss-aggregation mode in `evenrl.core.aggregation` (verl: `seq-mean-token-sum-norm`), not here.
    """
    return grpo_advantages(rewards, groups, std_scale="none")


def rloo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """RLOO advantage: A_i = r_i - mean of the *other* rewards of its group.  rewards [N], groups [N] -> [N].

    Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization" (arXiv:2402.14740); verl `rloo`.
    Computed as n/(n-1) * (r_i - mean_g) which equals the leave-one-out form; a group of one gets 0.
    """
    r = _check_rewards(rewards, groups)
    mean, _, n = _group_mean_std(r, groups)
    return torch.where(n > 1, (r - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(r))


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then divide by the batch std of those centred rewards.

    rewards [N], groups [N] -> [N].  Hu et al., REINFORCE++ (arXiv:2501.03262); verl
    `reinforce_plus_plus_baseline`, OpenRLHF `reinforce_baseline`.  The std is unbiased and taken over completions;
    verl whitens the token-level broadcast (so long responses weigh more in the std) and also re-centres, which at
    completion level is a no-op because group-centred rewards already sum to zero.  A group of one gets 0.
    """
    r = _check_rewards(rewards, groups)
    mean, _, _ = _group_mean_std(r, groups)
    centred = r - mean
    return centred / (_batch_std(centred) + eps)


ADVANTAGES = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


def compute_advantages(name: str, rewards: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor | None = None,
                       **kw) -> torch.Tensor:
    """Dispatch by estimator name (a key of `ADVANTAGES`); keyword arguments go to that function.

    valid [N] bool (optional): only these samples exist for the estimator. Advantages are computed over them alone
    (group means, stds and sizes, leave-one-out baselines, batch stds) exactly as if the others had never been
    sampled, and the others get advantage 0. None: every sample is valid.
    """
    fn = ADVANTAGES.get(name)
    if fn is None:
        raise bad("advantage", name, f"one of {', '.join(sorted(ADVANTAGES))}")
    if valid is None:
        return fn(rewards, groups, **kw)
    _check_rewards(rewards, groups)
    if valid.dtype != torch.bool or valid.shape != rewards.shape:
        raise ValueError(f"valid must be a bool tensor shaped like rewards {tuple(rewards.shape)}; "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    kept = fn(rewards[valid], groups[valid], **kw)
    out = kept.new_zeros(rewards.shape)
    out[valid] = kept
    return out
