"""The step's generation on a training rank: its share of the prompts' samples (generated here, received from
reserved rollout ranks, or whole multi-turn trajectories: the run's TrajectorySource), with a vision-language model's
image columns, as the step's rows. Rewards and dynamic sampling's rounds are the trainer's (evenrl.train.sampling).

`trainer` is evenrl.train.trainer.Trainer, read here by its fields only (this package sits below train/)."""

from __future__ import annotations

import torch

from evenrl.core.batch import Batch, Ragged
from evenrl.core.canonical import unit_batches
from evenrl.core.staleness import policy_version
from evenrl.distributed import collectives as dist
from evenrl.engines.base import Request, sampling_params
from evenrl.errors import RunStopped
from evenrl.models.routing import routing
from evenrl.models.vision import pixel_dim, prompt_image_inputs
from evenrl.rollout.carry import carried_rows
from evenrl.rollout.trajectories import trajectory_columns


def index_stride(cfg) -> int:
    """Sample indices per (prompt, sample): 1, or with rollout.agent room for the samples a trajectory is split into
    (at most one per call). Indices are then sparse until step.gather_rows numbers the step's rows 0..N-1."""
    return cfg.rollout.agent_max_calls if cfg.rollout.agent else 1


def rollout(trainer, step: int, prompt_ids: list[int], first: int = 0) -> Batch:
    """Generate this rank's share of the samples of `prompt_ids`, which take the step's positions first,
    first + 1, ... (rollout_shares): whole prompts where the ranks divide them, a prompt's samples split over ranks
    where they do not (2 prompts x 8 samples on 4 ranks: 4 samples each). With rollout.partial the rows are the
    groups that are complete in this step, whenever their prompts were drawn (evenrl.rollout.carry)."""
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
    `prompts`, an evenrl.train.trainer.Prompts; a prompt's key is `first` + its position), or with rollout.env /
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
