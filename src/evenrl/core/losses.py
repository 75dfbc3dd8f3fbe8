"""Token-level losses as pure functions on tensors: log-probs, entropy, KL estimators, the RL objective of a
micro-batch (`rl_loss`: a surrogate of evenrl.core.surrogates, weighted by evenrl.core.importance, plus KL and
entropy terms) and the critic's value loss.

Shapes: B, T  rows and token positions of a padded token batch; V  vocabulary size. Functions return per-token
[B, T] tensors; reducing them to a scalar (token-mean, seq-mean, ...) is `evenrl.core.aggregation`'s job, so that
the count used to normalise can be global.

Conventions are verl's (its core algorithms' names are given where they differ) unless a docstring says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evenrl.core.importance import importance_weights, normalized, rejection_keep
from evenrl.core.surrogates import SELECTING, PolicyParams, surrogate
from evenrl.errors import bad

# Log-ratios and KL arguments are clamped before exp(), like verl, so one wild token cannot produce inf/NaN.
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0
# Vocabulary-sized work is done in chunks of positions of about this many elements (128 MiB in float32).
_CHUNK_ELEMENTS = 1 << 25


# ---------------------------------------------------------------------------------------------------------------------
# Token level: [B, T] tensors; `mask` [B, T] marks response tokens (bool or 0/1)
# ---------------------------------------------------------------------------------------------------------------------


KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.  logp, ref_logp [B, T] -> [B, T].

    Estimators from Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html), d = ref - logp:
      "k1"   -d                      unbiased, high variance (verl "kl")
      "k2"   d^2 / 2                 (verl "mse"); its gradient is the unbiased gradient of KL
      "k3"   exp(d) - d - 1 >= 0     unbiased, low variance (verl "low_var_kl"; GRPO's KL term)
      "abs"  |d|                     (verl "abs")
      "k1+", "k3+"  straight-through: the value of k1 / k3 with the gradient of k2 (verl "k1+", "low_var_kl+"),
                    k2 + sg(k - k2), because the expected gradients of k1 and k3 are not KL's.
    k3 clamps d to [-20, 20] before exp and the result to at most 10, exactly as verl does; past the clamp the
    gradient is zero, which caps how hard one token can pull.
    """
    if kind.endswith("+") and kind in KL_ESTIMATORS:
        k2 = kl_penalty(logp, ref_logp, "k2")
        return k2 + (kl_penalty(logp, ref_logp, kind[:-1]) - k2).detach()
    if kind == "k1":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        d = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (d.exp() - d - 1.0).clamp(max=_K3_CLAMP)
    raise bad("kl kind", kind, "one of " + ", ".join(repr(k) for k in KL_ESTIMATORS))


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
    selected: torch.Tensor | None = None  # [B, R] bool: the tokens clip_cov / kl_cov single out (evenrl.core.selection)
    weight_mean: float | None = None  # the step's mean importance weight (algo.importance_normalize); None: as they are


@dataclass(frozen=True)
class LossSettings:
    policy_loss: str = "ppo"      # a surrogate of evenrl.core.surrogates.SURROGATES
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float = 0.0     # dual clip (ppo only); 0 = off
    tau_pos: float = 1.0          # sapo's gate temperatures
    tau_neg: float = 1.05
    kl_cov_coef: float = 0.1      # kl_cov's |log-ratio| weight
    old_policy: str = "trainer"   # trainer: old_logp is the trainer's; engine: the engine's, and importance weights
    #                               are then taken from the current policy (verl's bypass mode)
    kl_coef: float = 0.0          # weight of the per-token KL term; 0 measures KL (when ref_logp is given) only
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0     # weight of the entropy bonus; 0 only measures entropy
    importance_cap: float = 2.0   # upper threshold of the importance weight (with behavior_logp)
    importance_floor: float = 0.0  # lower threshold; 0 = none
    importance_level: str = "token"  # token | sequence | geometric (evenrl.core.importance)
    importance_mode: str = "truncate"  # truncate | mask | none
    rejection: tuple = ()         # (criterion, low, high) triples, evenrl.core.importance.CRITERIA


def rl_loss(inp: LossInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The policy-gradient surrogate s.policy_loss (times the importance weight and the rejection criteria when
    behavior_logp is given) + kl_coef x KL(policy || reference) - entropy_coef x entropy, per token.
    -> (loss [B, R], stats {name: (sum over masked tokens, token count)}).

    Stats are (sum, count) pairs so a global mean over ranks and micro-batches is exact: policy/loss,
    policy/clip_fraction, policy/dual_clip_fraction (with clip_ratio_c), policy/selected_fraction (clip_cov, kl_cov),
    policy/approx_kl, entropy, kl when ref_logp is given, and evenrl.core.importance's with behavior_logp (with
    weight_mean: policy/is_batch_mean, the mean the weights were divided by). Reducing the loss to a scalar with
    global denominators is evenrl.core.aggregation's job.
    """
    params = PolicyParams(clip_low=s.clip_low, clip_high=s.clip_high, clip_ratio_c=s.clip_ratio_c, tau_pos=s.tau_pos,
                          tau_neg=s.tau_neg, kl_cov_coef=s.kl_cov_coef)
    per_token, pstats = surrogate(s.policy_loss)(inp.logp, inp.old_logp, inp.advantages, params, mask=inp.mask,
                                                 selected=inp.selected)
    n = inp.mask.sum()
    is_stats = {}
    if inp.behavior_logp is not None:
        # bypass (old_policy=engine): old_logp is the engine's own, so the weights correct the current policy to it
        target = inp.logp.detach() if s.old_policy == "engine" else inp.old_logp
        w, is_stats = importance_weights(target, inp.behavior_logp, s.importance_cap, inp.mask,
                                         level=s.importance_level, mode=s.importance_mode, floor=s.importance_floor)
        if inp.weight_mean is not None:
            w = normalized(w, inp.weight_mean)
            is_stats["policy/is_batch_mean"] = (torch.tensor(inp.weight_mean, dtype=torch.float64) * n, n)
        if s.rejection:
            keep, rs_stats = rejection_keep(target.detach() - inp.behavior_logp.to(target.dtype), inp.mask, s.rejection)
            w = torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device))
            is_stats.update(rs_stats)
        per_token = per_token * w.to(per_token.dtype)
    stats = {"policy/loss": ((per_token * inp.mask).sum().detach(), n),
             "policy/clip_fraction": (pstats["clipped_tokens"], n),
             "policy/approx_kl": (pstats["approx_kl_sum"], n), **is_stats}
    if s.clip_ratio_c > 0:
        stats["policy/dual_clip_fraction"] = (pstats["dual_clipped_tokens"], n)
    if s.policy_loss in SELECTING:
        stats["policy/selected_fraction"] = (pstats["selected_tokens"], n)
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
