"""Policy-gradient surrogates per token (algo.policy_loss), as pure functions on [B, T] tensors: PPO-clip with
optional dual clip, GSPO's sequence-level ratio, CISPO's clipped and detached weight, SAPO's soft gate, GPG's plain
policy gradient, GMPO's geometric-mean ratio, and Clip-Cov / KL-Cov on the tokens a whole-mini-batch covariance
singles out (`selected`, from evenrl.core.selection).

Every surrogate has the same signature, fn(logp, old_logp, advantages, params, *, mask, selected), and returns
(loss [B, T], stats) with loss 0 outside `mask`, so `evenrl.core.losses.rl_loss` picks one by name (`SURROGATES`)
and the trainer never branches on the algorithm. stats are detached scalar *sums over masked tokens* (and `tokens`,
their count) so they can be all-reduced.

Sequence-level quantities (GSPO's ratio, GMPO's geometric mean) are built from per-row sums and token counts
(`evenrl.core.aggregation.row_sums`) and enter each token's loss through a detached term, the gradient flowing
through that token's own log-prob only. The loss always sees whole rows: the schedule moves whole samples, and
under sequence parallelism the group's per-token outputs are gathered to each of its ranks before the loss
(evenrl.distributed.sequence), so the sums are complete wherever the loss runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evenrl.core.aggregation import row_sums
from evenrl.errors import bad

# Log-ratios are clamped before exp(), like verl, so one wild token cannot produce inf/NaN.
_LOG_RATIO_CLAMP = 20.0
# GSPO's sequence log-ratio (plus the straight-through token term) is clamped above at 10 before exp, as in verl.
_SEQ_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class PolicyParams:
    """The surrogates' settings (config algo.*); each surrogate reads its own."""
    clip_low: float = 0.2       # ratio clip below 1 (ppo, gspo, cispo, clip_cov); geo_mean: on the log-ratio
    clip_high: float = 0.2
    clip_ratio_c: float = 0.0   # dual clip (ppo only); 0 = off
    tau_pos: float = 1.0        # sapo: the gate's temperature for A > 0
    tau_neg: float = 1.05       # sapo: for A <= 0
    kl_cov_coef: float = 0.1    # kl_cov: weight of |log-ratio| on the selected tokens


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


def _masked(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, loss, torch.zeros_like(loss))


def _ratio(logp, old_logp):
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio, log_ratio.exp()


def _only_ppo_dual_clip(name: str, p: PolicyParams) -> None:
    if p.clip_ratio_c:
        raise bad("clip_ratio_c", p.clip_ratio_c, f"0 with policy_loss={name} (dual clip is PPO's)")


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, p: PolicyParams = PolicyParams(),
             *, mask: torch.Tensor | None = None, selected: torch.Tensor | None = None
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
    log_ratio, ratio = _ratio(logp, old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = None
    if p.clip_ratio_c > 0:
        bound = -adv * p.clip_ratio_c
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    stats = _stats(mask, adv, ratio, p.clip_low, p.clip_high, clipped > unclipped, log_ratio, dual)
    return _masked(loss, mask), stats


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level ratio per token, [B, T]: s_i = exp(mean over row i's tokens of (logp - old_logp)),
    written s_i * pi_t / sg(pi_t) (value s_i, gradient s_i * grad log pi_t), as verl does; the log is clamped above at
    10. The mean is row_sums' sum over count."""
    total, count = row_sums((logp - old_logp).detach(), mask)
    seq_log = (total / count.clamp(min=1)).to(logp.dtype)
    return (logp - logp.detach() + seq_log[:, None]).clamp(max=_SEQ_LOG_RATIO_MAX).exp()


def gspo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, p: PolicyParams = PolicyParams(),
         *, mask: torch.Tensor | None = None, selected: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., Group Sequence Policy Optimization, arXiv:2507.18071; verl policy_loss.loss_mode=gspo, TRL
    importance_sampling_level=sequence): the PPO-clip surrogate on the sequence ratio s_i (`sequence_ratio`):
      loss = max(-s_i * A, -clip(s_i, 1 - clip_low, 1 + clip_high) * A)  on every token of row i.
    Per-sequence advantages, so one row's tokens are all clipped or none. The paper's objective is this with
    loss_aggregation=seq-mean-token-mean (verl forces that mode; TRL's default loss_type sums per token); its value
    and gradient equal TRL's form exp(mean log-ratio) broadcast over the row under every aggregation. The paper's
    clips are 3e-4 / 4e-4. clip_ratio_c must be 0 (no dual clip; verl's GSPO has none either). Same stats as
    ppo_clip."""
    _only_ppo_dual_clip("gspo", p)
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    ratio = sequence_ratio(logp, old_logp, mask)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    loss = torch.maximum(unclipped, clipped)
    stats = _stats(mask, adv, ratio.detach(), p.clip_low, p.clip_high, clipped > unclipped, logp - old_logp)
    return _masked(loss, mask), stats


def cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, p: PolicyParams = PolicyParams(),
          *, mask: torch.Tensor | None = None, selected: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585; verl policy_loss.loss_mode=cispo, TRL loss_type=cispo): the importance
    weight clipped and detached, times the log-prob, so every token keeps a gradient (none is dropped by a clip):
      loss = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logp       (ratio's log clamped to [-20, 20])
    clip_low >= 1 leaves the weight unbounded below (verl's recipe: clip_ratio_low=10); TRL's epsilon_high is an
    absolute cap on the weight, i.e. clip_high = epsilon_high - 1. clip_ratio_c must be 0. clipped_tokens counts the
    tokens whose weight was cut (verl's pg_clipfrac for cispo)."""
    _only_ppo_dual_clip("cispo", p)
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    log_ratio, ratio = _ratio(logp, old_logp)
    ratio = ratio.detach()
    weight = ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    loss = -weight * adv * logp
    stats = _stats(mask, adv, ratio, p.clip_low, p.clip_high, weight != ratio, log_ratio)
    return _masked(loss, mask), stats


def sapo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, p: PolicyParams = PolicyParams(),
         *, mask: torch.Tensor | None = None, selected: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv:2511.20347; verl loss_mode=sapo with actor.tau_pos/tau_neg): a
    smooth gate on the token ratio in place of the hard clip:
      loss = -f(ratio, tau) * A,   f(r, tau) = sigmoid(tau (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
    (ratio's log clamped to [-20, 20]). f(1) = 2 / tau with slope 1 there, so near ratio 1 the gradient is PPO's;
    it fades smoothly instead of dropping to 0 past a clip. verl aggregates it by seq-mean-token-mean. No token is
    clipped (clipped_tokens 0); clip_ratio_c must be 0."""
    _only_ppo_dual_clip("sapo", p)
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    log_ratio, ratio = _ratio(logp, old_logp)
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    stats = _stats(mask, adv, ratio, p.clip_low, p.clip_high, torch.zeros_like(mask), log_ratio)
    stats["clipped_low_tokens"] = stats["clipped_high_tokens"] = stats["clipped_tokens"]
    return _masked(loss, mask), stats


def gpg(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, p: PolicyParams = PolicyParams(),
        *, mask: torch.Tensor | None = None, selected: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (Group Policy Gradient, arXiv:2504.02546; verl loss_mode=gpg) and REINFORCE: loss = -A * logp, no ratio and
    no clip (old_logp only measures approx_kl). With algo.old_policy=engine and importance weights it is verl's bypass
    mode with loss_type=reinforce (-w A logp, w = pi / pi_engine truncated). clip_ratio_c must be 0."""
    _only_ppo_dual_clip("gpg", p)
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    loss = -adv * logp
    stats = _stats(mask, adv, torch.ones_like(logp), 0.0, 0.0, torch.zeros_like(mask), logp - old_logp)
    return _masked(loss, mask), stats


def geo_mean(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, p: PolicyParams = PolicyParams(),
             *, mask: torch.Tensor | None = None, selected: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Geometric-Mean Policy Optimization, arXiv:2507.20673; verl loss_mode=geo_mean): one ratio per sequence,
    the geometric mean of its token ratios, each clipped in log space on the side that helps:
      c_t = sgn(A) * min(sgn(A) d_t, sgn(A) clip(d_t, -clip_low, clip_high)),  d_t = logp_t - old_logp_t
      g_i = exp(mean_t c_t),   loss_i = -mean_t(A_t) * g_i
    written per token as -mean(A) * exp(sg(mean c) + c_t - sg(c_t)) (value loss_i on every token of row i, gradient
    through the token's own c_t), so loss_aggregation=seq-mean-token-mean gives exactly verl's mean over sequences of
    loss_i, gradient included (verl ignores loss_agg_mode here; the translation sets seq-mean-token-mean). Unlike
    verl, d_t is clamped to [-20, 20] (it changes nothing short of a ratio past e^20). clipped_tokens counts tokens
    whose d_t was clipped; clipped_low/high_tokens those with A < 0 / A > 0 (verl pg_clipfrac_lower / pg_clipfrac).
    The paper's clips are 0.4 / 0.4. clip_ratio_c must be 0."""
    _only_ppo_dual_clip("geo_mean", p)
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    d = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    sign = torch.sign(adv).expand_as(d)
    kept = d.clamp(-p.clip_low, p.clip_high)
    c = sign * torch.minimum(sign * d, sign * kept)
    total, count = row_sums(c.detach(), mask)
    n = count.clamp(min=1)
    adv_sum, _ = row_sums(adv.expand_as(d), mask)
    mean_adv = (adv_sum / n)[:, None]
    loss = -mean_adv * (c - c.detach() + (total / n)[:, None]).exp()
    cut = d != kept
    with torch.no_grad():
        stats = _stats(mask, adv, d.exp(), p.clip_low, p.clip_high, cut, d)
        stats["clipped_low_tokens"] = (cut & (adv < 0) & mask).sum()
        stats["clipped_high_tokens"] = (cut & (adv > 0) & mask).sum()
    return _masked(loss, mask), stats


def clip_cov(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, p: PolicyParams = PolicyParams(),
             *, mask: torch.Tensor | None = None, selected: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al., The Entropy Mechanism of RL for Reasoning LMs, arXiv:2505.22617; verl loss_mode=clip_cov):
    PPO-clip (clip_low, clip_high), and the tokens in `selected` get loss 0, so no gradient: a random few among those
    whose advantage x log-prob covariance is high (evenrl.core.selection.clip_cov_selected, over the whole
    mini-batch). selected None: none. Same stats as ppo_clip, plus selected_tokens. clip_ratio_c must be 0."""
    _only_ppo_dual_clip("clip_cov", p)
    loss, stats = ppo_clip(logp, old_logp, advantages, p, mask=mask)
    mask = _prepare(logp, old_logp, advantages, mask)[1]
    hit = mask & selected.bool() if selected is not None else torch.zeros_like(mask)
    stats["selected_tokens"] = hit.sum()
    return torch.where(hit, torch.zeros_like(loss), loss), stats


def kl_cov(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, p: PolicyParams = PolicyParams(),
           *, mask: torch.Tensor | None = None, selected: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (arXiv:2505.22617; verl loss_mode=kl_cov): the unclipped ratio surrogate -ratio * A on every token, plus
    kl_cov_coef * |logp - old_logp| on the tokens in `selected`, those of highest advantage x log-prob covariance
    over the whole mini-batch (evenrl.core.selection.kl_cov_selected). No clip (clipped_tokens 0); ratio's log clamped
    to [-20, 20] (verl does not clamp here: no difference short of e^20). Stats as ppo_clip plus selected_tokens."""
    _only_ppo_dual_clip("kl_cov", p)
    adv, mask = _prepare(logp, old_logp, advantages, mask)
    log_ratio, ratio = _ratio(logp, old_logp)
    loss = -adv * ratio
    hit = mask & selected.bool() if selected is not None else torch.zeros_like(mask)
    loss = torch.where(hit, loss + p.kl_cov_coef * (logp - old_logp).abs(), loss)
    stats = _stats(mask, adv, ratio, p.clip_low, p.clip_high, torch.zeros_like(mask), log_ratio)
    stats["clipped_low_tokens"] = stats["clipped_high_tokens"] = stats["clipped_tokens"]
    stats["selected_tokens"] = hit.sum()
    return _masked(loss, mask), stats


SURROGATES = {"ppo": ppo_clip, "gspo": gspo, "cispo": cispo, "sapo": sapo, "gpg": gpg, "geo_mean": geo_mean,
              "clip_cov": clip_cov, "kl_cov": kl_cov}
# surrogates that need `selected`: tokens chosen by a statistic over the whole mini-batch (evenrl.core.selection)
SELECTING = ("clip_cov", "kl_cov")


def surrogate(name: str):
    """The surrogate called `name` (algo.policy_loss)."""
    fn = SURROGATES.get(name)
    if fn is None:
        raise bad("policy_loss", name, "one of " + ", ".join(SURROGATES))
    return fn
