"""verl's off-policy settings as evenrl's: its recipes' generation ahead of training (one_step_off_policy,
fully_async_policy) and rollout correction in its spellings (actor_rollout_ref.actor.tis_imp_ratio_cap;
algorithm.rollout_is + rollout_is_threshold; algorithm.rollout_correction.rollout_is / rollout_rs with their
thresholds, bypass_mode with its loss_type) -> rollout.max_staleness, algo.importance_correction=all, its cap, floor
and rejection criteria, algo.old_policy=engine; each with a note where verl's meaning differs (levels and modes:
the tables'). Used by peers.verl; never imports torch.
"""

from __future__ import annotations

import math

from evenrl.errors import UsageError
from evenrl.planner.peers.reader import Check, Source, Translation
from evenrl.planner.peers.tables import rejection_options


def staleness(src: Source, t: Translation) -> None:
    """fully_async_policy (an async_training section) or one_step_off_policy: generation ahead of training."""
    if not isinstance(src.raw("async_training"), dict):
        t.set("rollout.max_staleness", 1, "rollout.n_gpus_per_node")
        t.notes.append("one_step_off_policy (a rollout section with its own GPUs): each step trains on samples of "
                       "the policy one update older, as evenrl's rollout.max_staleness=1")
        return
    s = src.float("async_training.staleness_threshold", 0.1)
    k = min(math.ceil(s), 16) if s > 0 else 0
    t.set("rollout.max_staleness", k, "async_training.staleness_threshold")
    t.notes.append(f"async_training.staleness_threshold={s:g} is a share of samples: per weight sync verl generates up "
                   f"to (1 + {s:g}) x the samples of one sync, so some are one sync older (1 is about one step "
                   "off); evenrl counts whole steps, step t sampling from the policy after step t-1-k: "
                   f"rollout.max_staleness={k}")
    sync = src.int("async_training.trigger_parameter_sync_step", 4)
    if sync > 1:
        t.notes.append(f"async_training.trigger_parameter_sync_step={sync}: verl pushes weights every {sync} "
                       "mini-batch updates; evenrl pushes once per step, after all of its mini-batches")
    if s > 0 and src.bool("async_training.partial_rollout", True):
        t.notes.append("async_training.partial_rollout: a verl response can span two weight versions; an evenrl "
                       "response never does (each step samples from one policy)")


def importance(src: Source, t: Translation) -> None:
    """verl's rollout correction (pi_old / pi_rollout) in its spellings: truncated weights (tis_imp_ratio_cap;
    algorithm.rollout_is + rollout_is_threshold; rollout_correction.rollout_is) times chained rejection criteria
    (rollout_correction.rollout_rs with rollout_rs_threshold), verl's bypass mode (old_policy=engine; loss_type
    reinforce: gpg) and batch-normalised weights. Levels: the tables'."""
    c = "algorithm.rollout_correction."
    cap = src.float("actor_rollout_ref.actor.tis_imp_ratio_cap", -1)
    key = "actor_rollout_ref.actor.tis_imp_ratio_cap"
    if cap <= 0 and src.bool("algorithm.rollout_is", False) and src.has("algorithm.rollout_is_threshold"):
        key = "algorithm.rollout_is_threshold"
        cap = src.float(key, 2.0)
    if cap > 0:  # the older spellings: truncated token weights only
        t.set("algo.importance_correction", "all", key)
        t.set("algo.importance_cap", min(max(cap, 1.0), 1000.0), key)
        return
    level, rs = off_if_null(src.str(c + "rollout_is", "")), off_if_null(src.str(c + "rollout_rs", ""))
    bypass = src.bool(c + "bypass_mode", False)
    reinforce = bypass and src.str(c + "loss_type", "ppo_clip") == "reinforce"
    if bypass:
        t.set("algo.old_policy", "engine", c + "bypass_mode")
        # apply_bypass_mode sets loss_mode=bypass_mode whatever the actor's: PPO-clip (compute_policy_loss_vanilla,
        # dual clip clip_ratio_c) or reinforce, aggregated by loss_agg_mode (no loss mode forces one then)
        mode = src.str("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
        t.set("algo.policy_loss", "gpg" if reinforce else "ppo", f"{c}bypass_mode {c}loss_type")
        if mode not in ("vanilla", "bypass_mode"):
            t.notes.append(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode} with {c}bypass_mode: verl's "
                           f"apply_bypass_mode replaces {mode} with its bypass loss, "
                           + ("REINFORCE weighted by pi / pi_rollout (evenrl's gpg)" if reinforce else
                              "plain PPO-clip on pi / pi_rollout with dual clip c = clip_ratio_c (evenrl's ppo)")
                           + ", aggregated by loss_agg_mode; so does the plan")
    if not level and not rs:
        return
    t.set("algo.importance_correction", "all", c + ("rollout_is" if level else "rollout_rs"))
    normalize = src.bool(c + "rollout_is_batch_normalize", False)
    if level and (reinforce or not bypass):
        t.set("algo.importance_cap", min(max(src.float(c + "rollout_is_threshold", 2.0), 1.0), 1000.0),
              c + "rollout_is_threshold")
        if normalize and bypass:
            t.notes.append(f"{c}rollout_is_batch_normalize: in bypass mode verl normalises each micro-batch's "
                           "weights of the current policy; evenrl normalises over the whole step, and not in bypass "
                           "mode: the weights stay as they are")
        elif normalize:
            t.set("algo.importance_normalize", True, c + "rollout_is_batch_normalize")
    else:
        t.set("algo.importance_mode", "none", c + ("loss_type" if level else "rollout_rs"))
        if level:
            t.notes.append(f"{c}rollout_is={level} with bypass_mode and loss_type=ppo_clip: verl computes the "
                           "weights for its metrics only (the ratio against the rollout policy corrects already); "
                           "evenrl applies none either (importance_mode=none)")
    if rs:
        criteria = _rejection(src, t, c, rs)
        if criteria:
            t.set("algo.rejection", criteria, f"{c}rollout_rs {c}rollout_rs_threshold")


def off_if_null(value: str) -> str:
    value = value.strip().strip("'\"")
    return "" if value.lower() in ("", "null", "none", "~") else value


def _rejection(src: Source, t: Translation, c: str, options: str) -> list[dict]:
    """rollout_rs's criteria with rollout_rs_threshold, read by verl's rules (_parse_rollout_rs_thresholds): one
    threshold for all or one per criterion; k1 takes "lower_upper" or one number u meaning [1/u, u], bounds on
    -log(pi_old / pi_rollout), i.e. on 1 / w: evenrl's bounds on w are low = 1/upper, high = 1/lower. k2, k3: an
    upper bound."""
    known = rejection_options("verl")
    names = list(dict.fromkeys(o.strip().strip("'\"") for o in options.split(",") if o.strip()))
    for n in names:
        if n not in known:
            t.notes.append(f"{c}rollout_rs={n}: not a value verl has ({', '.join(known)}); evenrl does not apply it")
    names = [n for n in names if n in known]
    raw = src.raw(c + "rollout_rs_threshold")
    if raw is None:
        t.checks.append(Check("rollout", "ValueError", "rollout_rs_threshold must be explicitly provided when "
                              "rollout_rs is enabled. Set rollout_rs_threshold to the desired threshold value.",
                              f"rollout_rs={options} has no rollout_rs_threshold (verl's default: null)"))
        t.notes.append(f"{c}rollout_rs={options}: no rollout_rs_threshold, so evenrl applies no rejection")
        return []
    specs = [x.strip() for x in str(raw).strip("'\"").split(",") if x.strip()]
    if len(specs) not in (1, len(names)):
        t.checks.append(Check("rollout", "ValueError", "rollout_rs_threshold expects either one threshold shared by "
                              f"all options or exactly {len(names)} thresholds to match the provided rollout_rs "
                              "options.", f"{len(specs)} thresholds for {len(names)} criteria"))
        return []
    out = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        k1 = name.endswith("k1")
        try:
            parts = [float(x) for x in spec.split("_", 1)]
        except ValueError:
            parts = []
        if not parts or min(parts) <= 0 or not all(map(math.isfinite, parts)) or (len(parts) == 2 and not k1):
            raise UsageError(f"verl {c}rollout_rs_threshold: got {spec!r} for {name}; need "
                             f"{'a positive number or positive lower_upper' if k1 else 'one positive number'}")
        if not k1:
            out.append({"criterion": known[name], "high": parts[0]})
            continue
        lower, upper = parts if len(parts) == 2 else (1.0 / parts[0], parts[0])
        low, high = 1.0 / upper, 1.0 / lower
        if low > 1.0 or high < 1.0:
            t.notes.append(f"{c}rollout_rs={name} with threshold {spec}: verl keeps weights in [{low:.4g}, "
                           f"{high:.4g}], which rejects exactly on-policy tokens (weight 1); evenrl's bounds hold 1, "
                           "so it does not apply this criterion")
            continue
        out.append({"criterion": known[name], "low": low, "high": high})
    return out
