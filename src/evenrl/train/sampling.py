"""The step's sampling phase on this rank: its share of the prompts' samples (evenrl.rollout.generate) and their
rewards; with algo.filter_groups in rounds until enough informative groups are kept (DAPO's dynamic sampling)."""

from __future__ import annotations

import torch

from evenrl.agents.rows import REPLY_SCORE_FAILED
from evenrl.core.batch import Batch
from evenrl.distributed import collectives as dist
from evenrl.errors import RunStopped
from evenrl.isolation.pool import backstop_hits
from evenrl.rewards import FAILURE_KINDS, score_all
from evenrl.rewards.overlong import overlong_penalty
from evenrl.rollout.generate import index_stride, rollout
from evenrl.rollout.trajectories import overlong_lengths
from evenrl.train.metrics import BACKSTOP, Timer
from evenrl.train.reward_models import add_model_rewards
from evenrl.train.trainer import Trainer


def sample(trainer: Trainer, step: int, timer: Timer) -> tuple[Batch, dict[str, int], dict]:
    """Rollout and rewards for the step's prompts: (this rank's rows, its reward failures (key "": samples whose
    reward failed; an entry's name: its failed calls), sampling metrics and each failing entry's first error
    ("reward/first_error/NAME", this rank's)).

    With algo.filter_groups (DAPO's dynamic sampling), groups whose rewards are all equal (no group advantage) are
    dropped and the prompts still missing are sampled in another round, until data.prompts_per_step groups are kept
    or algo.max_generation_rounds run out; then the step trains on what it kept. Prompts come from the rank-free
    sampler and a round's prompts take the next positions in the step, so every sample's key (step, position,
    sample) is unique and no rank count enters; kept groups are then renumbered in position order."""
    algo, want = trainer.cfg.algo, trainer.cfg.data.prompts_per_step
    parts, failures, errors, drawn, kept, rounds = [], {}, {}, 0, [], 0
    while True:
        prompt_ids = trainer.sampler.next_prompts(want - len(kept))                  # same on every rank
        with timer("rollout"):
            part = rollout(trainer, step, prompt_ids, first=drawn)                   # this rank's prompts x samples
        with timer("reward"):
            part, reward_stats = add_rewards(trainer, part, step)
        count_failures(reward_stats, failures, errors)
        drawn, rounds = drawn + len(prompt_ids), rounds + 1
        if not algo.filter_groups:
            return part, failures, {**errors, **(trainer.carry.metrics if trainer.carry else {})}
        with timer("reward"):
            part, informative = informative_groups(part)
        kept += informative
        parts.append(part)
        if len(kept) >= want or rounds >= algo.max_generation_rounds:
            break
    local = renumber_groups(Batch.concat(parts), kept, trainer.cfg.rollout.samples_per_prompt,
                            index_stride(trainer.cfg))
    return local, failures, {"sampling/rounds": rounds, "sampling/groups_drawn": drawn,
                             "sampling/kept_fraction": len(kept) / max(drawn, 1),
                             "sampling/groups_short": want - len(kept), **errors,
                             **(trainer.carry.metrics if trainer.carry else {})}


def stop_if_all_failed_alike(trainer: Trainer, local: Batch, everyone: Batch) -> None:
    """rollout.env / rollout.agent: when every trajectory of the step failed, all the same way (an agent that cannot
    be loaded in a worker process, an environment that raises on every row), the steps after would fail alike and
    learn nothing: the run stops with that one line (RunStopped, exit 3) rather than scoring every sample 0 to the
    end. Not a failure the wall clock decided (timeout: it depends on the machine's load), nor rewards.functions
    failing on agents' replies (a reward's failures are warned about, as for single-turn samples). Every rank
    decides alike: `everyone` is the same on each, and the ranks' errors are gathered only in such a step."""
    if trainer.turns is None or not len(everyone) or not bool(everyone["reward_failed"].all()):
        return
    errors = {e for part in dist.all_gather_object(sorted({e for e in local["error"] if e})) for e in part}
    if len(errors) != 1 or next(iter(errors)).startswith("timeout:") or REPLY_SCORE_FAILED in errors:
        return
    r = trainer.cfg.rollout
    raise RunStopped(f"{f'rollout.agent {r.agent}' if r.agent else f'rollout.env {r.env}'}: all {len(everyone)} "
                     f"trajectories of the step failed the same way: {next(iter(errors))}")


def count_failures(stats: dict, failures: dict[str, int], errors: dict[str, str]) -> None:
    """Add a reward phase's failures to `failures` ("": samples, NAME: that entry's failed calls; every entry is
    counted, 0 or not, so every rank has the same keys; BACKSTOP: this process's calls, of rewards, environment
    steps and agents alike, that the wall clock ended since the last count) and each entry's first error to
    `errors`."""
    failures[""] = failures.get("", 0) + int(stats.get("failures", 0))
    failures[BACKSTOP] = failures.get(BACKSTOP, 0) + backstop_hits()
    for name, entry in stats.get("by_reward", {}).items():
        failures[name] = failures.get(name, 0) + sum(int(entry.get(kind, 0)) for kind in FAILURE_KINDS)
        if entry.get("first_error"):
            errors.setdefault(f"reward/first_error/{name}", entry["first_error"])


def informative_groups(part: Batch) -> tuple[Batch, list[int]]:
    """(this rank's rows of the groups whose rewards are not all equal, the positions of all such groups on all
    ranks, ascending): a group's samples may be spread over ranks, so the decision is taken on every rank's
    rewards."""
    parts = dist.all_gather_tensors({"group": part["group"], "reward": part["reward"]})
    groups, rewards = torch.cat([p["group"] for p in parts]), torch.cat([p["reward"] for p in parts])
    informative = {g for g in set(groups.tolist()) if bool((rewards[groups == g] != rewards[groups == g][0]).any())}
    return part.select([i for i, g in enumerate(part["group"].tolist()) if g in informative]), sorted(informative)


def renumber_groups(local: Batch, kept: list[int], n: int, stride: int = 1) -> Batch:
    """This rank's rows with the kept groups (`kept`: their positions in the step, over all ranks, ascending)
    numbered 0..K-1, samples as group x n + sample: the all-ranks view is indexed by sample_index, so it must run
    without gaps, and every rank must number the same group alike."""
    new = {g: i for i, g in enumerate(kept)}
    local["group"] = torch.tensor([new[g] for g in local["group"].tolist()], dtype=torch.long)
    local["sample_index"] = local["group"] * n * stride + local["sample_index"] % (n * stride)
    return local


def add_rewards(trainer: Trainer, batch: Batch, step: int) -> tuple[Batch, dict]:
    """Rewards of this rank's samples (functions, then reward models and judges); trajectories come scored by their
    environment (rollout), and DAPO's overlong penalty weighs their sampled tokens against the most they could
    sample."""
    rc = trainer.cfg.rewards
    if trainer.turns is None:
        rows = [trainer.prompts.rows[r] for r in batch["row_id"]]
        scores, stats = score_all(trainer.reward_fns, batch["completion"], rows, rc.timeout_s, isolate=rc.isolate,
                                  memory_limit_mib=rc.memory_limit_mib, cpu_time_limit_s=rc.cpu_time_limit_s, sandbox=rc.sandbox)
        if trainer.scorers:  # reward models and judges: every training rank, rows or not (collectives when sharded)
            scores, stats = add_model_rewards(trainer.scorers, trainer.cfg, batch["completion"], rows,
                                              batch["sample_index"].tolist(), step, scores, stats)
        batch["reward"] = torch.tensor(scores, dtype=torch.float32)
        batch["reward_failed"] = torch.tensor(stats["failed"], dtype=torch.bool)
    else:
        stats = {"failures": int(batch["reward_failed"].sum())}
    if rc.overlong_buffer > 0:
        length, most = overlong_lengths(trainer.cfg, batch)
        batch["reward"] = batch["reward"] + overlong_penalty(length, most, rc.overlong_buffer, rc.overlong_penalty)
    return batch, stats
