"""Token-level losses as pure functions on tensors: log-probs, entropy, KL estimators and the PPO-clip surrogate.

Shapes: B, T  rows and token positions of a padded token batch; V  vocabulary size. Functions return per-token
[B, T] tensors; reducing them to a scalar (token-mean, seq-mean, ...) is `evenrl.core.aggregation`'s job, so that
the count used to normalise can be global.

Conventions are verl's (its core algorithms' names are given where they differ) unless a docstring says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evenrl.errors import bad

# Log-ratios and KL arguments are clamped before exp(), like verl, so one wild token cannot produce inf/NaN.
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0
# Vocabulary-sized work is done in chunks of positions of about this many elements (128 MiB in float32).
_CHUNK_ELEMENTS = 1 << 25


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
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate per token with asymmetric clipping.  -> (loss [B, T], stats).

    logp, old_logp [B, T]: log-probs of the sampled tokens under the current and the rollout policy.
    advantages [B] (broadcast over tokens) or [B, T].
      ratio = exp(logp - old_logp)          (log-ratio clamped to [-20, 20] first, as verl does)
      loss  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    PPO: Schulman et al. arXiv:1707.06347.  clip_high > clip_low is DAPO's "clip-higher" (arXiv:2503.14476).
    Tokens outside `mask` get loss 0.

    stats: detached scalar *sums over masked tokens*, so they can be all-reduced and then divided by
    stats["tokens"]: clipped_tokens (the clipped branch was taken; verl pg_clipfrac numerator), clipped_low_tokens
    (A < 0, ratio < 1 - clip_low), clipped_high_tokens (A > 0, ratio > 1 + clip_high), approx_kl_sum (sum of
    old_logp - logp; verl ppo_kl numerator).
    """
    if logp.shape != old_logp.shape or logp.dim() != 2:
        raise ValueError(f"logp and old_logp must both be [B, T]; got {tuple(logp.shape)}, {tuple(old_logp.shape)}")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask.bool()

    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    loss = torch.where(mask, loss, torch.zeros_like(loss))

    def count(hit: torch.Tensor) -> torch.Tensor:
        return (hit & mask).sum()

    with torch.no_grad():
        stats = {
            "tokens": mask.sum(),
            "clipped_tokens": count(clipped > unclipped),
            "clipped_low_tokens": count((adv < 0) & (ratio < 1.0 - clip_low)),
            "clipped_high_tokens": count((adv > 0) & (ratio > 1.0 + clip_high)),
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


# ---------------------------------------------------------------------------------------------------------------------
# The RL objective of one micro-batch: inputs in, per-token loss and statistics out
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossInputs:
    """What the objective needs per micro-batch; per-token tensors are [B, R] (R = longest response), each row's
    response right-aligned, float32."""
    logp: torch.Tensor            # log-probs of the sampled tokens under the policy being trained (with grad)
    old_logp: torch.Tensor        # under the policy at the start of the step (the ratio's denominator; no grad)
    advantages: torch.Tensor      # [B] one per sample, broadcast over its tokens; or [B, R] one per token
    mask: torch.Tensor            # [B, R] bool: True on response tokens
    entropy: torch.Tensor         # [B, R] entropy of the sampling distribution (with grad when entropy_coef > 0)
    ref_logp: torch.Tensor | None = None  # under the frozen reference; None when KL is not measured per token
    # the engine's log-probs of the sampled tokens when the policy-gradient term is importance-weighted (an older
    # policy sampled, or the engine's numbers differ from the trainer's); None: no correction
    behavior_logp: torch.Tensor | None = None


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0          # weight of the per-token KL term; 0 measures KL (when ref_logp is given) only
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0     # weight of the entropy bonus; 0 only measures entropy
    importance_cap: float = 2.0   # upper bound of the truncated importance weight (with behavior_logp)


def importance_weights(old_logp: torch.Tensor, behavior_logp: torch.Tensor, cap: float,
                       mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Truncated importance weights per token, detached: w = min(exp(old_logp - behavior_logp), cap).
    -> (w [B, R], stats {name: (sum over masked tokens, token count)}).

    old_logp is the trainer's policy at the start of the step (the PPO ratio's denominator, AReaL's proximal
    policy), behavior_logp the engine's log-probs of the same tokens under the policy that sampled them. The
    policy-gradient term of each token is multiplied by w (decoupled PPO, Hilton et al. arXiv:2110.00641, as in
    AReaL; truncated importance sampling as in verl's TIS); the cap bounds the variance one unlikely token can add.
    stats: policy/is_weight (mean w) and policy/is_clipped_fraction (tokens whose weight was cut to the cap)."""
    log_w = (old_logp.detach() - behavior_logp.to(old_logp.dtype)).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    raw = log_w.exp()
    w = raw.clamp(max=cap)
    mask = mask.bool()
    n = mask.sum()
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    stats = {"policy/is_weight": (torch.where(mask, w, zero).sum(), n),
             "policy/is_clipped_fraction": (((raw > cap) & mask).sum(), n)}
    return torch.where(mask, w, zero), stats


def rl_loss(inp: LossInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """PPO-clip surrogate (times the truncated importance weight when behavior_logp is given) + kl_coef x
    KL(policy || reference) - entropy_coef x entropy, per token.
    -> (loss [B, R], stats {name: (sum over masked tokens, token count)}).

    Stats are (sum, count) pairs so a global mean over ranks and micro-batches is exact: policy/loss,
    policy/clip_fraction, policy/approx_kl, entropy, and kl when ref_logp is given. Reducing the loss to a scalar
    with global denominators is evenrl.core.aggregation's job.
    """
    per_token, pstats = policy_loss(inp.logp, inp.old_logp, inp.advantages, clip_low=s.clip_low,
                                    clip_high=s.clip_high, mask=inp.mask)
    n = inp.mask.sum()
    is_stats = {}
    if inp.behavior_logp is not None:
        w, is_stats = importance_weights(inp.old_logp, inp.behavior_logp, s.importance_cap, inp.mask)
        per_token = per_token * w.to(per_token.dtype)
    stats = {"policy/loss": ((per_token * inp.mask).sum().detach(), n),
             "policy/clip_fraction": (pstats["clipped_tokens"], n),
             "policy/approx_kl": (pstats["approx_kl_sum"], n), **is_stats}
    if inp.ref_logp is not None:
        kl = kl_penalty(inp.logp, inp.ref_logp, s.kl_estimator)
        if s.kl_coef > 0:
            per_token = per_token + s.kl_coef * kl
        stats["kl"] = (torch.where(inp.mask, kl.detach(), 0.0).sum(), n)  # where: a masked NaN stays out
    if s.entropy_coef > 0:
        per_token = per_token - s.entropy_coef * inp.entropy
    stats["entropy"] = (torch.where(inp.mask, inp.entropy.detach(), 0.0).sum(), n)
    return per_token, stats


# ---------------------------------------------------------------------------------------------------------------------
# The critic's objective (PPO with GAE): per-token clipped value loss
# ---------------------------------------------------------------------------------------------------------------------


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.5) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """PPO's clipped value loss per token (verl `compute_value_loss`, OpenRLHF `ValueLoss`).
    values [B, R] (with grad), old_values [B, R] (at sampling time), returns [B, R] (GAE targets), mask [B, R]
    -> (loss [B, R], stats {name: (sum over masked tokens, token count)}).

      clipped = old_values + clamp(values - old_values, -clip, clip)
      loss    = 0.5 * max((values - returns)^2, (clipped - returns)^2)
    stats: critic/loss, critic/clip_fraction (the clipped branch was larger), critic/values (mean prediction)."""
    if not (values.shape == old_values.shape == returns.shape == mask.shape) or values.dim() != 2:
        raise ValueError(f"values, old_values, returns and mask must all be [B, R]; got {tuple(values.shape)}, "
                         f"{tuple(old_values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}")
    mask = mask.bool()
    old_values, returns = old_values.to(values.dtype), returns.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, clipped_loss = (values - returns).square(), (clipped - returns).square()
    loss = 0.5 * torch.maximum(plain, clipped_loss)
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    loss = torch.where(mask, loss, zero)
    n = mask.sum()
    with torch.no_grad():
        stats = {"critic/loss": (loss.detach().sum(), n),
                 "critic/clip_fraction": (((clipped_loss > plain) & mask).sum(), n),
                 "critic/values": (torch.where(mask, values.detach(), zero).sum(), n)}
    return loss, stats
