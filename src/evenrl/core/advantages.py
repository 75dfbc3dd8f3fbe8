"""Advantage estimators as pure functions.

Per sample (GRPO family): N completions in a step; every function maps rewards [N] and group ids [N] to
advantages [N]. They run on the whole step's rewards (on every rank), so an advantage does not depend on how
samples are spread over ranks.

Per token (REINFORCE++, GAE): [B, R] tensors, each row's response right-aligned (its last token in column R-1,
padding on the left), `mask` [B, R] True on response tokens. Returns and GAE depend on one row's tokens only, so
each rank computes them for its own rows; the whitening that follows needs the mean and variance over the whole
step's response tokens, which `token_moments` (per row) and `pooled_moments` (over rows, in sample order) give
exactly on any layout.

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

    Groups are found with `torch.unique`, so ids need not be contiguous, sorted or dense. A group whose values are
    all equal gets exactly that value as its mean (sum / count can miss it by an ulp, e.g. three rewards of 0.1),
    so its centred values, its std and every advantage built from them are exactly 0.
    """
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    counts = counts.to(x.dtype)
    mean = torch.zeros_like(counts).index_add_(0, inverse, x) / counts
    low = torch.full_like(counts, float("inf")).scatter_reduce_(0, inverse, x, "amin")
    high = torch.full_like(counts, float("-inf")).scatter_reduce_(0, inverse, x, "amax")
    mean = torch.where(low == high, low, mean)
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

    eps is algo.std_eps (verl's epsilon 1e-6; TRL adds 1e-4).
    std_scale:
      "group"  std of the completion's own group (DeepSeekMath GRPO, arXiv:2402.03300; verl `grpo`);
      "batch"  std of the raw rewards over the whole batch (TRL `scale_rewards="batch"`, arXiv:2508.08221);
      "none"   no division (Dr. GRPO, arXiv:2503.20783; verl `norm_adv_by_std_in_grpo=False`).
    The std is unbiased (Bessel-corrected), as `torch.std` in verl and `nanstd` in TRL compute it.
    A group of one has no baseline, so its advantage is 0 (verl instead uses mean 0, std 1 there, which hands it
    the raw reward); a group whose rewards are all equal gets exactly 0 (see _group_mean_std).
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
    length: algo.loss_aggregation=seq-mean-token-sum-norm (`evenrl.core.aggregation`; verl
    `seq-mean-token-sum-norm`, TRL loss_type=dr_grpo), with algo.loss_norm_tokens the constant. Dr. GRPO in full is
    this advantage plus that aggregation.
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


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6,
                                     whiten: str = "sample", lengths: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then scale by a batch-wide spread of those centred rewards.

    rewards [N], groups [N] -> [N].  Hu et al., REINFORCE++ (arXiv:2501.03262); verl
    `reinforce_plus_plus_baseline`, OpenRLHF `reinforce_baseline`.  A group of one gets centred reward 0.
      whiten="sample"  c_i / (std_i(c) + eps): the unbiased std over completions (each counts once).
      whiten="token"   (c_i - mu) / sqrt(var + 1e-8), mu and the unbiased var over every response token of the
                       batch, each completion's c_i repeated on its lengths[i] tokens: verl's and OpenRLHF's masked
                       whitening of the token-level broadcast (eps inside the root is theirs, 1e-8; `eps` is not
                       used). It is not a re-centring no-op: with unequal lengths mu != 0, so long completions weigh
                       more in both moments and an all-equal group gets -mu / sqrt(var + 1e-8), not 0, as in verl.
    lengths [N]: response tokens per completion (whiten="token" only).
    """
    r = _check_rewards(rewards, groups)
    mean, _, _ = _group_mean_std(r, groups)
    centred = r - mean
    if whiten == "sample":
        return centred / (_batch_std(centred) + eps)
    if whiten != "token":
        raise bad("reinforce_pp_baseline_whiten", whiten, "'sample' or 'token'")
    if lengths is None or lengths.shape != r.shape:
        raise ValueError("whiten='token' needs lengths [N], the response tokens of each completion")
    mu, var = pooled_moments(lengths.double(), centred.double(), torch.zeros_like(centred, dtype=torch.float64))
    return torch.where(lengths > 0, (centred.double() - mu) / (var + 1e-8) ** 0.5, 0.0).to(r.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Per token: [B, R] right-aligned rows, mask [B, R]
# ---------------------------------------------------------------------------------------------------------------------


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards: each row's outcome score on its last response token, minus kl_coef x the per-token KL to
    the reference on every response token (verl/OpenRLHF fold the KL into the reward this way for REINFORCE++ and
    PPO).  scores [B], mask [B, R], kl [B, R] or None -> [B, R], 0 outside the mask."""
    if mask.dim() != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(f"scores [B] and mask [B, R] disagree: {tuple(scores.shape)}, {tuple(mask.shape)}")
    mask = mask.bool()
    dtype = torch.promote_types(scores.dtype, torch.float32)
    r = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if mask.shape[1]:
        r[:, -1] = scores.to(dtype)
    if kl is not None and kl_coef:
        r = r - kl_coef * kl.to(dtype)
    return torch.where(mask, r, torch.zeros((), dtype=dtype, device=mask.device))


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} within each row's response (REINFORCE++'s returns; verl
    `compute_reinforce_plus_plus_outcome_advantage` before whitening).  rewards, mask [B, R] -> [B, R]."""
    mask = mask.bool()
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0]) if rewards.shape[1] else None
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, torch.zeros_like(running))
        out[:, t] = running
    return out


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. arXiv:1506.02438; verl `compute_gae_advantage_return`
    before whitening).  rewards, values, mask [B, R] -> (advantages [B, R], returns [B, R] = advantages + values).

      delta_t = r_t + gamma * V_{t+1} - V_t      (V after the last response token is 0: the episode ended)
      A_t     = delta_t + gamma * lam * A_{t+1}
    0 outside the mask."""
    if values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(f"rewards, values and mask must all be [B, R]; got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    mask = mask.bool()
    values = torch.where(mask, values.to(rewards.dtype), torch.zeros((), dtype=rewards.dtype))
    adv = torch.zeros_like(rewards)
    if rewards.shape[1] == 0:
        return adv, adv.clone()
    last = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(last)
    for t in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = torch.where(mask[:, t], delta + gamma * lam * last, torch.zeros_like(last))
        next_value = torch.where(mask[:, t], values[:, t], torch.zeros_like(last))
        adv[:, t] = last
    return adv, torch.where(mask, adv + values, torch.zeros_like(adv))


def token_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: (count, mean, sum of squared deviations from the row mean) of its masked tokens, float64, each [B].
    Rows travel with their sample, so the whole step's statistics can be pooled from these on any rank."""
    mask = mask.bool()
    x = torch.where(mask, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    count = mask.sum(-1).double()
    mean = x.sum(-1) / count.clamp(min=1)
    dev = torch.where(mask, x - mean[:, None], torch.zeros((), dtype=torch.float64, device=x.device))
    return count, mean, (dev * dev).sum(-1)


def pooled_moments(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> tuple[float, float]:
    """(mean, unbiased variance) over all tokens of the rows given by their token_moments, [N] each.  The
    between-row term is added to the within-row sums of squares (no E[x^2] - E[x]^2 cancellation); summed in the
    order given, so every rank that pools the same rows in the same order gets the same bits.  Variance 0 for
    fewer than two tokens."""
    n = float(count.double().sum())
    if n == 0:
        return 0.0, 0.0
    mu = float((count.double() * mean.double()).sum()) / n
    ss = float(m2.double().sum() + (count.double() * (mean.double() - mu).square()).sum())
    return mu, ss / (n - 1) if n > 1 else 0.0


def whiten(x: torch.Tensor, mask: torch.Tensor, mean: float, var: float, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on masked tokens, 0 elsewhere (verl `masked_whiten`: unbiased variance,
    eps inside the root).  x, mask [B, R] -> [B, R]."""
    out = (x.double() - mean) / (var + eps) ** 0.5
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device)).to(x.dtype)


def whiten_tokens(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten over all masked tokens of x: the single-batch form of token_moments -> pooled_moments -> whiten."""
    mean, var = pooled_moments(*token_moments(x, mask))
    return whiten(x, mask, mean, var, eps)


def reinforce_pp_advantages(scores: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """REINFORCE++ (Hu et al. arXiv:2501.03262; verl `reinforce_plus_plus`, OpenRLHF `reinforce`): per-token
    rewards (outcome score on the last token, minus kl_coef x KL per token), discounted returns, whitened over the
    batch's response tokens.  No group, no critic: works with one sample per prompt.  scores [B], mask [B, R],
    kl [B, R] or None -> [B, R]."""
    returns = discounted_returns(token_rewards(scores, mask, kl, kl_coef), mask, gamma)
    return whiten_tokens(returns, mask)


TOKEN_ADVANTAGES = ("reinforce_pp", "gae")

ADVANTAGES = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


def compute_advantages(name: str, rewards: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor | None = None,
                       lengths: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """Dispatch by estimator name (a key of `ADVANTAGES`); keyword arguments go to that function.

    valid [N] bool (optional): only these samples exist for the estimator. Advantages are computed over them alone
    (group means, stds and sizes, leave-one-out baselines, batch stds) exactly as if the others had never been
    sampled, and the others get advantage 0. None: every sample is valid.
    lengths [N] (optional): response tokens per sample, for estimators that weigh samples by length.
    """
    fn = ADVANTAGES.get(name)
    if fn is None:
        raise bad("advantage", name, f"one of {', '.join(sorted(ADVANTAGES))}")
    if valid is None:
        return fn(rewards, groups, **kw, **({} if lengths is None else {"lengths": lengths}))
    _check_rewards(rewards, groups)
    if valid.dtype != torch.bool or valid.shape != rewards.shape:
        raise ValueError(f"valid must be a bool tensor shaped like rewards {tuple(rewards.shape)}; "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    kept = fn(rewards[valid], groups[valid], **kw, **({} if lengths is None else {"lengths": lengths[valid]}))
    out = kept.new_zeros(rewards.shape)
    out[valid] = kept
    return out
