"""One GRPO-family RL step on this rank. It reads top to bottom in `rl_step`; each phase is a named function below.

One step: sample prompts -> rollout -> rewards -> advantages -> exchange to the planned ranks
-> old/reference log-probs when needed -> mini-batch updates -> metrics.

Why the result does not depend on the number of ranks:
  * the prompt order comes from (seed, epoch) only; each sample's randomness from (seed, step, prompt id, sample);
  * advantages are computed from the whole step's rewards on every rank;
  * mini-batch membership is fixed before ranks are considered (evenrl.core.schedule);
  * losses are divided by the mini-batch's global counts and gradients are summed (evenrl.train.update).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import torch

from evenrl.config import RunConfig
from evenrl.core.advantages import compute_advantages
from evenrl.core.batch import Batch, Ragged
from evenrl.core.losses import LossInputs, LossSettings, entropy_from_logits, kl_penalty, rl_loss, token_logprobs
from evenrl.core.schedule import make_schedule, rollout_shares
from evenrl.distributed import collectives as dist
from evenrl.distributed.weights import gathered
from evenrl.engines.hf import SamplingParams, generate
from evenrl.models.forward import ragged_to_right_aligned
from evenrl.models.loading import is_sharded
from evenrl.rewards import score_all
from evenrl.train.update import compute_logprobs, minibatch_denominators, minibatch_update

if TYPE_CHECKING:
    from evenrl.train.loop import Run

STAT_NAMES = ["policy/loss", "policy/clip_fraction", "policy/approx_kl", "kl", "entropy"]


# ------------------------------------------------------------------------------------------ the step

def rl_step(step: int, run: "Run") -> tuple[dict, list[dict]]:
    """One RL step on this rank; returns the step's global metrics and a few of this rank's completions."""
    cfg, timer = run.cfg, Timer(step)
    prompt_ids = run.sampler.next_prompts(cfg.data.prompts_per_step)           # same on every rank

    with timer("rollout"):
        local = rollout(run, step, prompt_ids)                                  # this rank's prompts x samples
    with timer("reward"):
        local, reward_stats = add_rewards(run, local)
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "reward":
        with timer("logprobs"):
            add_reward_kl(run, local)
    with timer("advantage"):
        everyone, failures = gather_rows(local, reward_stats.get("failures", 0))  # per-sample numbers of all ranks
        add_advantages(run, local, everyone)
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
        stats = update(run, batch, micro, denoms)

    metrics = step_metrics(run, everyone, schedule, stats, failures, timer)
    return metrics, example_rows(local)


# ------------------------------------------------------------------------------------------ named pieces

def rollout(run: "Run", step: int, prompt_ids: list[int]) -> Batch:
    """Generate this rank's share of the step's samples (rollout_shares): whole prompts where the ranks divide
    them, a prompt's samples split over ranks where they do not (2 prompts x 8 samples on 4 ranks: 4 samples each)."""
    cfg = run.cfg
    n = cfg.rollout.samples_per_prompt
    costs = [len(run.prompt_tokens[i]) + cfg.rollout.max_new_tokens for i in prompt_ids]
    mine = rollout_shares(costs, n, dist.world(), cfg.parallel.capacity_weights)[dist.rank()]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, samples_per_prompt=n, seed=cfg.train.seed)
    run.model.eval()
    with gathered(run.model):  # sharded: the whole model on every rank for this generation, freed after
        completions = generate(run.model, [run.prompt_tokens[prompt_ids[p]] for p, _, _ in mine],
                               [p for p, _, _ in mine], params, step=step,  # key = position in the step: rank-free
                               eos_token_ids=run.eos_ids, pad_token_id=run.pad_id,
                               sample_ranges=[(first, count) for _, first, count in mine]) if mine else []
    run.model.train()
    tokens, resp_len, index, group, row_ids, texts, finished = [], [], [], [], [], [], []
    for (p, _, _), samples in zip(mine, completions):
        prompt = run.prompt_tokens[prompt_ids[p]]
        for c in samples:
            tokens.append(torch.tensor(prompt + c.token_ids, dtype=torch.long))
            resp_len.append(len(c.token_ids))
            index.append(p * n + c.sample_index)
            group.append(p)
            row_ids.append(prompt_ids[p])
            texts.append(run.tokenizer.decode(c.token_ids, skip_special_tokens=True))
            finished.append(c.finished)
    return Batch({
        "sample_index": torch.tensor(index, dtype=torch.long),
        "tokens": Ragged.of(tokens, torch.long),
        "response_len": torch.tensor(resp_len, dtype=torch.long),
        "group": torch.tensor(group, dtype=torch.long),
        "finished": torch.tensor(finished, dtype=torch.bool),
        "row_id": row_ids,
        "completion": texts,
    })


def add_rewards(run: "Run", batch: Batch) -> tuple[Batch, dict]:
    rows, rc = [run.rows[r] for r in batch["row_id"]], run.cfg.rewards
    scores, stats = score_all(run.reward_fns, batch["completion"], rows, rc.timeout_s, isolate=rc.isolate,
                              memory_limit_mib=rc.memory_limit_mib, cpu_time_limit_s=rc.cpu_time_limit_s)
    batch["reward"] = torch.tensor(scores, dtype=torch.float32)
    batch["reward_failed"] = torch.tensor(stats["failed"], dtype=torch.bool)
    return batch, stats


def add_logprobs(run: "Run", batch: Batch, name: str, model, micro_rows: list[list[int]]) -> None:
    logps = compute_logprobs(model, batch, micro_rows, temperature=run.temperature, pad_token_id=run.pad_id)
    batch[name] = Ragged.of(logps, torch.float32)


def add_reward_kl(run: "Run", batch: Batch) -> None:
    """KL as a reward penalty: each sequence's summed per-token KL(policy || reference) at sampling time."""
    # one sample per forward; a sharded model makes as many forwards as the rank with the most samples
    passes = max(dist.all_gather_object(len(batch))) if is_sharded(run.model) else len(batch)
    micro = singles(len(batch)) + [[]] * (passes - len(batch))
    logp = compute_logprobs(run.model, batch, micro, temperature=run.temperature, pad_token_id=run.pad_id)
    ref = compute_logprobs(run.reference, batch, micro, temperature=run.temperature, pad_token_id=run.pad_id)
    kl = [kl_penalty(a, b, run.cfg.algo.kl_estimator).sum() for a, b in zip(logp, ref)]
    batch["kl_sum"] = torch.stack(kl).float() if kl else torch.zeros(0)


def gather_rows(local: Batch, failures: int = 0) -> tuple[Batch, int]:
    """The all-ranks view: every rank's per-sample scalars (a Batch ordered by sample_index, so a sample's
    sample_index is its row), and the step's reward failures summed over ranks (they ride along: no all-reduce of
    their own). dist.all_gather_tensors: no pickling."""
    cols = ["sample_index", "group", "reward", "reward_failed", "response_len", "finished"]
    mine = {c: local[c] for c in cols}
    mine["total_len"] = local["tokens"].lengths
    if "kl_sum" in local:
        mine["kl_sum"] = local["kl_sum"]
    parts = dist.all_gather_tensors({**{k: v.cpu() for k, v in mine.items()},
                                     "failures": torch.tensor([int(failures)], dtype=torch.long)})
    total_failures = sum(int(p.pop("failures")) for p in parts)
    merged = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return Batch(merged).select(torch.argsort(merged["sample_index"])), total_failures


def add_advantages(run: "Run", local: Batch, everyone: Batch) -> None:
    algo = run.cfg.algo
    rewards = everyone["reward"].double()
    if "kl_sum" in everyone:
        rewards = rewards - algo.kl_coef * everyone["kl_sum"].double()
    kw = {"std_scale": algo.std_scale} if algo.advantage == "grpo" else {}
    masked = masked_rows(run.cfg, everyone)
    adv = compute_advantages(algo.advantage, rewards, everyone["group"], None if masked is None else ~masked,
                             **kw).float()
    everyone["advantage"] = adv
    local["advantage"] = adv[local["sample_index"]]  # sample_index is the position in `everyone`


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
    if not train.skip_zero_gradient_samples or kl_in_loss or algo.entropy_coef > 0:
        return None if masked is None else masked.tolist()
    zero = everyone["advantage"] == 0
    return (zero if masked is None else zero | masked).tolist()


def masked_rows(cfg: RunConfig, everyone: Batch) -> torch.Tensor | None:
    """Samples left out of learning, [N] bool, or None for none: with rewards.on_failure=mask, those on which a
    reward call failed. They get no advantage and no place in their group's statistics (add_advantages), count in
    no loss denominator (counted_lengths) and run nowhere (zero_gradient_rows); mini-batch membership stays that of
    the whole step, so the update is the one a single device makes with their effect removed."""
    if cfg.rewards.on_failure != "mask" or not bool(everyone["reward_failed"].any()):
        return None
    return everyone["reward_failed"]


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


def update(run: "Run", batch: Batch, micro: list[list[list[int]]], denoms: list) -> dict:
    cfg, algo = run.cfg, run.cfg.algo

    totals: dict[str, float] = {}
    updates = 0
    for _ in range(algo.epochs_per_step):
        for rows, denom in zip(micro, denoms):
            stats = minibatch_update(run.model, run.optimizer, run.lr_scheduler, batch, rows, denom,
                                     loss_fn=functools.partial(rl_objective, run),
                                     stat_names=STAT_NAMES, aggregation=algo.loss_aggregation,
                                     max_grad_norm=cfg.train.max_grad_norm, pad_token_id=run.pad_id)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            updates += 1
    return {k: v / updates for k, v in totals.items()}  # mean over the step's optimizer steps


def rl_objective(run: "Run", logits, targets, mask, mb: Batch):
    """A micro-batch's loss: its LossInputs from the logits and its columns, then the pure objective."""
    algo = run.cfg.algo
    keep = None
    if run.cfg.rewards.on_failure == "mask" and bool(mb["reward_failed"].any()):  # only with min_rows > 1
        keep = ~mb["reward_failed"].to(mask.device)[:, None]  # masked rows: no loss, not in the stats
        mask = mask & keep
    logp = token_logprobs(logits, targets, run.temperature)
    with torch.set_grad_enabled(torch.is_grad_enabled() and algo.entropy_coef > 0):  # measured only: no graph
        entropy = entropy_from_logits(logits, run.temperature)
    inputs = LossInputs(
        logp=logp, mask=mask, entropy=entropy, advantages=mb["advantage"].to(logp.device),
        old_logp=ragged_to_right_aligned(mb, "old_logp", logp.device) if "old_logp" in mb else logp.detach(),
        ref_logp=ragged_to_right_aligned(mb, "ref_logp", logp.device) if "ref_logp" in mb else None)
    per_token, stats = rl_loss(inputs, LossSettings(clip_low=algo.clip_low, clip_high=algo.clip_high,
                                                    entropy_coef=algo.entropy_coef,
                                                    kl_coef=algo.kl_coef if algo.kl_in == "loss" else 0.0,
                                                    kl_estimator=algo.kl_estimator))
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    return per_token, stats


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
    out.update(stats)
    out.update({f"time/{k}": v for k, v in timer.seconds.items()})
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

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                dist.mark(f"step {timer.step} {name}")
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t

        return _Ctx()


def singles(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


def flat(micro: list[list[list[int]]]) -> list[list[int]]:
    return [rows for mb in micro for rows in mb]


def example_rows(local: Batch, k: int = 4) -> list[dict]:
    """A few of this rank's completions for samples.jsonl."""
    return [{"row_id": local["row_id"][i], "completion": local["completion"][i],
             "reward": float(local["reward"][i])} for i in range(min(k, len(local)))]
