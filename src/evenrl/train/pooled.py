"""What an objective needs from more than one micro-batch, pooled over every rank before the update, so that it is
the number one device computes on the whole mini-batch (or step) whatever the layout: Clip-Cov / KL-Cov's
covariance means and selection threshold per mini-batch (evenrl.core.selection), the step's mean importance weight
(algo.importance_normalize, evenrl.core.importance.weight_sums).

Each rank computes its rows' pieces from the columns the loss will read (old_logp, advantages, engine log-probs),
then one float64 sum over ranks per mini-batch (the covariance means and the token count, with the weights' sum
and count riding along), and for the selection one gather of each rank's k most extreme candidates, whose k-th is
the global threshold. Under sequence parallelism a group's ranks hold the same rows: its first rank alone counts
them (and a tensor-parallel group's). With none of these objectives configured, nothing is computed and no collective is made.

    pooled = pool(cfg, step, batch, micro)        # one Pooled per mini-batch, after old_logp is on the batch
"""

from __future__ import annotations

import torch

from evenrl.config import RunConfig
from evenrl.core import selection
from evenrl.core.batch import Batch, ragged_to_right_aligned
from evenrl.core.importance import importance_weights, weight_sums
from evenrl.distributed import collectives as dist
from evenrl.distributed import exact
from evenrl.train.objectives import (Pooled, behavior_logprobs, columns, importance_weighted, kept_rows,
                                     selection_keys)


def needs_pooling(cfg: RunConfig) -> bool:
    """Whether an objective of this config takes numbers from the whole mini-batch or step (and so pi_old before
    the step's first update)."""
    return cfg.algo.policy_loss in ("clip_cov", "kl_cov") or (cfg.algo.importance_normalize
                                                                and importance_weighted(cfg))


def pool(cfg: RunConfig, step: int, batch: Batch, micro: list[list[list[int]]]) -> list[Pooled]:
    """One Pooled per mini-batch (micro: this rank's micro-batch rows of each), the same on every rank."""
    if not needs_pooling(cfg):
        return [Pooled() for _ in micro]
    counts = dist.counts_rows()  # a replica's ranks (sp x tp) hold the same rows: its first rank counts them
    views = [[_view(cfg, step, batch.select(rows)) for rows in mb if rows and counts] for mb in micro]
    if cfg.train.reproducibility == "bitwise":  # each micro-batch's sums, added in canonical order: layout-free
        sums = torch.tensor([exact.canonical_sum([int(v["mb"]["sample_index"][0]) for v in parts],
                                                 [_sums(cfg, [v]).tolist() for v in parts], 5) for parts in views],
                            dtype=torch.float64).reshape(len(views), 5)
    else:
        sums = torch.stack([_sums(cfg, parts) for parts in views])  # [minibatches, 5]
        dist.all_reduce_sum(sums)
    step_weights = sums[:, 3:].sum(0)
    weight_mean = float(step_weights[0] / step_weights[1]) if cfg.algo.importance_normalize and step_weights[1] else None
    thresholds = _thresholds(cfg, step, views, sums)
    return [Pooled(totals=s[:3].clone(), threshold=th, weight_mean=weight_mean) for s, th in zip(sums, thresholds)]


def _view(cfg: RunConfig, step: int, mb: Batch) -> dict:
    """A micro-batch's per-token inputs as the loss will see them (right-aligned [B, R], the same mask)."""
    lens = mb["response_len"]
    width = int(lens.max()) if len(lens) else 0
    mask = torch.arange(width)[None, :] >= (width - lens)[:, None]
    if "loss_mask" in mb:
        mask = mask & ragged_to_right_aligned(mb, "loss_mask", "cpu")
    mask = kept_rows(cfg, mb, mask)[1]
    adv, old_logp, engine_logp = columns(cfg, mb, "cpu")
    view = {"mb": mb, "mask": mask, "adv": adv, "old_logp": old_logp}
    behavior = behavior_logprobs(cfg, step, mb, old_logp, engine_logp)
    if behavior is not None and cfg.algo.importance_normalize:
        a = cfg.algo
        view["weights"] = importance_weights(old_logp, behavior, a.importance_cap, mask, level=a.importance_level,
                                             mode=a.importance_mode, floor=a.importance_floor)[0]
    return view


def _sums(cfg: RunConfig, parts: list[dict]) -> torch.Tensor:
    """[sum A, sum logp, tokens, weight sum, weight count] of this rank's rows of one mini-batch, float64."""
    out = torch.zeros(5, dtype=torch.float64)
    for v in parts:
        out[:3] += selection.moments(v["adv"], v["old_logp"], v["mask"])
        if "weights" in v:
            out[3:] += weight_sums(v["weights"], v["mask"], cfg.algo.importance_level)
    return out


def _thresholds(cfg: RunConfig, step: int, views: list[list[dict]], sums: torch.Tensor) -> list[float]:
    """Per mini-batch, the selection's global threshold: each rank's k most extreme candidates gathered (one gather
    for all mini-batches), the k-th of them all: KL-Cov's k largest covariances, Clip-Cov's n smallest keys among
    the eligible tokens."""
    algo = cfg.algo
    if algo.policy_loss not in ("clip_cov", "kl_cov"):
        return [float("inf")] * len(views)
    kl = algo.policy_loss == "kl_cov"
    ks = [selection.count(algo.kl_cov_fraction if kl else algo.clip_cov_fraction, float(s[2])) for s in sums]
    mine = {}
    for i, (parts, s, k) in enumerate(zip(views, sums, ks)):
        ranked = torch.zeros(0, dtype=torch.float64)
        for v in parts:
            cov = selection.covariance(v["adv"], v["old_logp"], v["mask"], s[:3])
            if not kl:  # the keys of the eligible tokens stand in for the covariance: the n smallest are chosen
                eligible = v["mask"] & selection.clip_cov_eligible(cov, algo.clip_cov_low, algo.clip_cov_high)
                cov = torch.where(eligible, selection_keys(cfg, step, v["mb"]), float("inf"))
            ranked = selection.candidates(torch.cat([ranked, selection.candidates(cov, k, largest=kl)]), k,
                                          largest=kl)
        mine[f"mb{i}"] = ranked
    everyone = dist.all_gather_tensors(mine)
    return [selection.kth([r[f"mb{i}"] for r in everyone], k, largest=kl) for i, k in enumerate(ks)]
