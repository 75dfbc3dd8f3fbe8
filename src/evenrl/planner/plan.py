"""The plan of a run: what the trainer would do with a config on a layout, and every problem with it.

    plan = make_plan(load_config("examples/plan_512x8.yaml"), make_layout(8, 8, device="cuda"))
    print(render(plan)); plan.runnable; plan.to_dict()

The step is simulated with evenrl.core.schedule on worst-case lengths (every sample max_prompt_tokens +
max_new_tokens), so per-rank rows, tokens and micro-steps are what the trainer would run for such a step; past
SIMULATE_MAX the same numbers come in closed form, so a huge step still plans in well under a second
(512 prompts x 8 samples on 64 ranks: ~0.1 s).
Derived numbers live in `Plan` (evenrl.planner.types, with its --json form); the config is never changed. The
rules that produce findings live in evenrl.planner.rules, the text form in evenrl.planner.render; `Plan`,
`RankRow`, `Finding` and `render` are importable from here too. The command line (evenrl.planner.cli) and --fit
(evenrl.planner.fit) build on this module; it imports neither, nor the peers' readers. Never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from evenrl.config import RunConfig
from evenrl.core.capacity import cap_limited_weights
from evenrl.core.partition import lower_bound
from evenrl.core.canonical import canonical_schedule
from evenrl.core.schedule import ScheduleError, make_schedule
from evenrl.data import hub
from evenrl.planner.cluster import datasheet_weights
from evenrl.planner.groups import plan_groups
from evenrl.planner.layout import Layout
from evenrl.planner.dims import dims_from_config, read_model_dims
from evenrl.planner.memory import estimate_memory
from evenrl.planner.memory_fixes import memory_fixes
from evenrl.models.vision_config import worst_vision_tokens
from evenrl.planner.render import render
from evenrl.planner.rules import RULES
from evenrl.planner.timing import RateFlags, assumed_rates, estimate_overlap
from evenrl.planner.types import Finding, Plan, RankRow

__all__ = ["Plan", "RankRow", "Finding", "make_plan", "count_rows", "render"]

SIMULATE_MAX = 50_000  # samples (or mini-batches x ranks) beyond which per-rank numbers are computed, not simulated
COUNT_MAX_BYTES = 512 * 1024**2  # jsonl files larger than this are not line-counted


def make_plan(cfg: RunConfig, layout: Layout, *, model_config: dict | None = None,
              rates: RateFlags | None = None, resumed: dict | None = None) -> Plan:
    """Everything derived from (cfg, layout); `model_config` is a config.json dict used instead of model.path,
    `rates` the device rates the user gave for the step-time estimate (evenrl.planner.timing), `resumed` the
    settings a checkpoint being resumed recorded (planner.reproducibility).
    parallel.rollout_devices is the layout's when no flag set it (evenrl train reads the same field)."""
    if cfg.parallel.rollout_devices and not layout.rollout_devices:
        layout = replace(layout, rollout_devices=cfg.parallel.rollout_devices)
    p = Plan(cfg, layout, cfg.sample_tokens(), rates=rates, resumed=resumed)
    p.dataset_rows = count_rows(cfg.data.path)
    try:
        if model_config is not None:
            p.dims = dims_from_config(model_config)
        elif cfg.model.path and Path(cfg.model.path).expanduser().is_dir():
            p.dims = read_model_dims(cfg.model.path)
    except ValueError as e:
        p.dims_error = str(e)
    if p.dims:  # a vision-language model's encoder work per sample, which the schedule counts (planner.vision)
        p.vision_tokens = worst_vision_tokens(cfg, p.dims.layers, p.dims.active_layer_params, p.dims.vision)
    if layout.training_ranks >= 1:
        p.weights = _weights(cfg, layout)
        # each device group's token cap and memory; the memory shown is the group with the least (one group:
        # every rank's)
        p.groups = plan_groups(cfg, replace(layout, capacity_weights=p.weights and tuple(p.weights)), p.dims)
        tightest = min(p.groups, key=lambda g: g.group.device.memory_gib)
        p.memory, p.memory_fixes = tightest.memory, list(tightest.fixes)
        _simulate(p, p.weights)
    if p.dims and layout.training_ranks >= 1 and (layout.rollout_devices or cfg.rollout.max_staleness):
        p.overlap = estimate_overlap(cfg, layout, p.dims, p.minibatch_sizes,
                                     assumed_rates(layout, cfg.model.dtype, rates), rates)
    found = [f for rule in RULES for f in rule(p)]
    order = {"error": 0, "warning": 1, "note": 2}
    p.findings = sorted(found, key=lambda f: order[f.level])
    return p


def _weights(cfg: RunConfig, layout: Layout) -> list[float] | None:
    """The capacity weights given (--capacity-weights, or the config's numbers); with 'auto', where evenrl train
    starts: the devices' datasheet ratios, or None (equal) where they are unknown or alike."""
    w = layout.capacity_weights or cfg.parallel.fixed_capacity_weights()
    if not w and cfg.parallel.capacity_weights == "auto":
        w = datasheet_weights(layout.rank_devices()[:layout.training_ranks], cfg.model.dtype)
    if not w or len(w) != layout.training_ranks or not all(x > 0 and math.isfinite(x) for x in w):
        return None
    return list(w)


def _units(p: Plan, weights: list[float] | None) -> tuple[int, int, list[int] | None, list[float] | None]:
    """What the schedule balances over: (units, token cap, per-unit caps, per-unit weights). A unit is a training
    rank, or with sequence or tensor parallelism a replica of SP x TP consecutive ranks, which takes samples as
    one and holds SP ranks' token caps (TP splits no tokens) and has their weight, its weakest rank's in both (the
    replica moves in lockstep; as train.step.plan_step)."""
    sp, m, t, cap = p.sequence_parallel, p.replica, p.dp_size, p.config.train.token_cap_per_micro_batch
    caps = p.token_caps
    if m == 1:
        return t, cap, caps, weights
    caps = caps and [sp * min(caps[g * m:(g + 1) * m]) for g in range(t)]
    return t, sp * cap, caps, weights and [min(weights[g * m:(g + 1) * m]) for g in range(t)]


def _simulate(p: Plan, weights: list[float] | None) -> None:
    c, length = p.config, p.sample_tokens
    t, cap, caps, weights = _units(p, weights)
    n, k = c.samples_per_step(), c.rollout.samples_per_prompt
    p.oversize = n if length + p.vision_tokens > cap else 0
    if n > SIMULATE_MAX or min(c.algo.minibatches_per_step, n) * t > SIMULATE_MAX:
        return _analytic(p)
    args = dict(world=t, minibatches=c.algo.minibatches_per_step, token_cap=caps or cap,
                groups=[i // k for i in range(n)], weights=weights, extra=[p.vision_tokens] * n)
    schedule = make_schedule
    if c.train.reproducibility == "bitwise":  # whole micro-batches of the config's cap dealt to ranks, as it runs
        schedule, args = canonical_schedule, {**args, "token_cap": cap}
    try:
        sch = schedule([length] * n, min_rows=c.train.min_rows_per_micro_batch, **args)
    except ScheduleError as e:
        p.schedule_error = str(e)
        sch = schedule([length] * n, min_rows=1, **args)
    p.minibatch_sizes = [len(mb.rows) for mb in sch.minibatches]
    p.micro_steps = sch.micro_steps()
    loads = sch.rank_loads()
    for r in range(t):
        micros = [m for mb in sch.minibatches for m in mb.per_rank[r]]
        idle = sum(1 for mb in sch.minibatches if not any(m.rows for m in mb.per_rank[r]))
        p.ranks.append(RankRow(r, sum(len(m.rows) for m in micros), loads[r], len(micros), idle))
    cost = length + p.vision_tokens
    busiest = even = bound = 0.0
    for mb in sch.minibatches:  # against what the schedule aims at: the weights, limited by per-device caps
        w = weights or [1.0] * t
        if caps:
            w = cap_limited_weights(len(mb.rows) * cost, w, caps)
        busiest += max(sum(m.tokens for m in mb.per_rank[r]) / w[r] for r in range(t))
        even += len(mb.rows) * cost / sum(w)
        bound += lower_bound([cost] * len(mb.rows), t, w)
    p.imbalance = busiest / even if even else None
    p.bound_ratio = busiest / bound if bound else None


def _analytic(p: Plan) -> None:
    """Equal-length samples, no weights, groups or per-device token caps: the schedule's result in closed form,
    O(M + T), for steps too large to simulate in well under a second."""
    c, t, length = p.config, p.dp_size, p.sample_tokens
    n = c.samples_per_step()
    m = min(c.algo.minibatches_per_step, n)
    q, extra = divmod(n, m)
    p.simulated = False
    p.minibatch_sizes = [q + 1] * extra + [q] * (m - extra)
    per_micro = max(1, p.sequence_parallel * c.train.token_cap_per_micro_batch // (length + p.vision_tokens))
    kinds = [(q + 1, extra), (q, m - extra)]  # (mini-batch size, how many)
    micro = [max(1, math.ceil(math.ceil(s / t) / per_micro)) for s, _ in kinds]
    p.micro_steps = [micro[0]] * extra + [micro[1]] * (m - extra)
    steps = micro[0] * extra + micro[1] * (m - extra)
    for r in range(t):
        rows = [(s // t + (r < s % t), count) for s, count in kinds if count]
        samples = sum(x * count for x, count in rows)
        idle = sum(count for x, count in rows if x == 0)
        p.ranks.append(RankRow(r, samples, samples * (length + p.vision_tokens), steps, idle))
    busiest = sum(math.ceil(s / t) * count for s, count in kinds)
    p.imbalance = busiest / sum(s / t * count for s, count in kinds)
    p.bound_ratio = 1.0  # equal lengths: the ceiling is the lower bound


def count_rows(path: str) -> int | None:
    """Rows of a local .jsonl (non-blank lines) or .parquet (footer metadata) file, or of a hub dataset's split in
    the `datasets` cache (its dataset_info.json); None when unknown or costly."""
    if (ds := hub.parse(path)) is not None:
        return hub.cached_rows(ds)
    f = Path(path).expanduser() if path else None
    if f is None or not f.is_file():
        return None
    try:
        if f.suffix == ".jsonl" and f.stat().st_size <= COUNT_MAX_BYTES:
            with f.open("rb") as fh:
                return sum(1 for line in fh if line.strip())
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq  # only for parquet files; reads the footer, not the data

            return pq.read_metadata(f).num_rows
    except Exception:  # an unreadable dataset is the trainer's error to report; here it only means "unknown"
        return None
    return None
