"""Which tokens Clip-Cov and KL-Cov single out (algo.policy_loss=clip_cov / kl_cov), over a WHOLE mini-batch, as
pure functions; the trainer pools the per-rank pieces (evenrl.train.pooled) so the choice is the one a single
device makes on the whole mini-batch, on any number of ranks.

Both rank tokens by the centred product of advantage and log-prob (Cui et al., arXiv:2505.22617):
    cov_t = (A_t - mean A) (logp_t - mean logp),   means over the mini-batch's response tokens
  kl_cov    the k = max(1, floor(kl_cov_fraction x tokens)) tokens of largest cov_t
  clip_cov  among tokens with clip_cov_low < cov_t < clip_cov_high, n = max(1, floor(clip_cov_fraction x tokens)) at
            random: those with the n smallest keys (uniform numbers keyed by seed, step, sample and position)
verl computes this per micro-batch with the current log-probs and torch.randperm, so its choice depends on how a
mini-batch is split and on the global random state; evenrl's depends on the mini-batch alone. Its log-probs are the
step's starting policy's (old_logp): the current ones at the step's first update, and known before any update,
which a whole-mini-batch statistic needs. Ties at the threshold are all selected (float64 values; equal ones are
equal on every rank).

Pooling: `moments` gives (sum A, sum logp, tokens) per piece; added over ranks they give the means. `candidates`
gives a piece's k most extreme values; the k-th of all pieces' candidates (`kth`) is the global threshold.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _per_token(adv: Tensor, like: Tensor) -> Tensor:
    """Advantages [B] (one per sample) or [B, T] as [B, T] float64."""
    return (adv[:, None] if adv.dim() == 1 else adv).expand_as(like).double()


def moments(adv: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """[sum of A, sum of logp, token count] over `mask`, float64: added over pieces, the mini-batch's.
    adv [B] or [B, T]; logp, mask [B, T]."""
    keep = mask.bool()
    a, lp = _per_token(adv, logp), logp.double()
    return torch.stack([a[keep].sum(), lp[keep].sum(), keep.sum().double()])


def covariance(adv: Tensor, logp: Tensor, mask: Tensor, totals: Tensor) -> Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp), float64 [B, T], -inf outside `mask`; totals = pooled moments."""
    n = max(float(totals[2]), 1.0)
    cov = (_per_token(adv, logp) - totals[0] / n) * (logp.double() - totals[1] / n)
    return torch.where(mask.bool(), cov, torch.full_like(cov, float("-inf")))


def count(fraction: float, tokens: float) -> int:
    """How many tokens a fraction of the mini-batch's selects: max(1, floor(fraction x tokens)), as verl rounds."""
    return max(1, int(fraction * tokens))


def candidates(values: Tensor, k: int, largest: bool = True) -> Tensor:
    """This piece's k largest (or smallest) finite values, 1-D float64: all another piece needs of it."""
    flat = values.reshape(-1).double()
    flat = flat[torch.isfinite(flat)]
    return torch.topk(flat, min(k, flat.numel()), largest=largest).values


def kth(pieces: list[Tensor], k: int, largest: bool = True) -> float:
    """The k-th largest (smallest) of all pieces' candidates; with fewer than k, the last of them; none: +-inf (no
    token passes)."""
    allv = torch.cat([p.reshape(-1).double() for p in pieces]) if pieces else torch.zeros(0, dtype=torch.float64)
    if allv.numel() == 0:
        return float("inf") if largest else float("-inf")
    top = torch.topk(allv, min(k, allv.numel()), largest=largest).values
    return float(top[-1])


def kl_cov_selected(cov: Tensor, threshold: float) -> Tensor:
    """KL-Cov's tokens: cov >= the mini-batch's k-th largest."""
    return cov >= threshold


def clip_cov_eligible(cov: Tensor, low: float, high: float) -> Tensor:
    """Clip-Cov's candidates: low < cov < high (verl clip_cov_lb, clip_cov_ub)."""
    return (cov > low) & (cov < high)


def clip_cov_selected(cov: Tensor, keys: Tensor, low: float, high: float, key_threshold: float) -> Tensor:
    """Clip-Cov's tokens: eligible ones whose key is at most the mini-batch's n-th smallest eligible key."""
    return clip_cov_eligible(cov, low, high) & (keys.double() <= key_threshold)
