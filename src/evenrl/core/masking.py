"""Which samples and tokens learn: samples left out of learning (a failed reward with rewards.on_failure=mask, a
truncated sample with rewards.mask_truncated), the loss denominators that then count them as empty, the samples
nobody needs to run because their gradient is exactly zero, and within a multi-turn trajectory the sampled tokens
(`loss_mask`: environment tokens never learn or count). Pure functions of the config and the step's columns, the
same on every rank."""

from __future__ import annotations

import torch

from evenrl.config import RunConfig
from evenrl.core.advantages import TOKEN_ADVANTAGES
from evenrl.core.batch import Batch, Ragged


def zero_gradient_rows(cfg: RunConfig, everyone: Batch) -> list[bool] | None:
    """Samples whose loss gradient is exactly zero, so nobody needs to run them: samples masked out of learning
    (masked_rows: their loss is dropped), and, with no per-token KL, entropy or load-balancing term and no objective that pools
    statistics over the mini-batch (clip_cov, kl_cov, importance_normalize), samples with advantage 0 (the
    policy loss is advantage x f(ratio); a GRPO group with equal rewards, with 0/1 rewards every all-right and
    all-wrong group). None when nothing may be skipped: min_rows > 1 (the schedule cannot drop rows; masked rows
    then run and rl_objective zeroes their loss) or nothing to skip."""
    algo, train = cfg.algo, cfg.train
    if train.min_rows_per_micro_batch > 1:
        return None
    masked = masked_rows(cfg, everyone)
    kl_in_loss = algo.kl_coef > 0 and algo.kl_in == "loss"
    per_token = algo.advantage in TOKEN_ADVANTAGES  # a sample's mean token advantage of 0 is no zero gradient
    # kl_cov penalises tokens with advantage 0 too; clip_cov, kl_cov and importance_normalize count every sample's
    # tokens in their whole-mini-batch statistics (evenrl.train.pooled), as one device running them all would
    pooled = algo.policy_loss in ("clip_cov", "kl_cov") or algo.importance_normalize
    balance = algo.router_aux_loss_coef > 0  # a mixture of experts' load-balancing loss: every token has a gradient
    if not train.skip_zero_gradient_samples or kl_in_loss or algo.entropy_coef > 0 or per_token or pooled or balance:
        return None if masked is None else masked.tolist()
    zero = everyone["advantage"] == 0
    return (zero if masked is None else zero | masked).tolist()


def masked_rows(cfg: RunConfig, rows: Batch) -> torch.Tensor | None:
    """Samples left out of learning, [N] bool, or None for none: with rewards.on_failure=mask, those on which a
    reward call failed; with rewards.mask_truncated, those cut at max_new_tokens. They get no advantage and no
    place in their group's (or the token whitening's) statistics (add_advantages), count in no loss denominator
    (counted_lengths) and run nowhere (zero_gradient_rows); mini-batch membership stays that of the whole step,
    so the update is the one a single device makes with their effect removed."""
    out = None
    if cfg.rewards.on_failure == "mask":
        out = rows["reward_failed"]
    if cfg.rewards.mask_truncated:
        out = ~rows["finished"] if out is None else out | ~rows["finished"]
    return out if out is not None and bool(out.any()) else None


def counted_lengths(cfg: RunConfig, everyone: Batch) -> torch.Tensor:
    """Response lengths as the loss denominators count them: the sampled tokens of a trajectory (sampled_len), 0
    for a masked sample (no tokens, no sequence)."""
    lens = everyone["sampled_len"] if "sampled_len" in everyone else everyone["response_len"]
    masked = masked_rows(cfg, everyone)
    return lens if masked is None else lens.masked_fill(masked, 0)


def sampled_view(batch: Batch, names: tuple[str, ...]) -> Batch:
    """Trajectories seen as their sampled tokens alone: `response_len` = sampled_len and each of the per-response-
    token columns `names` (those present) cut to its sampled tokens. Per-token returns and GAE run on this view,
    so an environment turn is no step of the discounting; `spread_sampled` puts the results back."""
    keep = batch["loss_mask"].values
    cols = {name: Ragged(batch[name].values[keep], batch["sampled_len"]) for name in names if name in batch}
    return Batch({"response_len": batch["sampled_len"], **cols})


def spread_sampled(values: Ragged, loss_mask: Ragged) -> Ragged:
    """A per-sampled-token column back onto every response token: 0 on environment tokens."""
    out = values.values.new_zeros(loss_mask.values.shape[0])
    out[loss_mask.values] = values.values
    return Ragged(out, loss_mask.lengths)
