"""The per-micro-batch objectives the update minimises: the policy's (`rl_objective`) and the critic's
(`value_objective`), each building the pure loss's inputs from the forward's outputs and the micro-batch's columns, plus the
engine/trainer log-prob mismatch they report on the way; and the settings the pure functions get from the config
(`loss_settings`, `advantage_settings`, `norm_tokens`), so that an algorithm is a value and never a branch of the loop.
The losses themselves are evenrl.core.losses. What some objectives take from the whole mini-batch or step (`Pooled`:
Clip-Cov / KL-Cov's covariance and threshold, the mean importance weight) is pooled over the ranks before the update
(evenrl.train.pooled) and turned into each micro-batch's inputs here (`selected_tokens`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from evenrl.config import RunConfig
from evenrl.core import offpolicy, selection
from evenrl.core.batch import Batch, Ragged, ragged_to_right_aligned
from evenrl.core.losses import LossInputs, LossSettings, rl_loss, value_loss
from evenrl.core.masking import counted_lengths, masked_rows
from evenrl.engines.base import keyed_seed
from evenrl.train.runlog import MISMATCH_THRESHOLD

STAT_NAMES = ["policy/loss", "policy/clip_fraction", "policy/approx_kl", "kl", "entropy",
              "rollout/logprob_mismatch", "rollout/mismatch_fraction"]
# with importance weights (importance_correction)
IS_STAT_NAMES = ["policy/is_weight", "policy/is_clipped_fraction", "policy/is_masked_fraction",
                 "policy/is_clipped_seq_fraction", "policy/is_masked_seq_fraction"]
CRITIC_STAT_NAMES = ["critic/loss", "critic/clip_fraction", "critic/values"]


@dataclass(frozen=True)
class Pooled:
    """What an objective takes from more than its micro-batch, the same on every rank (evenrl.train.pooled):
    the mini-batch's [sum A, sum logp, tokens] and the selection threshold (clip_cov: the n-th smallest eligible
    key; kl_cov: the k-th largest covariance), and the step's mean importance weight (importance_normalize)."""
    totals: torch.Tensor | None = None
    threshold: float = math.inf
    weight_mean: float | None = None


def rl_objective(cfg: RunConfig, step: int, outputs, targets, mask, mb: Batch, pooled: Pooled = Pooled()):
    """A micro-batch's policy loss at RL step `step`: its LossInputs from the forward's log-probs and entropies
    (`outputs` [B, R, 2], models.forward.response_logprobs), its columns and what was pooled from the whole
    mini-batch, then the pure objective (evenrl.core.losses.rl_loss). Each row is a whole sample, so
    sequence-level terms (GSPO's ratio, sequence importance weights) see all of its tokens."""
    keep, mask = kept_rows(cfg, mb, mask)
    logp, entropy = outputs[..., 0], outputs[..., 1]
    adv, old_logp, engine_logp = columns(cfg, mb, logp.device, logp.detach())
    inputs = LossInputs(
        logp=logp, mask=mask, entropy=entropy, advantages=adv, old_logp=old_logp,
        ref_logp=ragged_to_right_aligned(mb, "ref_logp", logp.device) if "ref_logp" in mb else None,
        behavior_logp=behavior_logprobs(cfg, step, mb, old_logp if cfg.algo.old_policy == "trainer" else logp,
                                        engine_logp),
        selected=selected_tokens(cfg, step, mb, adv, old_logp, mask, pooled), weight_mean=pooled.weight_mean)
    per_token, stats = rl_loss(inputs, loss_settings(cfg))
    stats.update(logprob_mismatch(old_logp if cfg.algo.old_policy == "trainer" else logp, engine_logp, mask))
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    return per_token, stats


def columns(cfg: RunConfig, mb: Batch, device, current=None):
    """(advantages [B] or [B, R], old_logp [B, R], engine_logp [B, R]) of a micro-batch: old_logp is the engine's
    with old_policy=engine (verl's bypass), else the trainer's at the start of the step (`current`, the forward's own
    log-probs detached, where no pass computed them: one update per step, ratio exactly 1)."""
    adv = ragged_to_right_aligned(mb, "token_advantage", device) if "token_advantage" in mb else mb["advantage"]
    engine_logp = ragged_to_right_aligned(mb, "engine_logp", device)
    if cfg.algo.old_policy == "engine":
        old_logp = engine_logp
    else:
        old_logp = ragged_to_right_aligned(mb, "old_logp", device) if "old_logp" in mb else current
    return adv.to(device), old_logp, engine_logp


def selected_tokens(cfg: RunConfig, step: int, mb: Batch, adv, old_logp, mask, pooled: Pooled):
    """clip_cov / kl_cov: the micro-batch's tokens that the whole mini-batch's covariance singles out, [B, R] bool
    (evenrl.core.selection, from the pooled totals and threshold); None for the other losses."""
    algo = cfg.algo
    if algo.policy_loss not in ("clip_cov", "kl_cov") or pooled.totals is None:
        return None
    cov = selection.covariance(adv, old_logp, mask, pooled.totals)
    if algo.policy_loss == "kl_cov":
        return mask & selection.kl_cov_selected(cov, pooled.threshold)
    keys = selection_keys(cfg, step, mb).to(cov.device)
    return mask & selection.clip_cov_selected(cov, keys, algo.clip_cov_low, algo.clip_cov_high, pooled.threshold)


def selection_keys(cfg: RunConfig, step: int, mb: Batch) -> torch.Tensor:
    """Clip-Cov's random choice as numbers: a uniform key per response token, keyed by (seed, step, sample), so the
    choice is the same on any layout; [B, R] float64, right-aligned like the forward's outputs."""
    rows = []
    for index, n in zip(mb["sample_index"].tolist(), mb["response_len"].tolist()):
        gen = torch.Generator().manual_seed(keyed_seed("evenrl-clip-cov", cfg.train.seed, step, index) >> 1)
        rows.append(torch.rand(n, generator=gen, dtype=torch.float64))
    return Batch({"keys": Ragged.of(rows, torch.float64)}).padded("keys", 2.0, side="left")[0]


def loss_settings(cfg: RunConfig) -> LossSettings:
    """The pure objective's settings from the config: every algorithm choice is a value here, none a branch."""
    algo = cfg.algo
    return LossSettings(policy_loss=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
                        clip_ratio_c=algo.clip_ratio_c, tau_pos=algo.sapo_tau_pos, tau_neg=algo.sapo_tau_neg,
                        kl_cov_coef=algo.kl_cov_coef, old_policy=algo.old_policy, entropy_coef=algo.entropy_coef,
                        kl_coef=algo.kl_coef if algo.kl_in == "loss" else 0.0, kl_estimator=algo.kl_estimator,
                        importance_cap=algo.importance_cap, importance_floor=algo.importance_floor,
                        importance_level=algo.importance_level, importance_mode=algo.importance_mode,
                        rejection=tuple((r.criterion, r.low, r.high) for r in algo.rejection))


def advantage_settings(cfg: RunConfig, everyone: Batch) -> dict:
    """Keyword arguments of the group advantage estimator (evenrl.core.advantages.compute_advantages) from the config
    and the step's per-sample columns (everyone)."""
    algo = cfg.algo
    if algo.advantage == "grpo":
        return {"std_scale": algo.std_scale, "eps": algo.std_eps}
    if algo.advantage != "reinforce_pp_baseline":
        return {}
    kw = {"eps": algo.std_eps, "whiten": algo.reinforce_pp_baseline_whiten}
    if algo.reinforce_pp_baseline_whiten == "token":  # the tokens the loss counts: a trajectory's sampled ones
        kw["lengths"] = counted_lengths(cfg, everyone)
    return kw


def norm_tokens(cfg: RunConfig) -> float:
    """seq-mean-token-sum-norm's constant length: algo.loss_norm_tokens, else the response cap."""
    return float(cfg.algo.loss_norm_tokens or cfg.response_tokens())


def policy_stat_names(cfg: RunConfig) -> list[str]:
    """The statistics every rank reduces for the policy, in one order: the importance weights' with
    importance_correction (with their batch mean and rejection shares where on), the dual clip's share with
    clip_ratio_c, the selected tokens' share with clip_cov and kl_cov."""
    algo, weighted = cfg.algo, importance_weighted(cfg)
    return (STAT_NAMES + (IS_STAT_NAMES if weighted else [])
            + (["policy/is_batch_mean"] if weighted and algo.importance_normalize else [])
            + (["policy/rejected_fraction", "policy/rejected_seq_fraction"] if weighted and algo.rejection else [])
            + (["policy/dual_clip_fraction"] if algo.clip_ratio_c > 0 else [])
            + (["policy/selected_fraction"] if algo.policy_loss in ("clip_cov", "kl_cov") else []))


def importance_weighted(cfg: RunConfig) -> bool:
    """Whether the policy-gradient term carries importance weights (algo.importance_correction): 'stale' only
    when some token can come from an older policy (rollout.max_staleness >= 1, or carried by rollout.partial); with
    neither the loss is then exactly the synchronous one."""
    mode = cfg.algo.importance_correction
    return mode == "all" or (mode == "stale" and (cfg.rollout.max_staleness > 0 or cfg.rollout.partial))


def behavior_logprobs(cfg: RunConfig, step: int, mb: Batch, target_logp, engine_logp):
    """The log-probs the importance weight divides by, [B, R], or None for no weighting: per token
    (evenrl.core.offpolicy), the engine's where the token is corrected, the weight's own numerator (`target_logp`)
    elsewhere (weight exp(0) = 1 exactly). 'stale' corrects the tokens of an older policy than the one the step
    trains (version < step - 1): each token's own version (token_version), else its sample's."""
    if not importance_weighted(cfg):
        return None
    if "token_version" in mb:
        version = ragged_to_right_aligned(mb, "token_version", engine_logp.device)
    else:
        version = mb["version"].to(engine_logp.device)[:, None].expand(engine_logp.shape)
    return offpolicy.behavior_logprobs(target_logp, engine_logp, version, step - 1, cfg.algo.importance_correction)


def value_objective(cfg: RunConfig, logits, targets, mask, mb: Batch):
    """A micro-batch's critic loss: the value head's output at each response token's state (logits [B, R, 1])
    against the GAE targets, clipped around the values at sampling time."""
    keep, mask = kept_rows(cfg, mb, mask)
    values = logits.squeeze(-1).float()
    per_token, stats = value_loss(values, ragged_to_right_aligned(mb, "old_values", values.device),
                                  ragged_to_right_aligned(mb, "returns", values.device), mask,
                                  cfg.critic.value_clip)
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    return per_token, stats


def kept_rows(cfg: RunConfig, mb: Batch, mask):
    """(keep [B, 1] or None, mask without masked rows): masked rows run only when min_rows > 1 (else the schedule
    leaves them out); then their loss is zeroed here and they stay out of the stats."""
    masked = masked_rows(cfg, mb)
    if masked is None:
        return None, mask
    keep = ~masked.to(mask.device)[:, None]
    return keep, mask & keep


def logprob_mismatch(trainer_logp, engine_logp, mask) -> dict:
    """|engine - trainer| log-prob of the sampled tokens, as (sum, count) stats. The trainer side is old_logp: the
    sampling policy's log-probs, computed by the update's own forward (or add_logprobs), so no extra pass; measured
    on the samples some rank trains on (zero-gradient samples are skipped)."""
    diff = (trainer_logp.detach().float() - engine_logp.float()).abs()[mask]
    n = float(diff.numel())
    return {"rollout/logprob_mismatch": (diff.sum(), n),
            "rollout/mismatch_fraction": ((diff > MISMATCH_THRESHOLD).sum(), n)}
