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
import time
from typing import TYPE_CHECKING

import torch

from evenrl.config import RunConfig
from evenrl.core.advantages import (TOKEN_ADVANTAGES, compute_advantages, discounted_returns, gae_advantages,
                                    pooled_moments, token_moments, token_rewards, whiten)
from evenrl.core.batch import Batch, Ragged
from evenrl.core.losses import (LossInputs, LossSettings, entropy_from_logits, kl_penalty, rl_loss, token_logprobs,
                                value_loss)
from evenrl.core.schedule import make_schedule, rollout_shares
from evenrl.core.staleness import policy_version, pushes_at
from evenrl.distributed import collectives as dist
from evenrl.distributed.weights import full_weights
from evenrl.engines import SamplingParams
from evenrl.errors import RunStopped
from evenrl.models.forward import ragged_to_right_aligned
from evenrl.models.loading import is_sharded
from evenrl.rewards import score_all
from evenrl.rewards.overlong import overlong_penalty
from evenrl.train import checkpoint
from evenrl.train.update import compute_logprobs, compute_values, minibatch_denominators, minibatch_update

if TYPE_CHECKING:
    from evenrl.train.loop import Run

STAT_NAMES = ["policy/loss", "policy/clip_fraction", "policy/approx_kl", "kl", "entropy",
              "rollout/logprob_mismatch", "rollout/mismatch_fraction"]
IS_STAT_NAMES = ["policy/is_weight", "policy/is_clipped_fraction"]  # with importance weights (importance_correction)
# A sampled token whose engine and trainer log-probs differ by more than this counts in rollout/mismatch_fraction.
MISMATCH_THRESHOLD = 0.1
CRITIC_STAT_NAMES = ["critic/loss", "critic/clip_fraction", "critic/values"]


# ------------------------------------------------------------------------------------------ the step

def rl_step(step: int, run: "Run") -> tuple[dict, list[dict]]:
    """One RL step on this rank; returns the step's global metrics and a few of this rank's completions."""
    cfg, timer = run.cfg, Timer(step)
    if dist.rollout_ranks() or run.engine.needs_weights:
        with timer("weights"):
            push_weights(run, step)                                             # the engine samples from these
    local, failures, sampling = sample(run, step, timer)                    # rollout + rewards: this rank's rows
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "reward":
        with timer("logprobs"):
            add_reward_kl(run, local)
    if run.critic is not None:
        with timer("values"):
            add_values(run, local)                                              # the critic at sampling time
    with timer("advantage"):
        add_token_returns(run, local)                                           # reinforce_pp, gae: before whitening
        everyone, failures = gather_rows(local, failures)                       # per-sample numbers of all ranks
        adv_stats = add_advantages(run, local, everyone)
    with timer("exchange"):
        schedule = plan_step(run, everyone)
        batch, micro = exchange(run, local, schedule)                           # rows this rank trains on
        lens = counted_lengths(cfg, everyone)                                   # 0 for masked samples
        denoms = [minibatch_denominators(lens, mb.rows) for mb in schedule.minibatches]
    with timer("logprobs"):
        if cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "loss":
            add_logprobs(run, batch, "ref_logp", run.reference, flat(micro))
        if needs_old_logprobs(cfg):
            add_logprobs(run, batch, "old_logp", run.model, flat(micro))
    with timer("update"):
        stats = update(run, step, batch, micro, denoms)

    metrics = step_metrics(run, everyone, schedule, {**stats, **adv_stats, **sampling}, failures, timer)
    return metrics, example_rows(local)


# ------------------------------------------------------------------------------------------ named pieces

def push_weights(run: "Run", step: int) -> None:
    """Weights into an engine that keeps its own copy, bucket by bucket (full_weights all-gathers a sharded model,
    so every trainer iterates it). Colocated: the current weights into this rank's engine before each rollout.
    Reserved rollout ranks: trainer 0 broadcasts the versions due at this step (evenrl.core.staleness.pushes_at):
    the current weights, which sample step + max_staleness, and right after a resume the earlier versions the
    checkpoint kept for the steps that were in flight. A pushed version that a later checkpoint must carry is also
    written to disk (checkpoint.save_version) as it goes out."""
    if not dist.rollout_ranks():
        run.engine.wake()
        run.engine.update_weights(full_weights(run.model, dtype=run.model_dtype))
        return
    cfg, k = run.cfg, run.cfg.rollout.max_staleness
    pushed = [policy_version(u, k) for u in pushes_at(step, run.start, cfg.train.steps, k)]
    # a version due after the last step is not sent, but a checkpoint may still need it (a longer run resumes)
    kept_only = [step - 1] if step - 1 in run.versions_to_keep and step - 1 not in pushed else []
    for version in pushed + kept_only:
        if version == step - 1:
            buckets = full_weights(run.model, dtype=run.model_dtype)            # a collective on a sharded model
        elif dist.is_main():
            buckets = checkpoint.read_version(run.resumed_from, version)
        else:
            continue
        if version in pushed:  # running ahead: sent in the background, from a copy (dist.WeightSender)
            buckets = run.sender.send(buckets) if run.sender is not None else dist.push_weights(buckets)
        if dist.is_main() and version in run.versions_to_keep:
            checkpoint.save_version(run.ckpt_root, version, buckets)
        else:
            for _ in buckets:
                pass


def load_pushed(run: "Run", buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
    """A rollout rank takes a pushed version: vLLM is fed it; the hf engine samples from this rank's own copy of
    the model, which is overwritten."""
    if run.engine.needs_weights:
        run.engine.wake()
        run.engine.update_weights(buckets)
        return
    state = run.model.state_dict(keep_vars=True)
    with torch.no_grad():
        for bucket in buckets:
            for name, t in bucket:
                state[name].copy_(t)


def serve_rollout(run: "Run", step: int, prompt_ids: list[int]) -> None:
    """A reserved rollout rank's step, with the weights of policy_version(step) loaded: its replica's share of the
    samples, the step's prompts balanced over the replicas by cost, sent to the trainers without waiting for them
    (each trainer gets the samples it starts from, as in a colocated step). A sample's key is what it is on any
    layout, so the samples equal the colocated ones."""
    cfg = run.cfg
    n, replicas = cfg.rollout.samples_per_prompt, dist.rollout_ranks()
    costs = [len(run.prompt_tokens[i]) + cfg.rollout.max_new_tokens for i in prompt_ids]
    mine = rollout_shares(costs, n, len(replicas), None)[replicas.index(dist.rank())]
    dist.mark(f"step {step} generate (rollout rank)")
    completions = run.engine.generate([run.prompt_tokens[prompt_ids[p]] for p, _, _ in mine],
                                      [p for p, _, _ in mine], sampling_params(cfg), step=step,
                                      sample_ranges=[(first, count) for _, first, count in mine])
    run.engine.sleep()
    made = {(c.prompt_key, c.sample_index): c for samples in completions for c in samples}
    shares = rollout_shares(costs, n, dist.world(), cfg.parallel.capacity_weights)
    dist.send_rollouts(step, policy_version(step, cfg.rollout.max_staleness),
                       [[made[(p, i)] for p, first, count in share for i in range(first, first + count)
                         if (p, i) in made] for share in shares])


def sampling_params(cfg: RunConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                          samples_per_prompt=r.samples_per_prompt, seed=cfg.train.seed)



def sample(run: "Run", step: int, timer: "Timer") -> tuple[Batch, int, dict]:
    """Rollout and rewards for the step's prompts: (this rank's rows, its reward failures, sampling metrics).

    With algo.filter_groups (DAPO's dynamic sampling), groups whose rewards are all equal (no group advantage) are
    dropped and the prompts still missing are sampled in another round, until data.prompts_per_step groups are kept
    or algo.max_generation_rounds run out; then the step trains on what it kept. Prompts come from the rank-free
    sampler and a round's prompts take the next positions in the step, so every sample's key (step, position,
    sample) is unique and no rank count enters; kept groups are then renumbered in position order."""
    algo, want = run.cfg.algo, run.cfg.data.prompts_per_step
    parts, failures, drawn, kept, rounds = [], 0, 0, [], 0
    while True:
        prompt_ids = run.sampler.next_prompts(want - len(kept))                  # same on every rank
        with timer("rollout"):
            part = rollout(run, step, prompt_ids, first=drawn)                   # this rank's prompts x samples
        with timer("reward"):
            part, reward_stats = add_rewards(run, part)
        failures += reward_stats.get("failures", 0)
        drawn, rounds = drawn + len(prompt_ids), rounds + 1
        if not algo.filter_groups:
            return part, failures, {}
        with timer("reward"):
            part, informative = informative_groups(part)
        kept += informative
        parts.append(part)
        if len(kept) >= want or rounds >= algo.max_generation_rounds:
            break
    local = renumber_groups(Batch.concat(parts), kept, run.cfg.rollout.samples_per_prompt)
    return local, failures, {"sampling/rounds": rounds, "sampling/groups_drawn": drawn,
                             "sampling/kept_fraction": len(kept) / max(drawn, 1),
                             "sampling/groups_short": want - len(kept)}


def informative_groups(part: Batch) -> tuple[Batch, list[int]]:
    """(this rank's rows of the groups whose rewards are not all equal, the positions of all such groups on all
    ranks, ascending): a group's samples may be spread over ranks, so the decision is taken on every rank's
    rewards."""
    parts = dist.all_gather_tensors({"group": part["group"], "reward": part["reward"]})
    groups, rewards = torch.cat([p["group"] for p in parts]), torch.cat([p["reward"] for p in parts])
    informative = {g for g in set(groups.tolist()) if bool((rewards[groups == g] != rewards[groups == g][0]).any())}
    return part.select([i for i, g in enumerate(part["group"].tolist()) if g in informative]), sorted(informative)


def renumber_groups(local: Batch, kept: list[int], n: int) -> Batch:
    """This rank's rows with the kept groups (`kept`: their positions in the step, over all ranks, ascending)
    numbered 0..K-1, samples as group x n + sample: the all-ranks view is indexed by sample_index, so it must run
    without gaps, and every rank must number the same group alike."""
    new = {g: i for i, g in enumerate(kept)}
    local["group"] = torch.tensor([new[g] for g in local["group"].tolist()], dtype=torch.long)
    local["sample_index"] = local["group"] * n + local["sample_index"] % n
    return local


def rollout(run: "Run", step: int, prompt_ids: list[int], first: int = 0) -> Batch:
    """Generate this rank's share of the samples of `prompt_ids`, which take the step's positions first,
    first + 1, ... (rollout_shares): whole prompts where the ranks divide them, a prompt's samples split over ranks
    where they do not (2 prompts x 8 samples on 4 ranks: 4 samples each)."""
    cfg = run.cfg
    n = cfg.rollout.samples_per_prompt
    costs = [len(run.prompt_tokens[i]) + cfg.rollout.max_new_tokens for i in prompt_ids]
    mine = rollout_shares(costs, n, dist.world(), cfg.parallel.capacity_weights)[dist.rank()]
    version = step - 1  # the policy being trained sampled: colocated, or reserved with max_staleness 0
    if dist.rollout_ranks():  # the rollout ranks made every sample (serve_rollout): this rank's share comes in
        version = policy_version(step, cfg.rollout.max_staleness)
        parts = dist.receive_rollouts(step)
        if any(v != version for v, _ in parts):
            raise RunStopped(f"step {step}: rollout ranks sampled with policy versions {sorted({v for v, _ in parts})}"
                             f" where version {version} was due")
        made = {(c.prompt_key, c.sample_index): c for _, part in parts for c in part}
        completions = [[made[(first + p, s)] for s in range(a, a + count)] for p, a, count in mine]
    else:
        completions = run.engine.generate([run.prompt_tokens[prompt_ids[p]] for p, _, _ in mine],
                                          [first + p for p, _, _ in mine], sampling_params(cfg), step=step,
                                          sample_ranges=[(a, count) for _, a, count in mine])  # key: step position
        run.engine.sleep()  # vLLM on GPU: its KV cache is freed while the trainer needs the memory
    tokens, resp_len, index, group, row_ids, texts, finished, engine_lp = [], [], [], [], [], [], [], []
    for (p, _, _), samples in zip(mine, completions):
        prompt = run.prompt_tokens[prompt_ids[p]]
        for c in samples:
            tokens.append(torch.tensor(prompt + c.token_ids, dtype=torch.long))
            resp_len.append(len(c.token_ids))
            index.append((first + p) * n + c.sample_index)
            group.append(first + p)
            row_ids.append(prompt_ids[p])
            texts.append(run.tokenizer.decode(c.token_ids, skip_special_tokens=True))
            finished.append(c.finished)
            engine_lp.append(torch.tensor(c.logprobs, dtype=torch.float32))
    return Batch({
        "sample_index": torch.tensor(index, dtype=torch.long),
        "tokens": Ragged.of(tokens, torch.long),
        "response_len": torch.tensor(resp_len, dtype=torch.long),
        "group": torch.tensor(group, dtype=torch.long),
        "finished": torch.tensor(finished, dtype=torch.bool),
        "engine_logp": Ragged.of(engine_lp, torch.float32),
        "version": torch.full((len(index),), version, dtype=torch.long),  # the policy after step `version` sampled
        "row_id": row_ids,
        "completion": texts,
    })


def add_rewards(run: "Run", batch: Batch) -> tuple[Batch, dict]:
    rows, rc = [run.rows[r] for r in batch["row_id"]], run.cfg.rewards
    scores, stats = score_all(run.reward_fns, batch["completion"], rows, rc.timeout_s, isolate=rc.isolate,
                              memory_limit_mib=rc.memory_limit_mib, cpu_time_limit_s=rc.cpu_time_limit_s)
    batch["reward"] = torch.tensor(scores, dtype=torch.float32)
    if rc.overlong_buffer > 0:
        batch["reward"] = batch["reward"] + overlong_penalty(batch["response_len"], run.cfg.rollout.max_new_tokens,
                                                             rc.overlong_buffer, rc.overlong_penalty)
    batch["reward_failed"] = torch.tensor(stats["failed"], dtype=torch.bool)
    return batch, stats


def add_logprobs(run: "Run", batch: Batch, name: str, model, micro_rows: list[list[int]]) -> None:
    logps = compute_logprobs(model, batch, micro_rows, temperature=run.temperature, pad_token_id=run.pad_id)
    batch[name] = Ragged.of(logps, torch.float32)


def add_reward_kl(run: "Run", batch: Batch) -> None:
    """KL as a reward penalty, per token KL(policy || reference) at sampling time: summed per sequence for the
    group estimators (kl_sum), kept per token for reinforce_pp and gae (reward_kl), which fold it into each
    token's reward."""
    # one sample per forward; a sharded model makes as many forwards as the rank with the most samples
    passes = max(dist.all_gather_object(len(batch))) if is_sharded(run.model) else len(batch)
    micro = singles(len(batch)) + [[]] * (passes - len(batch))
    logp = compute_logprobs(run.model, batch, micro, temperature=run.temperature, pad_token_id=run.pad_id)
    ref = compute_logprobs(run.reference, batch, micro, temperature=run.temperature, pad_token_id=run.pad_id)
    kl = [kl_penalty(a, b, run.cfg.algo.kl_estimator) for a, b in zip(logp, ref)]
    if run.cfg.algo.advantage in TOKEN_ADVANTAGES:
        batch["reward_kl"] = Ragged.of(kl, torch.float32)
    else:
        batch["kl_sum"] = torch.stack([k.sum() for k in kl]).float() if kl else torch.zeros(0)


def add_values(run: "Run", batch: Batch) -> None:
    """The critic's value of every response token's state at sampling time: GAE's baseline and the value loss's
    clipping centre."""
    micro = capped_runs(batch["tokens"].lengths.tolist(), run.cfg.train.token_cap_per_micro_batch)
    if is_sharded(run.critic):  # every rank as many forwards as the busiest (empty ones are fillers)
        micro += [[]] * (max(dist.all_gather_object(len(micro))) - len(micro))
    values = compute_values(run.critic, batch, micro, pad_token_id=run.pad_id)
    batch["old_values"] = Ragged.of(values, torch.float32)


def add_token_returns(run: "Run", local: Batch) -> None:
    """reinforce_pp and gae, per token on this rank's rows: the outcome reward on the last token (minus the
    per-token KL with kl_in=reward), then discounted returns (reinforce_pp) or GAE with the critic's values and
    its value targets (gae); the per-sample moments of these raw advantages ride along in gather_rows so that
    add_advantages can whiten them over the whole step. Nothing to do for the group estimators."""
    algo = run.cfg.algo
    if algo.advantage not in TOKEN_ADVANTAGES:
        return
    mask = right_aligned_mask(local["response_len"])
    kl = ragged_to_right_aligned(local, "reward_kl", "cpu").double() if "reward_kl" in local else None
    rewards = token_rewards(local["reward"].double(), mask, kl, algo.kl_coef)
    if algo.advantage == "reinforce_pp":
        raw = discounted_returns(rewards, mask, algo.gamma)
    else:
        values = ragged_to_right_aligned(local, "old_values", "cpu").double()
        raw, returns = gae_advantages(rewards, values, mask, algo.gamma, algo.lam)
        local["returns"] = to_ragged(returns, local["response_len"])
    local["raw_advantage"] = to_ragged(raw, local["response_len"])
    _, local["token_mean"], local["token_m2"] = token_moments(raw, mask)


def gather_rows(local: Batch, failures: int = 0) -> tuple[Batch, int]:
    """The all-ranks view: every rank's per-sample scalars (a Batch ordered by sample_index, so a sample's
    sample_index is its row), and the step's reward failures summed over ranks (they ride along: no all-reduce of
    their own). dist.all_gather_tensors: no pickling."""
    cols = ["sample_index", "group", "reward", "reward_failed", "response_len", "finished", "version"]
    mine = {c: local[c] for c in cols}
    mine["total_len"] = local["tokens"].lengths
    for c in ("kl_sum", "token_mean", "token_m2"):
        if c in local:
            mine[c] = local[c]
    parts = dist.all_gather_tensors({**{k: v.cpu() for k, v in mine.items()},
                                     "failures": torch.tensor([int(failures)], dtype=torch.long)})
    total_failures = sum(int(p.pop("failures")) for p in parts)
    merged = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return Batch(merged).select(torch.argsort(merged["sample_index"])), total_failures


def add_advantages(run: "Run", local: Batch, everyone: Batch) -> dict:
    """Advantages of every sample (everyone, local) and, for reinforce_pp and gae, of every token of this rank's
    rows (token_advantage); returns the whitening statistics as metrics."""
    algo = run.cfg.algo
    if algo.advantage in TOKEN_ADVANTAGES:
        return whiten_token_advantages(run, local, everyone)
    rewards = everyone["reward"].double()
    if "kl_sum" in everyone:
        rewards = rewards - algo.kl_coef * everyone["kl_sum"].double()
    kw = {"std_scale": algo.std_scale} if algo.advantage == "grpo" else {}
    masked = masked_rows(run.cfg, everyone)
    adv = compute_advantages(algo.advantage, rewards, everyone["group"], None if masked is None else ~masked,
                             **kw).float()
    everyone["advantage"] = adv
    local["advantage"] = adv[local["sample_index"]]  # sample_index is the position in `everyone`
    return {}


def whiten_token_advantages(run: "Run", local: Batch, everyone: Batch) -> dict:
    """Whiten the raw per-token advantages with the mean and variance over all response tokens of the step (masked
    samples left out), pooled from every sample's moments in sample order: the same bits on every rank and any
    layout. A sample's `advantage` is then the mean of its tokens' (for metrics and the idle-step check)."""
    masked = masked_rows(run.cfg, everyone)
    count = counted_lengths(run.cfg, everyone).double()
    zero = torch.zeros((), dtype=torch.float64)
    mean, var = pooled_moments(count, everyone["token_mean"], torch.where(count > 0, everyone["token_m2"], zero))
    scale = (var + 1e-8) ** 0.5
    adv = torch.where(count > 0, (everyone["token_mean"] - mean) / scale, zero)
    everyone["advantage"] = adv.float()
    local["advantage"] = everyone["advantage"][local["sample_index"]]
    mask = right_aligned_mask(local["response_len"])
    if masked is not None:
        mask &= ~masked[local["sample_index"]][:, None]
    token_adv = whiten(ragged_to_right_aligned(local, "raw_advantage", "cpu"), mask, mean, var)
    local["token_advantage"] = to_ragged(token_adv.float(), local["response_len"])
    return {"advantage/raw_token_mean": mean, "advantage/raw_token_std": var ** 0.5}


def plan_step(run: "Run", everyone: Batch):
    """The step schedule from all-gathered lengths: every rank computes the same one, no coordinator."""
    cfg = run.cfg
    return make_schedule(everyone["total_len"].tolist(), world=dist.world(),
                         minibatches=cfg.algo.minibatches_per_step, token_cap=cfg.train.token_cap_per_micro_batch,
                         groups=everyone["group"].tolist(), weights=cfg.parallel.capacity_weights,
                         min_rows=cfg.train.min_rows_per_micro_batch, inert=zero_gradient_rows(cfg, everyone))


def zero_gradient_rows(cfg: RunConfig, everyone: Batch) -> list[bool] | None:
    """Samples whose loss gradient is exactly zero, so nobody needs to run them: samples masked out of learning
    (masked_rows: their loss is dropped), and, with no per-token KL or entropy term, samples with advantage 0 (the
    policy loss is advantage x f(ratio); a GRPO group with equal rewards, with 0/1 rewards every all-right and
    all-wrong group). None when nothing may be skipped: min_rows > 1 (the schedule cannot drop rows; masked rows
    then run and rl_objective zeroes their loss) or nothing to skip."""
    algo, train = cfg.algo, cfg.train
    if train.min_rows_per_micro_batch > 1:
        return None
    masked = masked_rows(cfg, everyone)
    kl_in_loss = algo.kl_coef > 0 and algo.kl_in == "loss"
    per_token = algo.advantage in TOKEN_ADVANTAGES  # a sample's mean token advantage of 0 is no zero gradient
    if not train.skip_zero_gradient_samples or kl_in_loss or algo.entropy_coef > 0 or per_token:
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
    """Response lengths as the loss denominators count them: 0 for a masked sample (no tokens, no sequence)."""
    masked = masked_rows(cfg, everyone)
    return everyone["response_len"] if masked is None else everyone["response_len"].masked_fill(masked, 0)


def exchange(run: "Run", local: Batch, schedule) -> tuple[Batch, list[list[list[int]]]]:
    """Move each sample to the rank the schedule trains it on. Returns the rank's rows and, per mini-batch,
    its micro-batches as positions into those rows."""
    owner = {}
    for mb in schedule.minibatches:
        for r, micros in enumerate(mb.per_rank):
            for m in micros:
                for row in m.rows:
                    owner[row] = r
    # rows nobody runs (zero gradient) are left out: they only count in the denominators, taken from `everyone`
    run_here = [i for i, s in enumerate(local["sample_index"].tolist()) if s in owner]
    if len(run_here) < len(local):
        local = local.select(run_here)
    batch = dist.exchange(local, [owner[int(i)] for i in local["sample_index"]])
    pos = {int(s): i for i, s in enumerate(batch["sample_index"])}
    micro = [[[pos[row] for row in m.rows] for m in mb.per_rank[dist.rank()]] for mb in schedule.minibatches]
    return batch, micro


def needs_old_logprobs(cfg: RunConfig) -> bool:
    # With one optimizer step per rollout the policy that sampled is the one being updated: ratio == 1
    # exactly, so old log-probs are the current ones detached and a whole forward pass is saved.
    return cfg.algo.minibatches_per_step > 1 or cfg.algo.epochs_per_step > 1


def update(run: "Run", step: int, batch: Batch, micro: list[list[list[int]]], denoms: list) -> dict:
    cfg, algo = run.cfg, run.cfg.algo
    stat_names = STAT_NAMES + (IS_STAT_NAMES if importance_weighted(cfg) else [])

    totals: dict[str, float] = {}
    updates = 0
    for _ in range(algo.epochs_per_step):
        for rows, denom in zip(micro, denoms):
            stats = minibatch_update(run.model, run.optimizer, run.lr_scheduler, batch, rows, denom,
                                     loss_fn=functools.partial(rl_objective, run, step),
                                     stat_names=stat_names, aggregation=algo.loss_aggregation,
                                     max_grad_norm=cfg.train.max_grad_norm, pad_token_id=run.pad_id)
            if run.critic is not None:  # same rows, same global denominators: exact on any layout too
                critic = minibatch_update(run.critic, run.critic_optimizer, run.critic_lr_scheduler, batch, rows,
                                          denom, loss_fn=functools.partial(value_objective, run),
                                          stat_names=CRITIC_STAT_NAMES, aggregation=algo.loss_aggregation,
                                          max_grad_norm=cfg.train.max_grad_norm, pad_token_id=run.pad_id)
                stats.update({k if k.startswith("critic/") else f"critic/{k}": v for k, v in critic.items()})
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            updates += 1
    return {k: v / updates for k, v in totals.items()}  # mean over the step's optimizer steps


def rl_objective(run: "Run", step: int, logits, targets, mask, mb: Batch):
    """A micro-batch's loss: its LossInputs from the logits and its columns, then the pure objective."""
    algo = run.cfg.algo
    keep, mask = kept_rows(run, mb, mask)
    logp = token_logprobs(logits, targets, run.temperature)
    with torch.set_grad_enabled(torch.is_grad_enabled() and algo.entropy_coef > 0):  # measured only: no graph
        entropy = entropy_from_logits(logits, run.temperature)
    adv = ragged_to_right_aligned(mb, "token_advantage", logp.device) if "token_advantage" in mb else mb["advantage"]
    old_logp = ragged_to_right_aligned(mb, "old_logp", logp.device) if "old_logp" in mb else logp.detach()
    engine_logp = ragged_to_right_aligned(mb, "engine_logp", logp.device)
    inputs = LossInputs(
        logp=logp, mask=mask, entropy=entropy, advantages=adv.to(logp.device), old_logp=old_logp,
        ref_logp=ragged_to_right_aligned(mb, "ref_logp", logp.device) if "ref_logp" in mb else None,
        behavior_logp=behavior_logprobs(run.cfg, step, mb, old_logp, engine_logp))
    per_token, stats = rl_loss(inputs, LossSettings(clip_low=algo.clip_low, clip_high=algo.clip_high,
                                                    entropy_coef=algo.entropy_coef,
                                                    kl_coef=algo.kl_coef if algo.kl_in == "loss" else 0.0,
                                                    kl_estimator=algo.kl_estimator,
                                                    importance_cap=algo.importance_cap))
    stats.update(logprob_mismatch(old_logp, engine_logp, mask))
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    return per_token, stats


def importance_weighted(cfg: RunConfig) -> bool:
    """Whether the policy-gradient term carries importance weights (algo.importance_correction): 'stale' only
    when some step can sample from an older policy (rollout.max_staleness >= 1); with max_staleness 0 the loss
    is then exactly the synchronous one."""
    mode = cfg.algo.importance_correction
    return mode == "all" or (mode == "stale" and cfg.rollout.max_staleness > 0)


def behavior_logprobs(cfg: RunConfig, step: int, mb: Batch, old_logp, engine_logp):
    """The log-probs the importance weight divides by, [B, R], or None for no weighting: the engine's where the
    sample is corrected, old_logp itself elsewhere (weight exp(0) = 1 exactly). 'stale' corrects the samples of
    an older policy than the one the step trains (version < step - 1)."""
    if not importance_weighted(cfg):
        return None
    if cfg.algo.importance_correction == "all":
        return engine_logp
    stale = (mb["version"] < step - 1).to(engine_logp.device)[:, None]
    return torch.where(stale, engine_logp, old_logp.detach())


def value_objective(run: "Run", logits, targets, mask, mb: Batch):
    """A micro-batch's critic loss: the value head's output at each response token's state (logits [B, R, 1])
    against the GAE targets, clipped around the values at sampling time."""
    keep, mask = kept_rows(run, mb, mask)
    values = logits.squeeze(-1).float()
    per_token, stats = value_loss(values, ragged_to_right_aligned(mb, "old_values", values.device),
                                  ragged_to_right_aligned(mb, "returns", values.device), mask,
                                  run.cfg.critic.value_clip)
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    return per_token, stats


def kept_rows(run: "Run", mb: Batch, mask):
    """(keep [B, 1] or None, mask without masked rows): masked rows run only when min_rows > 1 (else the schedule
    leaves them out); then their loss is zeroed here and they stay out of the stats."""
    masked = masked_rows(run.cfg, mb)
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


def step_metrics(run: "Run", everyone: Batch, schedule, stats: dict, failures: int, timer: "Timer") -> dict:
    rewards, lens = everyone["reward"].double(), everyone["response_len"].double()
    elapsed = max(sum(timer.seconds.values()), 1e-9)
    out = {
        "reward/mean": float(rewards.mean()) if len(rewards) else float("nan"),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "advantage/abs_mean": float(everyone["advantage"].abs().mean()) if len(rewards) else 0.0,
        "response/length_mean": float(lens.mean()) if len(lens) else 0.0,
        "response/finished_fraction": float(everyone["finished"].float().mean()) if len(lens) else 0.0,
        "samples": len(rewards),
        "perf/tokens_per_s": float(everyone["total_len"].sum()) / elapsed,
        "perf/samples_per_s": len(rewards) / elapsed,
        "lr": run.optimizer.param_groups[0]["lr"],
        "load/rank_tokens": [int(x) for x in schedule.rank_loads()],
        "load/micro_steps": sum(schedule.micro_steps()),
        # samples no rank ran because their gradient is exactly zero (train.skip_zero_gradient_samples)
        "load/skipped_samples": sum(len(mb.rows) for mb in schedule.minibatches) - sum(
            len(m.rows) for mb in schedule.minibatches for micros in mb.per_rank for m in micros),
    }
    if run.cfg.rollout.max_staleness > 0:  # steps between the sampling policy and the one trained
        staleness = (timer.step - 1 - everyone["version"]).tolist()
        out["rollout/staleness_mean"] = sum(staleness) / max(len(staleness), 1)
        out["rollout/staleness_hist"] = [staleness.count(d) for d in range(run.cfg.rollout.max_staleness + 1)]
    if run.cfg.rewards.overlong_buffer > 0:
        rc = run.cfg.rewards
        pen = overlong_penalty(everyone["response_len"], run.cfg.rollout.max_new_tokens, rc.overlong_buffer,
                               rc.overlong_penalty)
        out["reward/overlong_penalty_mean"] = float(pen.mean()) if len(pen) else 0.0
    out.update(stats)
    out.update({f"time/{k}": v for k, v in timer.seconds.items()})
    out.update({f"memory/{k}_peak_gib": v for k, v in timer.peak_gib.items()})  # empty without CUDA
    out["reward/failures"] = int(failures)  # summed over ranks by gather_rows
    masked = masked_rows(run.cfg, everyone)
    out["reward/masked_samples"] = 0 if masked is None else int(masked.sum())  # left out of learning
    return out


# ------------------------------------------------------------------------------------------ small helpers

class Timer:
    """Seconds per phase; entering a phase also tells the other ranks where this one is (dist.mark), so a failed
    collective can name the rank that stopped and the phase it stopped in."""

    def __init__(self, step: int):
        self.step = step
        self.seconds: dict[str, float] = {}
        # CUDA only: the most memory torch's allocator handed out within each phase (max_memory_allocated, reset as
        # the phase starts), the number `evenrl plan` estimates per phase; the CPU allocator keeps no such count
        self.peak_gib: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                dist.mark(f"step {timer.step} {name}")
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t
                if torch.cuda.is_available():
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    timer.peak_gib[name] = max(timer.peak_gib.get(name, 0.0), peak)

        return _Ctx()


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
