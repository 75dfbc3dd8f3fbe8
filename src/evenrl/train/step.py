"""One RL step on this rank (GRPO family, REINFORCE++, PPO with a critic). It reads top to bottom in `rl_step`;
each phase is a named function below.

One step: sample prompts -> rollout -> rewards (in rounds with dynamic sampling) -> KL / values at sampling time
when needed -> advantages -> exchange to the planned ranks -> old/reference log-probs when needed -> mini-batch
updates of the policy (and the critic) -> metrics.

Why the result does not depend on the number of ranks:
  * the prompt order comes from (seed, epoch) only; each sample's randomness from (seed, step, prompt id, sample);
  * advantages are computed from the whole step's rewards on every rank; per-token ones (reinforce_pp, gae) from
    each sample's own tokens, whitened with statistics pooled from per-sample moments in sample order;
  * mini-batch membership is fixed before ranks are considered (evenrl.core.schedule);
  * losses are divided by the mini-batch's global counts and gradients are summed (evenrl.train.update).
"""

from __future__ import annotations

import functools

import torch

from evenrl.config import RunConfig
from evenrl.core.advantages import (TOKEN_ADVANTAGES, compute_advantages, discounted_returns, gae_advantages,
                                    pooled_moments, token_moments, token_rewards, whiten)
from evenrl.core.batch import Batch, Ragged, ragged_to_right_aligned
from evenrl.core.losses import kl_penalty
from evenrl.core.masking import counted_lengths, masked_rows, sampled_view, spread_sampled, zero_gradient_rows
from evenrl.core.model_plan import plan_of
from evenrl.distributed import collectives as dist
from evenrl.distributed import exact
from evenrl.engines.base import keyed_seed
from evenrl.errors import RunStopped
from evenrl.models.forward import response_logits, response_logprobs
from evenrl.models.loading import forwards_meet
from evenrl.models import routing
from evenrl.models.routing import is_moe
from evenrl.planner.dims import dims_from_config
from evenrl.train import moe
from evenrl.train.balance import rebalance
from evenrl.train.metrics import Timer, step_metrics
from evenrl.train.pooled import needs_pooling, pool
from evenrl.train.reduction import reduction_of
from evenrl.train.objectives import (CRITIC_STAT_NAMES, advantage_settings, norm_tokens, policy_stat_names,
                                     rl_objective, value_objective)
from evenrl.train.sampling import sample, stop_if_all_failed_alike
from evenrl.train.trainer import Trainer
from evenrl.train.update import compute_logprobs, compute_values, minibatch_denominators, minibatch_update


# ------------------------------------------------------------------------------------------ the step

def rl_step(step: int, trainer: Trainer) -> tuple[dict, list[dict]]:
    """One RL step on this rank; returns the step's global metrics and a few of this rank's completions."""
    cfg, timer = trainer.cfg, Timer(step)
    if trainer.sync is not None:
        with timer("weights"):
            trainer.sync.before_rollout(step)                                   # the engine samples from these
    local, failures, sampling = sample(trainer, step, timer)                    # rollout + rewards: this rank's rows
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "reward":
        with timer("logprobs"):
            on_group_rows(trainer, local, add_reward_kl, ("reward_kl", "kl_sum", "routes"))
    if trainer.critic is not None:
        with timer("values"):
            on_group_rows(trainer, local, add_values, ("old_values",))          # the critic at sampling time
    with timer("advantage"):
        add_token_returns(trainer, local)                                       # reinforce_pp, gae: before whitening
        everyone, failures = gather_rows(local, failures)                       # per-sample numbers of all ranks
        stop_if_all_failed_alike(trainer, local, everyone)                      # trajectories that cannot work
        adv_stats = add_advantages(trainer, local, everyone)
    with timer("exchange"):
        schedule = plan_step(trainer, everyone)
        batch, micro = exchange(trainer, local, schedule)                       # rows this rank trains on
        lens = counted_lengths(cfg, everyone)                                   # 0 for masked samples
        denoms = [minibatch_denominators(lens, mb.rows, norm_tokens(cfg)) for mb in schedule.minibatches]
    with timer("logprobs"):
        if needs_old_logprobs(cfg):                                             # router_replay=trainer: records
            add_logprobs(trainer, batch, "old_logp", trainer.model, flat(micro))
        if cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "loss":
            with trainer.reference_policy() as reference:                       # with LoRA: the adapters disabled
                add_logprobs(trainer, batch, "ref_logp", reference, flat(micro))
        if cfg.rollout.router_replay == "engine":                              # the trainer's own routing
            routed = moe.probe(trainer.model, batch, flat(micro), temperature=trainer.temperature,
                               pad_token_id=trainer.pad_id, bitwise=bitwise(cfg))
        pooled = pool(cfg, step, batch, micro)                                  # whole-mini-batch numbers, if any
    with timer("update"):
        stats = update(trainer, step, batch, micro, denoms, pooled)
        if cfg.rollout.router_replay == "engine":
            stats.update(routed)
    load = rebalance(trainer.balance, timer, local)                             # busy times; auto: next weights
    if bitwise(cfg):
        stats["weights/hash"] = weights_hash(trainer, step)                     # the proof: equal logs, equal runs

    lr = trainer.policy.optimizer.param_groups[0]["lr"]
    metrics = step_metrics(cfg, lr, everyone, schedule, {**stats, **adv_stats, **sampling, **load}, failures, timer,
                           trainer.mesh.sp)
    return metrics, example_rows(local)


# ------------------------------------------------------------------------------------------ named pieces

def add_logprobs(trainer: Trainer, batch: Batch, name: str, model, micro_rows: list[list[int]]) -> None:
    """Per-token log-probs as column `name`; the policy's first pass records its routes with router_replay=trainer."""
    kw = dict(temperature=trainer.temperature, pad_token_id=trainer.pad_id)
    if name == "old_logp" and records_routes(trainer, batch):
        logps, batch["routes"] = moe.record_routes(model, batch, micro_rows, **kw)
    else:
        logps = compute_logprobs(model, batch, micro_rows, **kw)
    batch[name] = Ragged.of(logps, torch.float32)


def records_routes(trainer: Trainer, batch: Batch) -> bool:
    """router_replay=trainer (R2): a pass of the policy records the routes the later passes replay, the first one
    that runs (routes not yet in the batch)."""
    return trainer.cfg.rollout.router_replay == "trainer" and "routes" not in batch


def add_reward_kl(trainer: Trainer, batch: Batch) -> None:
    """KL as a reward penalty, per token KL(policy || reference) at sampling time: summed per sequence for the
    group estimators (kl_sum), kept per token for reinforce_pp and gae (reward_kl), which fold it into each
    token's reward."""
    # one sample per forward; a sharded or expert-parallel model makes as many forwards as the busiest rank
    passes = max(dist.all_gather_object(len(batch))) if forwards_meet(trainer.model) else len(batch)
    micro = singles(len(batch)) + [[]] * (passes - len(batch))
    kw = dict(temperature=trainer.temperature, pad_token_id=trainer.pad_id)
    if records_routes(trainer, batch):  # the step's first policy pass: the routes the later passes replay
        logp, batch["routes"] = moe.record_routes(trainer.model, batch, micro, **kw)
    else:
        logp = compute_logprobs(trainer.model, batch, micro, **kw)
    with trainer.reference_policy() as reference:
        ref = compute_logprobs(reference, batch, micro, temperature=trainer.temperature, pad_token_id=trainer.pad_id)
    kl = [kl_penalty(a, b, trainer.cfg.algo.kl_estimator) for a, b in zip(logp, ref)]
    if "loss_mask" in batch:  # a trajectory's environment tokens were not sampled: no KL of the policy's there
        kl = [k * m for k, m in zip(kl, torch.split(batch["loss_mask"].values, batch["loss_mask"].lengths.tolist()))]
    if trainer.cfg.algo.advantage in TOKEN_ADVANTAGES:
        batch["reward_kl"] = Ragged.of(kl, torch.float32)
    else:
        batch["kl_sum"] = torch.stack([k.sum() for k in kl]).float() if kl else torch.zeros(0)


def add_values(trainer: Trainer, batch: Batch) -> None:
    """The critic's value of every response token's state at sampling time: GAE's baseline and the value loss's
    clipping centre."""
    micro = capped_runs(batch["tokens"].lengths.tolist(), trainer.balance.token_cap(trainer.cfg, dist.rank()))
    if bitwise(trainer.cfg):  # a rank's rows at sampling time depend on the layout: one sample per forward
        micro = singles(len(batch))
    if forwards_meet(trainer.critic.model):  # every rank as many forwards as the busiest (empty ones are fillers)
        micro += [[]] * (max(dist.all_gather_object(len(micro))) - len(micro))
    with routing.options(trainer.critic.model, replay=False):  # an MoE critic routes by its own routers
        values = compute_values(trainer.critic.model, batch, micro, pad_token_id=trainer.pad_id)
    batch["old_values"] = Ragged.of(values, torch.float32)


def add_token_returns(trainer: Trainer, local: Batch) -> None:
    """reinforce_pp and gae, per token on this rank's rows: the outcome reward on the last token (minus the
    per-token KL with kl_in=reward), then discounted returns (reinforce_pp) or GAE with the critic's values and
    its value targets (gae); the per-sample moments of these raw advantages ride along in gather_rows so that
    add_advantages can whiten them over the whole step. Nothing to do for the group estimators."""
    algo = trainer.cfg.algo
    if algo.advantage not in TOKEN_ADVANTAGES:
        return
    # trajectories: the steps are the sampled tokens alone (an environment turn is no step of the discounting)
    view = sampled_view(local, ("reward_kl", "old_values")) if "loss_mask" in local else local
    widen = (lambda col: spread_sampled(col, local["loss_mask"])) if "loss_mask" in local else (lambda col: col)
    lens = view["response_len"]
    mask = right_aligned_mask(lens)
    kl = ragged_to_right_aligned(view, "reward_kl", "cpu").double() if "reward_kl" in view else None
    rewards = token_rewards(local["reward"].double(), mask, kl, algo.kl_coef)
    if algo.advantage == "reinforce_pp":
        raw = discounted_returns(rewards, mask, algo.gamma)
    else:
        values = ragged_to_right_aligned(view, "old_values", "cpu").double()
        raw, returns = gae_advantages(rewards, values, mask, algo.gamma, algo.lam)
        local["returns"] = widen(to_ragged(returns, lens))
    local["raw_advantage"] = widen(to_ragged(raw, lens))
    _, local["token_mean"], local["token_m2"] = token_moments(raw, mask)


def gather_rows(local: Batch, failures: dict[str, int] | None = None) -> tuple[Batch, dict[str, int]]:
    """The all-ranks view: every rank's per-sample scalars (a Batch ordered by sample_index, so a sample's
    sample_index is its row), and the step's reward failures (sampling.sample's, by entry) summed over ranks (they
    ride along: no all-reduce of their own). dist.all_gather_tensors: no pickling."""
    names = sorted(failures or {})  # the same on every rank: the config's entries
    cols = ["sample_index", "group", "reward", "reward_failed", "response_len", "finished", "version"]
    mine = {c: local[c] for c in cols}
    mine["total_len"] = local["tokens"].lengths
    for c in ("kl_sum", "token_mean", "token_m2", "vision_tokens", "sampled_len", "turns", "tool_calls", "tool_errors",
              "cut_calls", "segment", "history_breaks"):
        if c in local:
            mine[c] = local[c]
    parts = dist.all_gather_tensors({**{k: v.cpu() for k, v in mine.items()},
                                     "failures": torch.tensor([failures[n] for n in names], dtype=torch.long)})
    total = sum(p.pop("failures") for p in parts)
    merged = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    everyone = Batch(merged).select(torch.argsort(merged["sample_index"]))
    # rollout.agent's indices leave room for split trajectories: number the step's rows 0..N-1 in their order
    # (a no-op for dense indices), here and in `local`, so that an index is a row of `everyone` from now on
    local["sample_index"] = torch.searchsorted(everyone["sample_index"], local["sample_index"])
    everyone["sample_index"] = torch.arange(len(everyone["sample_index"]), dtype=torch.long)
    return everyone, dict(zip(names, total.tolist()))


def add_advantages(trainer: Trainer, local: Batch, everyone: Batch) -> dict:
    """Advantages of every sample (everyone, local) and, for reinforce_pp and gae, of every token of this rank's
    rows (token_advantage); returns the whitening statistics as metrics."""
    algo = trainer.cfg.algo
    if algo.advantage in TOKEN_ADVANTAGES:
        return whiten_token_advantages(trainer, local, everyone)
    rewards = everyone["reward"].double()
    if "kl_sum" in everyone:
        rewards = rewards - algo.kl_coef * everyone["kl_sum"].double()
    masked = masked_rows(trainer.cfg, everyone)
    adv = compute_advantages(algo.advantage, rewards, everyone["group"], None if masked is None else ~masked,
                             **advantage_settings(trainer.cfg, everyone)).float()
    everyone["advantage"] = adv
    local["advantage"] = adv[local["sample_index"]]  # sample_index is the position in `everyone`
    return {}


def whiten_token_advantages(trainer: Trainer, local: Batch, everyone: Batch) -> dict:
    """Whiten the raw per-token advantages with the mean and variance over all response tokens of the step (masked
    samples left out), pooled from every sample's moments in sample order: the same bits on every rank and any
    layout. A sample's `advantage` is then the mean of its tokens' (for metrics and the idle-step check)."""
    masked = masked_rows(trainer.cfg, everyone)
    count = counted_lengths(trainer.cfg, everyone).double()
    zero = torch.zeros((), dtype=torch.float64)
    mean, var = pooled_moments(count, everyone["token_mean"], torch.where(count > 0, everyone["token_m2"], zero))
    scale = (var + 1e-8) ** 0.5
    adv = torch.where(count > 0, (everyone["token_mean"] - mean) / scale, zero)
    everyone["advantage"] = adv.float()
    local["advantage"] = everyone["advantage"][local["sample_index"]]
    mask = right_aligned_mask(local["response_len"])
    if "loss_mask" in local:
        mask &= ragged_to_right_aligned(local, "loss_mask", "cpu")
    if masked is not None:
        mask &= ~masked[local["sample_index"]][:, None]
    token_adv = whiten(ragged_to_right_aligned(local, "raw_advantage", "cpu"), mask, mean, var)
    local["token_advantage"] = to_ragged(token_adv.float(), local["response_len"])
    return {"advantage/raw_token_mean": mean, "advantage/raw_token_std": var ** 0.5}


def plan_step(trainer: Trainer, everyone: Batch):
    """The step schedule from all-gathered lengths: every rank computes the same one, no coordinator. Under
    sequence parallelism its "ranks" are the groups of S ranks: a group's micro-batch is packed (no padding) and
    split S ways, so it holds S times a rank's token cap, and its cost counts attention (quadratic in length)."""
    cfg = trainer.cfg
    S, M = trainer.mesh.sp, trainer.mesh.replica  # M: the replica's ranks, sp x tp
    caps, weights = trainer.balance.schedule_caps(cfg), trainer.balance.update
    if M > 1:  # a replica is as fast and holds as much as its weakest rank; tensor parallelism splits no tokens
        caps = [S * min(caps[g:g + M]) for g in range(0, len(caps), M)] if isinstance(caps, list) else S * caps
        weights = None if weights is None else [min(weights[g:g + M]) for g in range(0, len(weights), M)]
    # the model's reduction cuts it: canonical under bitwise, by the config's cap alone (train.reduction)
    return reduction_of(trainer.model).schedule(everyone["total_len"].tolist(), world=dist.data_parallel()[1],
                         minibatches=cfg.algo.minibatches_per_step, token_cap=caps,
                         fixed_cap=S * cfg.train.token_cap_per_micro_batch,
                         groups=everyone["group"].tolist(), weights=weights,
                         min_rows=cfg.train.min_rows_per_micro_batch, inert=zero_gradient_rows(cfg, everyone),
                         extra=everyone["vision_tokens"].tolist() if "vision_tokens" in everyone else None,
                         packed=plan_of(trainer.model).sequence is not None,
                         quadratic_cost=attention_cost(trainer.model) if S > 1 else 0.0)


def attention_cost(model) -> float:
    """A token pair's attention work relative to a token's projections and MLP (~12 x hidden^2 multiply-adds per
    layer against ~hidden for each earlier token): what makes a long sample cost more than its length. A mixture of
    experts' token computes with its top-k experts only (planner.dims: its active parameters per layer)."""
    hidden = model.config.get_text_config().hidden_size
    dims = dims_from_config(model.config.to_dict()) if is_moe(model) else None
    return hidden / dims.active_layer_params if dims is not None else 1.0 / (12 * hidden)


def exchange(trainer: Trainer, local: Batch, schedule) -> tuple[Batch, list[list[list[int]]]]:
    """Move each sample to the ranks the schedule trains it on (every rank of its replica: the sp x tp ranks of a
    data-parallel index, consecutive). Returns the rank's rows and, per mini-batch, its micro-batches as positions
    into those rows."""
    S = dist.replica_size()
    owner = {}
    for mb in schedule.minibatches:
        for g, micros in enumerate(mb.per_rank):
            for m in micros:
                for row in m.rows:
                    owner[row] = g
    # rows nobody runs (zero gradient) are left out: they only count in the denominators, taken from `everyone`
    run_here = [i for i, s in enumerate(local["sample_index"].tolist()) if s in owner]
    copies = [i for i in run_here for _ in range(S)]
    if copies != list(range(len(local))):
        local = local.select(copies)
    batch = dist.exchange(local, [owner[int(s)] * S + j % S for j, s in enumerate(local["sample_index"].tolist())])
    pos = {int(s): i for i, s in enumerate(batch["sample_index"])}
    mine = dist.data_parallel()[0]
    micro = [[[pos[row] for row in m.rows] for m in mb.per_rank[mine]] for mb in schedule.minibatches]
    return batch, micro


def on_group_rows(trainer: Trainer, local: Batch, add, names: tuple[str, ...]) -> None:
    """add(trainer, rows) puts columns `names` on `rows`; under sequence or tensor parallelism the rows of every rank
    of the replica, since its ranks forward each micro-batch together (one exchange gathers them), of which each
    rank keeps its own."""
    S = dist.replica_size()
    if S == 1:
        add(trainer, local)
        return
    first = dist.rank() - dist.rank() % S
    rows = dist.exchange(local.select([i for i in range(len(local)) for _ in range(S)]),
                         [first + j % S for j in range(S * len(local))])
    add(trainer, rows)
    pos = {int(s): i for i, s in enumerate(rows["sample_index"])}
    mine = rows.select([pos[int(s)] for s in local["sample_index"]])
    for name in names:
        if name in mine:
            local[name] = mine[name]


def needs_old_logprobs(cfg: RunConfig) -> bool:
    # With one optimizer step per rollout the policy that sampled is the one being updated: ratio == 1
    # exactly, so old log-probs are the current ones detached and a whole forward pass is saved, unless an
    # objective needs them from the whole mini-batch before its update. old_policy=engine: the engine's are pi_old.
    algo = cfg.algo
    return algo.old_policy == "trainer" and (algo.minibatches_per_step > 1 or algo.epochs_per_step > 1
                                             or needs_pooling(cfg))


def update(trainer: Trainer, step: int, batch: Batch, micro: list[list[list[int]]], denoms: list,
           pooled: list) -> dict:
    cfg, algo = trainer.cfg, trainer.cfg.algo
    stat_names = policy_stat_names(cfg)
    busy = trainer.balance.busy if trainer.balance.measured else None  # parallel.capacity_weights set: timed

    totals: dict[str, float] = {}
    updates = 0
    experts = moe.Experts(cfg, trainer.model, trainer.pad_id) if is_moe(trainer.model) else None
    for epoch in range(algo.epochs_per_step):
        for i, (rows, denom, common) in enumerate(zip(micro, denoms, pooled)):
            seed = keyed_seed("evenrl-update", cfg.train.seed, step, epoch, i)  # an exact reduction: dropout seeds
            policy, critic = trainer.policy, trainer.critic
            stats = minibatch_update(policy.model, policy.optimizer, policy.lr_scheduler, batch, rows, denom,
                                     forward=functools.partial(response_logprobs, pad_token_id=trainer.pad_id,
                                                               temperature=trainer.temperature, entropy=True,
                                                               entropy_grad=algo.entropy_coef > 0),
                                     loss_fn=functools.partial(rl_objective, cfg, step, pooled=common),
                                     stat_names=stat_names, aggregation=algo.loss_aggregation,
                                     max_grad_norm=cfg.train.max_grad_norm, pad_token_id=trainer.pad_id, busy=busy,
                                     experts=experts, seed=seed, reduction=reduction_of(policy.model))
            if critic is not None:  # same rows, same global denominators: exact on any layout too
                with routing.options(critic.model, replay=False):  # the policy's routes are not the critic's
                    values = minibatch_update(critic.model, critic.optimizer, critic.lr_scheduler, batch, rows,
                                              denom, forward=functools.partial(response_logits,
                                                                               pad_token_id=trainer.pad_id),
                                              loss_fn=functools.partial(value_objective, cfg),
                                              stat_names=CRITIC_STAT_NAMES, aggregation=algo.loss_aggregation,
                                              max_grad_norm=cfg.train.max_grad_norm, pad_token_id=trainer.pad_id,
                                              busy=busy, seed=seed, reduction=reduction_of(critic.model))
                stats.update({k if k.startswith("critic/") else f"critic/{k}": v for k, v in values.items()})
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            updates += 1
    means = {k: v / updates for k, v in totals.items()}  # mean over the step's optimizer steps
    return means if experts is None else {**means, **experts.metrics()}


def weights_hash(trainer: Trainer, step: int) -> str:
    """The trained weights' layout-free hash (distributed.exact.weights_hash: the policy's, then the critic's),
    checked to be the same on every training rank."""
    params = [p for m, _ in trainer.trained().values() for p in m.parameters() if p.requires_grad]
    value = exact.weights_hash(params)
    if not exact.group_agrees(value):
        raise RunStopped(f"the training ranks' weights differ after step {step} (train.reproducibility=bitwise: "
                         "every rank must hold the same bits); this is a bug, please report it")
    return value


def bitwise(cfg: RunConfig) -> bool:
    return cfg.train.reproducibility == "bitwise"


# ------------------------------------------------------------------------------------------ small helpers

def singles(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


def capped_runs(lengths: list[int], cap: int) -> list[list[int]]:
    """Consecutive rows in micro-batches of at most `cap` padded tokens (rows x longest), at least one row each:
    for forwards without gradients on a rank's own rows, where no schedule exists yet."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > cap:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return out + [cur] if cur else out


def right_aligned_mask(response_len: torch.Tensor) -> torch.Tensor:
    """[N, R] True on each row's response tokens, right-aligned (R = the longest response)."""
    width = int(response_len.max()) if len(response_len) else 0
    return torch.arange(width)[None, :] >= (width - response_len)[:, None]


def to_ragged(x: torch.Tensor, response_len: torch.Tensor) -> Ragged:
    """[N, R] right-aligned rows back to a pad-free token column (float32)."""
    width = x.shape[1]
    return Ragged.of([x[i, width - int(n):] for i, n in enumerate(response_len.tolist())], torch.float32)


def flat(micro: list[list[list[int]]]) -> list[list[int]]:
    return [rows for mb in micro for rows in mb]


def example_rows(local: Batch, k: int = 4) -> list[dict]:
    """A few of this rank's completions for samples.jsonl."""
    return [{"row_id": local["row_id"][i], "completion": local["completion"][i],
             "reward": float(local["reward"][i])} for i in range(min(k, len(local)))]
