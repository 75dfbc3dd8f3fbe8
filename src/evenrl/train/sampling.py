"""The step's sampling phase on this rank: its share of the prompts' samples (generated here, received from reserved
rollout ranks, or whole multi-turn trajectories), with a vision-language model's image columns, and their rewards;
with algo.filter_groups in rounds until enough informative groups are kept (DAPO's dynamic sampling)."""

from __future__ import annotations

import torch

from evenrl.agents.rows import REPLY_SCORE_FAILED
from evenrl.core.batch import Batch, Ragged
from evenrl.core.canonical import unit_batches
from evenrl.core.staleness import policy_version
from evenrl.distributed import collectives as dist
from evenrl.engines.base import Request, sampling_params
from evenrl.errors import RunStopped
from evenrl.isolation.pool import backstop_hits
from evenrl.models.routing import routing
from evenrl.models.vision import pixel_dim, prompt_image_inputs
from evenrl.rewards import FAILURE_KINDS, score_all
from evenrl.rewards.overlong import overlong_penalty
from evenrl.train.carry import carried_rows
from evenrl.train.metrics import BACKSTOP, Timer
from evenrl.train.reward_models import add_model_rewards
from evenrl.train.trainer import Trainer
from evenrl.train.trajectories import overlong_lengths, trajectory_columns


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


def index_stride(cfg) -> int:
    """Sample indices per (prompt, sample): 1, or with rollout.agent room for the samples a trajectory is split into
    (at most one per call). Indices are then sparse until step.gather_rows numbers the step's rows 0..N-1."""
    return cfg.rollout.agent_max_calls if cfg.rollout.agent else 1


def rollout(trainer: Trainer, step: int, prompt_ids: list[int], first: int = 0) -> Batch:
    """Generate this rank's share of the samples of `prompt_ids`, which take the step's positions first,
    first + 1, ... (rollout_shares): whole prompts where the ranks divide them, a prompt's samples split over ranks
    where they do not (2 prompts x 8 samples on 4 ranks: 4 samples each). With rollout.partial the rows are the
    groups that are complete in this step, whenever their prompts were drawn (evenrl.train.carry)."""
    cfg = trainer.cfg
    if trainer.carry is not None:
        return carried_rows(trainer, step, prompt_ids)
    n = cfg.rollout.samples_per_prompt
    costs = [len(trainer.prompts.tokens[i]) + cfg.response_tokens() for i in prompt_ids]
    # a tensor-parallel group samples from its split model together and one rank keeps the rows; an engine with its
    # own copy (vLLM) serves every trainer on its own (an engine over several trainers gathers their requests)
    split = trainer.engine is None or not trainer.engine.needs_weights
    unit, units, keeps = dist.rollout_unit(split)
    batches = unit_batches(cfg, costs, units, dist.unit_weights(trainer.balance.rollout, split))
    mine = [x for b in batches[unit] for x in b]
    ids = [prompt_ids[p] for p, _, _ in mine]
    images = prompt_image_inputs(trainer.image_processor, trainer.prompts.images, ids)
    version = step - 1  # the policy being trained sampled: colocated, or reserved with max_staleness 0
    if dist.rollout_ranks():  # the rollout ranks made every sample (rollout_rank): this rank's share comes in
        version = policy_version(step, cfg.rollout.max_staleness)
        parts = dist.receive_rollouts(step)
        if any(v != version for v, _ in parts):
            raise RunStopped(f"step {step}: rollout ranks sampled with policy versions {sorted({v for v, _ in parts})}"
                             f" where version {version} was due")
        made = {(c.prompt_key, c.sample_index): c for _, part in parts for c in part}
        mine = mine if keeps else []  # the rollout ranks sent this unit's samples to its first rank
        completions = [[made[(first + p, s)] for s in range(a, a + count)] for p, a, count in mine]
    else:
        completions, at = [], 0
        # every rank as many engine calls as the unit with the most batches: with FSDP2 a call gathers the model
        for b in batches[unit] + [[]] * (max(len(x) for x in batches) - len(batches[unit])):
            part = slice(at, at + len(b))
            completions += generate_batch(cfg, trainer.engine, trainer.turns, trainer.prompts, step, b, ids[part],
                                          first, None if images is None else images[part])
            at += len(b)
        trainer.engine.sleep()  # vLLM on GPU: its KV cache is freed while the trainer needs the memory
        if not keeps:  # this unit's samples are its first rank's: the step holds one copy of each
            mine, completions = [], []
    tokens, resp_len, index, group, row_ids, texts, finished, engine_lp = [], [], [], [], [], [], [], []
    routes = []  # rollout.router_replay=engine: each sample's routes, as the engine recorded them
    image_rows = []  # per sample, its prompt's ImageInputs (None: a text prompt)
    stride = index_stride(cfg)
    completions = [[part for c in samples for part in (c, *getattr(c, "splits", ()))] for samples in completions]
    for i, ((p, _, _), samples) in enumerate(zip(mine, completions)):
        image_rows += [images[i] if images is not None else None] * len(samples)
        for c in samples:
            prompt = trainer.prompts.tokens[prompt_ids[p]] if getattr(c, "prompt_ids", None) is None else c.prompt_ids
            tokens.append(torch.tensor(prompt + c.token_ids, dtype=torch.long))
            resp_len.append(len(c.token_ids))
            index.append(((first + p) * n + c.sample_index) * stride + getattr(c, "segment", 0))
            group.append(first + p)
            row_ids.append(prompt_ids[p])
            # a trajectory's text keeps its turn markers (samples.jsonl shows the whole conversation)
            texts.append(trainer.tokenizer.decode(c.token_ids, skip_special_tokens=trainer.turns is None))
            finished.append(c.finished)
            engine_lp.append(torch.tensor(c.logprobs, dtype=torch.float32))
            routes.append(c.routes)
    batch = Batch({
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
    if cfg.rollout.router_replay == "engine":  # every rank carries the column, some with no rows
        batch["routes"] = engine_routes(routes, trainer.model)
    if images is not None:  # a vision-language model: every rank carries the image columns, some rows empty
        add_image_columns(batch, image_rows, trainer.vision_weight, pixel_dim(trainer.image_processor))
    if trainer.turns is not None:
        for name, col in trajectory_columns([c for samples in completions for c in samples]).items():
            batch[name] = col
    return batch


def generate_batch(cfg, engine, turns, prompts, step: int, batch: list[tuple[int, int, int]], ids: list[int],
                   first: int, images) -> list:
    """One engine call: the samples of `batch` ((prompt position, first sample, count); `ids` their rows of
    `prompts`, a evenrl.train.trainer.Prompts; a prompt's key is `first` + its position), or with rollout.env /
    rollout.agent (`turns`) their whole trajectories, the environments stepped in between. `images`: per prompt its
    ImageInputs or None (a vision-language model), or None."""
    requests = [Request(prompts.tokens[i], first + p, step, range(a, a + count),
                        images=None if images is None else images[j])
                for j, (i, (p, a, count)) in enumerate(zip(ids, batch))]
    if turns is None:
        return engine.generate(requests, sampling_params(cfg))
    return turns.generate(engine, requests, sampling_params(cfg), rows=[prompts.rows[i] for i in ids],
                          openings=[prompts.openings[i] for i in ids])


def engine_routes(routes: list, model) -> Ragged:
    """The samples' routes as the routes column (rollout.router_replay=engine); every sample must have them."""
    state = routing(model)
    if any(r is None for r in routes):
        raise RunStopped("rollout.router_replay=engine: the engine returned samples without their routes")
    if not routes:
        return Ragged(torch.zeros((0, state.layers, state.top_k), dtype=state.dtype), torch.zeros(0, dtype=torch.long))
    return Ragged.of(routes, state.dtype)


def add_image_columns(batch: Batch, inputs: list, weight: float, dim: int) -> None:
    """Each sample's prompt images (`inputs`: ImageInputs or None per row) as its pixel_values (`dim` values per
    patch) and image_grid_thw, and the vision encoder's work on them in language-model tokens (vision_tokens:
    patches x weight). A rank without images has the same columns, empty, as exchange needs."""
    def column(parts: list[torch.Tensor], width: int, dtype: torch.dtype) -> Ragged:
        values = torch.cat(parts) if parts else torch.zeros(0, width)
        return Ragged(values.to(dtype), torch.tensor([len(x) for x in parts], dtype=torch.long))

    grids = [x.grid if x is not None else torch.zeros(0, 3, dtype=torch.long) for x in inputs]
    batch["pixel_values"] = column([x.pixel_values if x is not None else torch.zeros(0, dim) for x in inputs], dim,
                                   torch.float32)
    batch["image_grid_thw"] = column(grids, 3, torch.long)
    batch["vision_tokens"] = torch.tensor([round(int(g.prod(-1).sum()) * weight) for g in grids], dtype=torch.long)


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
