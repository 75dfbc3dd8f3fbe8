"""Canonical batches (train.reproducibility=bitwise): which samples share a forward pass, decided from the step's
sample order and sizes alone, never from the number of ranks, then dealt to the ranks whole.

Why: a row's outputs, and a micro-batch's gradient, change in their last bits with who shares the batch, in which
order and at which padded shape (a GEMV for one row, a GEMM for several; attention blocked by the key length; the
weight gradient summed over the rows in order). Layout-invariant in value (rounding) is not layout-invariant in bits.
So under bitwise every pass runs on batches that are the same on any layout:

  * generation: `rollout_batches` cuts the step's prompts into runs of `per_batch` consecutive prompts, each with
    all its samples, and deals whole batches to the generating units (balanced by cost);
  * training passes (old and reference log-probs, the critic, the update): `canonical_schedule` packs each
    mini-batch's rows into micro-batches as one rank would (core.schedule with world 1: longest first, under the
    token cap), then deals whole micro-batches to the ranks; a rank with fewer runs zero-weight fillers where
    the rounding schedule would split its micro-batches.

What a rank holds is then a union of whole batches, and each batch's result is the same bits wherever it runs; the
sums over batches are made layout-free by evenrl.distributed.exact. The price is balance: whole micro-batches
cannot be split to even out the ranks (benchmarks/reproducibility.py measures it against the token-level schedule).

    schedule = canonical_schedule(lengths, world=3, minibatches=2, token_cap=4096)   # a StepSchedule, as make_schedule
    batches = rollout_batches(prompt_costs, n=8, units=3, per_batch=2)             # per unit: its batches
    calls = unit_batches(cfg, prompt_costs, units=3, weights=None)                 # either mode's engine calls
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from evenrl.core.partition import balanced_partition
from evenrl.core.schedule import FILLER, MicroBatch, MiniBatch, StepSchedule, make_schedule, rollout_shares

if TYPE_CHECKING:
    from evenrl.config import RunConfig

__all__ = ["canonical_schedule", "micro_key", "prompt_batches", "rollout_batches", "unit_batches"]


def canonical_schedule(lengths: Sequence[int], *, world: int, minibatches: int = 1, token_cap: int | None = None,
                       groups: Sequence[Hashable] | None = None, weights: Sequence[float] | None = None,
                       min_rows: int = 1, quadratic_cost: float = 0.0, inert: Sequence[bool] | None = None,
                       extra: Sequence[int] | None = None, packed: bool = False) -> StepSchedule:
    """make_schedule's StepSchedule whose micro-batches do not depend on `world`: each mini-batch packed as one rank
    packs it, its micro-batches then dealt whole to the ranks by cost (padded tokens, plus attention's quadratic
    part), in proportion to `weights`; every rank runs as many micro-steps as the busiest (fillers)."""
    one = make_schedule(lengths, world=1, minibatches=minibatches, token_cap=token_cap, groups=groups,
                        min_rows=min_rows, quadratic_cost=quadratic_cost, inert=inert, extra=extra, packed=packed)
    out = []
    for mb in one.minibatches:
        micros = [m for m in mb.per_rank[0] if m.rows]
        costs = [m.tokens + quadratic_cost * sum(lengths[i] ** 2 for i in m.rows) for m in micros]
        parts = balanced_partition(costs, world, weights=weights).parts if micros else [[] for _ in range(world)]
        steps = max(1, max(len(p) for p in parts))
        per_rank = []
        for part in parts:
            mine = sorted((micros[j] for j in part), key=lambda m: (-m.tokens, m.rows))
            per_rank.append(tuple(mine) + (FILLER,) * (steps - len(mine)))
        out.append(MiniBatch(rows=mb.rows, per_rank=tuple(per_rank)))
    return StepSchedule(world=world, minibatches=tuple(out), oversize=one.oversize, token_cap=one.token_cap,
                        min_rows=min_rows, packed=packed)


def micro_key(m: MicroBatch) -> int:
    """A micro-batch's place in the canonical order: its first row (micro-batches of a mini-batch are disjoint)."""
    return m.rows[0]


def prompt_batches(n_prompts: int, per_batch: int) -> list[list[int]]:
    """The step's prompt positions 0..n-1 cut into runs of `per_batch` (the last one shorter)."""
    return [list(range(a, min(a + per_batch, n_prompts))) for a in range(0, n_prompts, per_batch)]


def rollout_batches(prompt_costs: Sequence[float], n: int, units: int, per_batch: int,
                    weights: Sequence[float] | None = None) -> list[list[list[tuple[int, int, int]]]]:
    """Per generating unit, its generation batches, each a list of (prompt, first sample, count) as
    core.schedule.rollout_shares gives them: whole prompts (first 0, count n), `per_batch` consecutive ones per
    batch, whole batches dealt to the units by cost (weights: the units' capacity)."""
    batches = prompt_batches(len(prompt_costs), per_batch)
    costs = [n * sum(prompt_costs[p] for p in b) for b in batches]
    parts = balanced_partition(costs, units, weights=weights).parts if batches else [[] for _ in range(units)]
    return [[[(p, 0, n) for p in batches[j]] for j in part] for part in parts]


def unit_batches(cfg: RunConfig, costs: Sequence[float], units: int,
                 weights: Sequence[float] | None) -> list[list[list[tuple[int, int, int]]]]:
    """Per generating unit, its engine calls' (prompt, first sample, count) lists: under bitwise the canonical
    batches of rollout.batch_prompts prompts dealt whole (rollout_batches), under rounding one call of the unit's
    core.schedule.rollout_shares. The one place either mode's split is chosen: the trainers' sampling, the reserved
    rollout ranks and partial rollouts (rollout.carry) all deal the step's prompts by it."""
    n = cfg.rollout.samples_per_prompt
    if cfg.train.reproducibility == "bitwise":
        return rollout_batches(costs, n, units, cfg.rollout.batch_prompts, weights)
    return [[share] for share in rollout_shares(costs, n, units, weights)]
