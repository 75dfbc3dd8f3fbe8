"""Advantages and policy losses as pure functions on tensors.

Shapes used throughout:
  N  completions in a batch (advantage functions work on one scalar reward per completion);
  B, T  rows and token positions of a padded token batch; V  vocabulary size.
Token-level functions return per-token [B, T] tensors; reducing them to a scalar (token-mean, seq-mean, Dr. GRPO's
constant normaliser, ...) is `evenrl.aggregation`'s job, so that the count used to normalise can be global.

Conventions taken from verl (volcengine/verl, `verl/trainer/ppo/core_algos.py`) unless a docstring says otherwise.
"""

from __future__ import annotations

import torch

from evenrl.errors import bad

# Log-ratios and KL arguments are clamped before exp(), like verl, so one wild token cannot produce inf/NaN.
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0
# Vocabulary-sized work is done in chunks of positions of about this many elements (128 MiB in float32).
_CHUNK_ELEMENTS = 1 << 25


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
    length; that is a loss-aggregation mode in `evenrl.aggregation` (verl: `seq-mean-token-sum-norm`), not here.
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


def compute_advantages(name: str, rewards: torch.Tensor, groups: torch.Tensor, **kw) -> torch.Tensor:
    """Dispatch by estimator name (a key of `ADVANTAGES`); keyword arguments go to that function."""
    fn = ADVANTAGES.get(name)
    if fn is None:
        raise bad("advantage", name, f"one of {', '.join(sorted(ADVANTAGES))}")
    return fn(rewards, groups, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# Token level: [B, T] tensors; `mask` [B, T] marks response tokens (bool or 0/1)
# ---------------------------------------------------------------------------------------------------------------------


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    *,
    dual_clip: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate per token with asymmetric clipping.  -> (loss [B, T], stats).

    logp, old_logp [B, T]: log-probs of the sampled tokens under the current and the rollout policy.
    advantages [B] (broadcast over tokens) or [B, T].
      ratio = exp(logp - old_logp)          (log-ratio clamped to [-20, 20] first, as verl does)
      loss  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    PPO: Schulman et al. arXiv:1707.06347.  clip_high > clip_low is DAPO's "clip-higher" (arXiv:2503.14476).
    dual_clip = c > 1 bounds the loss of negative-advantage tokens by -c * A (Ye et al. arXiv:1912.09729;
    verl `clip_ratio_c`).  Tokens outside `mask` get loss 0.

    stats: detached scalar *sums over masked tokens*, so they can be all-reduced and then divided by
    stats["tokens"]: clipped_tokens (the clipped branch was taken; verl pg_clipfrac numerator), clipped_low_tokens
    (A < 0, ratio < 1 - clip_low), clipped_high_tokens (A > 0, ratio > 1 + clip_high), dual_clipped_tokens
    (verl pg_clipfrac_lower numerator), approx_kl_sum (sum of old_logp - logp; verl ppo_kl numerator).
    """
    if logp.shape != old_logp.shape or logp.dim() != 2:
        raise ValueError(f"logp and old_logp must both be [B, T]; got {tuple(logp.shape)}, {tuple(old_logp.shape)}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise bad("dual_clip", dual_clip, "None or a number > 1")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask.bool()

    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_hit = torch.zeros_like(mask)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_hit = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    loss = torch.where(mask, loss, torch.zeros_like(loss))

    def count(hit: torch.Tensor) -> torch.Tensor:
        return (hit & mask).sum()

    with torch.no_grad():
        stats = {
            "tokens": mask.sum(),
            "clipped_tokens": count(clipped > unclipped),
            "clipped_low_tokens": count((adv < 0) & (ratio < 1.0 - clip_low)),
            "clipped_high_tokens": count((adv > 0) & (ratio > 1.0 + clip_high)),
            "dual_clipped_tokens": count(dual_hit),
            "approx_kl_sum": torch.where(mask, -log_ratio, torch.zeros_like(log_ratio)).sum(),
        }
    return loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.  logp, ref_logp [B, T] -> [B, T].

    Estimators from Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html), d = ref - logp:
      "k1"  -d                      unbiased, high variance (verl "kl")
      "k2"  d^2 / 2                 (verl "mse")
      "k3"  exp(d) - d - 1 >= 0     unbiased, low variance (verl "low_var_kl"; GRPO's KL term)
    k3 clamps d to [-20, 20] before exp and the result to at most 10, exactly as verl does; past the clamp the
    gradient is zero, which caps how hard one token can pull.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        d = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (d.exp() - d - 1.0).clamp(max=_K3_CLAMP)
    raise bad("kl kind", kind, "one of 'k1', 'k2', 'k3'")


def apply_kl_to_rewards(
    rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kind: str = "k1",
) -> torch.Tensor:
    """KL-in-reward shaping: r_i - beta * sum_t mask * kl_t.  rewards [B]; logp, ref_logp, mask [B, T] -> [B].

    The per-token penalty of verl `apply_kl_penalty` / OpenRLHF `compute_reward` (InstructGPT, arXiv:2203.02155),
    summed over the response because outcome estimators (GRPO, RLOO, REINFORCE++) sum token rewards anyway.  k1 is
    the default: as a reward it gives an unbiased KL gradient (Shah et al., "A Comedy of Estimators", 2025).
    The result is detached: a reward is a constant for the policy gradient.
    """
    kl = kl_penalty(logp, ref_logp, kind) * mask.to(logp.dtype)
    return (rewards - beta * kl.sum(-1)).detach()


def _rows_per_chunk(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, vocab))


def _as_float32(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / temperature, copying at most once (and not at all for float32 at temperature 1)."""
    if temperature == 1.0:
        return chunk.float()
    # A fresh copy may be divided in place: to() saves nothing for backward and div_ by a scalar needs no input.
    return chunk.to(torch.float32, copy=True).div_(temperature)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise bad("temperature", temperature, "a number > 0")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[targets].  logits [B, T, V], targets [B, T] int -> [B, T] float32.

    Gathers the target logit and subtracts logsumexp instead of materialising log_softmax, in chunks of positions,
    so the only vocabulary-sized tensor kept for backward is the float32 copy of low-precision (or tempered)
    logits; float32 logits at temperature 1 are not copied at all.  (Same idea as TRL's `selective_log_softmax`.)
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits [B, T, V] and targets [B, T] disagree: {tuple(logits.shape)}, {tuple(targets.shape)}")
    _check_temperature(temperature)
    rows = _rows_per_chunk(logits.shape[-1])
    out = []
    for chunk, idx in zip(logits.reshape(-1, logits.shape[-1]).split(rows), targets.reshape(-1).split(rows)):
        x = _as_float32(chunk, temperature)
        out.append(x.gather(-1, idx.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1))
    return torch.cat(out).reshape(targets.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position.  logits [B, T, V] -> [B, T] float32.

    H = -sum p log p with log p from log_softmax (stable for any finite logit scale; -inf logits, i.e. masked
    vocabulary entries, contribute 0 as in torch.distributions.Categorical).  Chunked over positions; under
    no_grad the peak extra memory is a few chunks.  With grad it keeps p and log p (two float32 copies).
    """
    _check_temperature(temperature)
    out = []
    for chunk in logits.reshape(-1, logits.shape[-1]).split(_rows_per_chunk(logits.shape[-1])):
        logp = torch.log_softmax(_as_float32(chunk, temperature), dim=-1)
        logp = logp.clamp(min=torch.finfo(logp.dtype).min)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])
