"""How much of a step's work falls to the busiest rank, worst case (every sample at max length): the tokens of its
largest micro-batch and the samples it generates. What the memory estimate sizes activations and the KV cache by
(planner.memory), on the mesh the run builds (evenrl.distributed.mesh_shape: dp x sp x tp, tp fastest).

A replica (the sp x tp consecutive ranks of one data-parallel index) takes samples as one unit: its micro-batch holds
up to SP x the per-rank token cap (tensor parallelism splits no tokens: each rank of a TP group holds them all),
and each rank 1/SP of it. A replica moves at its weakest rank's capacity weight. Generation: with the hf engine a
TP group samples from its split model together (a rollout unit of TP ranks, each holding the KV cache of its heads
for all the unit's samples); any other engine samples per rank.
g comes from the trainer's own rollout split (evenrl.core.schedule.rollout_shares), so the estimate follows any
change to it; past SPLIT_MAX samples per step that split costs too much time for a preflight (the planner sizes
fixes by bisection, re-estimating each time), and g is the bound it keeps: within one sample of the busiest
unit's weighted share.
Pure Python: never imports torch.
"""

from __future__ import annotations

import functools
import math

from evenrl.config import RunConfig
from evenrl.core.schedule import rollout_shares
from evenrl.planner.layout import Layout

SPLIT_MAX = 20_000  # samples per step beyond which the rollout split is bounded, not computed (module docstring)


def replicas(cfg: RunConfig, layout: Layout) -> tuple[int, int, int]:
    """(SP, TP, replicas): the parallel sizes as planned (TP at most the training ranks, SP at most what is left)
    and the whole replicas of SP x TP consecutive training ranks. Sizes that do not divide the ranks are the
    rules' errors (planner.tensor_parallel); the estimate then counts the whole replicas."""
    t = max(layout.training_ranks, 1)
    tp = min(cfg.parallel.tensor_parallel_size, t)
    sp = min(cfg.parallel.sequence_parallel_size, max(t // tp, 1))
    return sp, tp, max(t // (sp * tp), 1)


def _weights(cfg: RunConfig, layout: Layout) -> list[float] | None:
    w = layout.capacity_weights or cfg.parallel.fixed_capacity_weights()
    return list(w) if w and len(w) == max(layout.training_ranks, 1) else None


def unit_share(cfg: RunConfig, layout: Layout, size: int, ranks: tuple[int, ...] | None = None) -> float:
    """The busiest unit's share of a step's samples, units being `size` consecutive training ranks (the whole ones)
    of which it holds any of `ranks` (default all): its weakest rank's capacity weight over all units' (a unit
    moves in lockstep), else 1 / units."""
    t = max(layout.training_ranks, 1)
    units = max(t // size, 1)
    w = _weights(cfg, layout)
    if not w:
        return 1 / units
    slowest = [min(w[u * size:(u + 1) * size]) for u in range(units)]
    return max(slowest[min(r // size, units - 1)] for r in (ranks or range(units * size))) / sum(slowest)


def share_of(cfg: RunConfig, layout: Layout, ranks: tuple[int, ...] | None = None) -> float:
    """The busiest of `ranks`' (default all training ranks') share of a step's samples: its capacity weight's
    share, else 1 / T."""
    return unit_share(cfg, layout, 1, ranks)


def worst_case_shape(cfg: RunConfig, layout: Layout, extra: int = 0,
                     ranks: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(tokens of the largest micro-batch on one rank, samples the busiest rollout unit generates), all samples at
    max length. `extra`: each sample's vision-encoder tokens (planner.vision.worst_vision_tokens), which share the
    token cap; `ranks`: the busiest of these training ranks (default all). With SP > 1 the micro-batch is a
    replica's, SP x the cap, and a rank holds its 1/SP slice (module docstring)."""
    t = max(layout.training_ranks, 1)
    sp, tp, _ = replicas(cfg, layout)
    ranks = ranks or tuple(range(t))
    length = cfg.sample_tokens()
    per_mb = math.ceil(cfg.samples_per_step() / cfg.algo.minibatches_per_step)
    rows_unit = max(1, math.ceil(per_mb * unit_share(cfg, layout, sp * tp, ranks) - 1e-9))
    rows = min(rows_unit, max(1, sp * cfg.train.token_cap_per_micro_batch // (length + extra),
                              cfg.train.min_rows_per_micro_batch))
    size = tp if cfg.rollout.engine == "hf" else 1  # a rollout unit: a TP group samples its split model together
    units = max(t // size, 1)
    w = _weights(cfg, layout)
    weights = tuple(min(w[u * size:(u + 1) * size]) for u in range(units)) if w else None
    mine = tuple(sorted({min(r // size, units - 1) for r in ranks}))
    gen = _busiest_rollout(cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, length, units, weights, mine)
    return math.ceil(rows * length / sp), gen


@functools.lru_cache(maxsize=256)
def _busiest_rollout(prompts: int, k: int, length: int, world: int, weights: tuple[float, ...] | None,
                     ranks: tuple[int, ...]) -> int:
    """Samples the busiest of `ranks` (rollout units) generates: the trainer's own split (rollout_shares) with every
    prompt at `length`. Past SPLIT_MAX samples, the bound that split keeps instead (within one sample of the unit's
    weighted share)."""
    if prompts * k > SPLIT_MAX:
        share = max(weights[r] for r in ranks) / sum(weights) if weights else 1 / world
        return max(1, math.ceil(prompts * k * share - 1e-9))
    shares = rollout_shares([float(length)] * prompts, k, world, weights)
    return max(1, max(sum(count for _, _, count in shares[r]) for r in ranks))
