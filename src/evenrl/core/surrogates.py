"""Policy-gradient surrogates per token (algo.policy_loss): PPO-clip with optional dual clip, GSPO's sequence-level
ratio, CISPO's clipped and detached importance weight, as pure functions on [B, T] tensors.

Every surrogate has the same signature and returns (loss [B, T], stats) with loss 0 outside `mask`, so
`evenrl.core.losses.rl_loss` picks one by name (`SURROGATES`) and the trainer never branches on the algorithm.
stats are detached scalar *sums over masked tokens* (and `tokens`, their count) so they can be all-reduced.

Sequence-level quantities (GSPO's ratio) are built from per-row sums of the log-ratio and per-row token counts
(`evenrl.core.aggregation.row_sums`) and enter each token's loss through a detached term, the gradient flowing
through that token's own log-prob only. The loss always sees whole rows: the schedule moves whole samples, and
under sequence parallelism the group's per-token outputs are gathered to each of its ranks before the loss
(evenrl.distributed.sequence), so the sums are complete wherever the loss runs.
"""

from __future__ import annotations

import torch

from evenrl.core.aggregation import row_sums
from evenrl.errors import bad

# Log-ratios are clamped before exp(), like verl, so one wild token cannot produce inf/NaN.
_LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio (plus the straight-through token term) is clamped above at 10 before exp, as in verl.
_SEQ_LOG_RATIO_MAX = 10.0


def _prepare(logp, old_logp, advantages, mask):
    if logp.shape != old_logp.shape or logp.dim() != 2:
        raise ValueError(f"logp and old_logp must both be [B, T]; got {tuple(logp.shape)}, {tuple(old_logp.shape)}")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask.bool()
    return adv.to(logp.dtype), mask


def _stats(mask, adv, ratio, clip_low, clip_high, clipped, log_ratio, dual=None) -> dict[str, torch.Tensor]:
    def count(hit: torch.Tensor) -> torch.Tensor:
        return (hit & mask).sum()

    with torch.no_grad():
        return {"tokens": mask.sum(),
                "clipped_tokens": count(clipped),
                "clipped_low_tokens": count((adv < 0) & (ratio < 1.0 - clip_low)),
                "clipped_high_tokens": count((adv > 0) & (ratio > 1.0 + clip_high)),
                "dual_clipped_tokens": count(dual) if dual is not None else mask.new_zeros((), dtype=torch.long),
                "approx_kl_sum": torch.where(mask, -log_ratio.detach(), torch.zeros_like(log_ratio)).sum()}


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float = 0.2,
             clip_high: float = 0.2, clip_ratio_c: float = 0.0, *, mask: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate per token with asymmetric clipping and optional dual clip.  -> (loss [B, T], stats).

    logp, old_logp [B, T]: log-probs of the sampled tokens under the current and the rollout policy.
    advantages [B] (broadcast over tokens) or [B, T].
      ratio = exp(logp - old_logp)          (log-ratio clamped to [-20, 20] first, as verl does)
      loss  = max(-ratio * A, -clip(ratio, 1 - clip_low, 1 + clip_high) * A)
      dual clip (clip_ratio_c > 1; 0 = off): where A < 0, loss = min(loss, -clip_ratio_c * A), so a negative-advantage
      token whose ratio ran past clip_ratio_c pushes no further (Ye et al. arXiv:1912.09729; verl clip_ratio_c).
    PPO: Schulman et al. arXiv:1707.06347.  clip_high > clip_low is DAPO's "clip-higher" (arXiv:2503.14476).

    stats (sums over masked tokens): clipped_tokens (the clipped branch was taken; verl pg_clipfrac numerator),
    clipped_low_tokens (A < 0, ratio < 1 - clip_low), clipped_high_tokens (A > 0, ratio > 1 + clip_high),
    dual_clipped_tokens (the dual bound was taken; verl pg_clipfrac_lower numerator), approx_kl_sum (sum of
    old_logp - logp; verl ppo_kl numerator)."""
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = None
    if clip_ratio_c > 0:
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    stats = _stats(mask, adv, ratio, clip_low, clip_high, clipped > unclipped, log_ratio, dual)
    return torch.where(mask, loss, torch.zeros_like(loss)), stats


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level ratio per token, [B, T]: s_i = exp(mean over row i's tokens of (logp - old_logp)),
    written s_i * pi_t / sg(pi_t) (value s_i, gradient s_i * grad log pi_t), as verl does; the log is clamped above at
    10. The mean is row_sums' sum over count."""
    total, count = row_sums((logp - old_logp).detach(), mask)
    seq_log = (total / count.clamp(min=1)).to(logp.dtype)
    return (logp - logp.detach() + seq_log[:, None]).clamp(max=_SEQ_LOG_RATIO_MAX).exp()


def gspo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float = 3e-4,
         clip_high: float = 4e-4, clip_ratio_c: float = 0.0, *, mask: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., Group Sequence Policy Optimization, arXiv:2507.18071; verl policy_loss.loss_mode=gspo, TRL
    importance_sampling_level=sequence): the PPO-clip surrogate on the sequence ratio s_i (`sequence_ratio`):
      loss = max(-s_i * A, -clip(s_i, 1 - clip_low, 1 + clip_high) * A)  on every token of row i.
    Per-sequence advantages, so one row's tokens are all clipped or none. The paper's objective is this with
    loss_aggregation=seq-mean-token-mean (verl forces that mode; TRL's default loss_type sums per token); its value
    and gradient equal TRL's form exp(mean log-ratio) broadcast over the row under every aggregation.
    clip_ratio_c must be 0 (no dual clip; verl's GSPO has none either). Same stats as ppo_clip."""
    if clip_ratio_c:
        raise bad("clip_ratio_c", clip_ratio_c, "0 with policy_loss=gspo (dual clip is PPO's)")
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    ratio = sequence_ratio(logp, old_logp, mask)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    stats = _stats(mask, adv, ratio.detach(), clip_low, clip_high, clipped > unclipped, logp - old_logp)
    return torch.where(mask, loss, torch.zeros_like(loss)), stats


def cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float = 10.0,
          clip_high: float = 4.0, clip_ratio_c: float = 0.0, *, mask: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585; verl policy_loss.loss_mode=cispo, TRL loss_type=cispo): the importance
    weight clipped and detached, times the log-prob, so every token keeps a gradient (none is dropped by a clip):
      loss = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logp       (ratio's log clamped to [-20, 20])
    clip_low >= 1 leaves the weight unbounded below (verl's recipe: clip_ratio_low=10); TRL's epsilon_high is an
    absolute cap on the weight, i.e. clip_high = epsilon_high - 1. clip_ratio_c must be 0. clipped_tokens counts the
    tokens whose weight was cut (verl's pg_clipfrac for cispo)."""
    if clip_ratio_c:
        raise bad("clip_ratio_c", clip_ratio_c, "0 with policy_loss=cispo (dual clip is PPO's)")
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp().detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * logp
    stats = _stats(mask, adv, ratio, clip_low, clip_high, weight != ratio, log_ratio)
    return torch.where(mask, loss, torch.zeros_like(loss)), stats


SURROGATES = {"ppo": ppo_clip, "gspo": gspo, "cispo": cispo}


def surrogate(name: str):
    """The surrogate called `name` (algo.policy_loss)."""
    fn = SURROGATES.get(name)
    if fn is None:
        raise bad("policy_loss", name, "one of " + ", ".join(SURROGATES))
    return fn
