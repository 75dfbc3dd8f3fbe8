"""`evenrl plan`: every layout, batch and memory problem of a run, found before anything is loaded, with the fix.

    evenrl plan examples/plan_512x8.yaml --nnodes 8 --nproc-per-node 8 --device cuda --device-memory-gib 80
    evenrl plan examples/plan_512x8.yaml data.prompts_per_step=2 rollout.samples_per_prompt=1 --nproc-per-node 4
    evenrl plan CONFIG --fit             # print the nearest config that runs well on this layout, and its plan
    evenrl plan --from verl FILE [overrides] [layout flags]    # a peer's config: its failures, evenrl's equivalent

The step is simulated with evenrl.schedule on worst-case lengths (every sample max_prompt_tokens +
max_new_tokens), so per-rank rows, tokens and micro-steps are what the trainer would run for such a step.
Derived numbers live in `Plan`; the config is never changed (--fit builds a validated copy).
Exit codes: 0 runnable (no error finding), 1 an error finding, 2 unusable input (one line on stderr).
Never imports torch. Answers in well under a second (512 prompts x 8 samples on 64 ranks: ~0.1 s).

JSON (--json), schema "evenrl.plan/1":
  schema, runnable (bool), counts {error, warning, note},
  layout {nnodes, nproc_per_node, device, device_memory_gib, capacity_weights, rollout_devices, source,
          world, training_ranks},
  step {prompts_per_step, samples_per_prompt, samples_per_step, minibatches_per_step, minibatch_sizes[],
        epochs_per_step, sample_tokens, token_cap, min_rows, simulated},
  ranks {training, per_rank[{rank, samples, tokens, micro_steps, idle_minibatches}], samples{min,mean,max},
         tokens{min,mean,max}, micro_steps_per_minibatch[], idle[], imbalance (busiest / even split),
         bound_ratio (busiest / partition lower bound), oversize_samples},
  optimizer_steps {per_step, total, dataset_rows, steps_per_epoch, per_epoch}  (unknown: null),
  memory null | {breakdown_gib{...}, total_gib, capacity_gib, fits, params, micro_tokens,
                 rollout_samples_per_rank, host_gib, assumptions[], fixes[{settings, total_gib, fits, why}]},
  findings [{level, rule, message, fix}]   (errors first)
With --fit: the plan of the original config plus "fit": {changes[{key, from, to}], config{...}, plan{...}}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from evenrl.config import RunConfig, load_config
from evenrl.errors import UsageError
from evenrl.layout import Layout, add_layout_args, layout_from_args
from evenrl.memory import (ModelDims, MemoryEstimate, MemoryFix, dims_from_config, estimate_memory, memory_fixes,
                           read_model_dims, with_settings)
from evenrl.partition import lower_bound
from evenrl.schedule import ScheduleError, make_schedule

GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
SIMULATE_MAX = 50_000  # samples (or mini-batches x ranks) beyond which per-rank numbers are computed, not simulated
COUNT_MAX_BYTES = 512 * 1024**2  # jsonl files larger than this are not line-counted


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning", "note"]
    rule: str  # stable id, e.g. "idle-ranks"
    message: str  # what is wrong, with the numbers
    fix: str = ""  # nearest valid settings; alternatives separated by "; "

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RankRow:
    rank: int
    samples: int
    tokens: int  # padded tokens over the step (worst case)
    micro_steps: int  # same on every rank (short ranks run zero-weight filler steps)
    idle_minibatches: int  # mini-batches in which this rank has no rows


@dataclass
class Plan:
    config: RunConfig
    layout: Layout
    sample_tokens: int
    minibatch_sizes: list[int] = field(default_factory=list)
    micro_steps: list[int] = field(default_factory=list)
    ranks: list[RankRow] = field(default_factory=list)
    imbalance: float | None = None  # busiest rank's load / an even (weighted) split, summed over mini-batches
    bound_ratio: float | None = None  # busiest rank's load / the partition lower bound (1.0: nothing better exists)
    oversize: int = 0
    simulated: bool = True
    schedule_error: str | None = None
    dataset_rows: int | None = None
    dims: ModelDims | None = None
    dims_error: str | None = None
    memory: MemoryEstimate | None = None
    memory_fixes: list[MemoryFix] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def runnable(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    @property
    def idle(self) -> list[int]:
        return [r.rank for r in self.ranks if r.idle_minibatches]

    @property
    def optimizer_steps_per_step(self) -> int:
        return len(self.minibatch_sizes) * self.config.algo.epochs_per_step

    @property
    def steps_per_epoch(self) -> float | None:
        return self.dataset_rows / self.config.data.prompts_per_step if self.dataset_rows else None

    def counts(self) -> dict[str, int]:
        return {lv: sum(f.level == lv for f in self.findings) for lv in ("error", "warning", "note")}

    def to_dict(self) -> dict:
        c, t = self.config, self.layout.training_ranks
        spe = self.steps_per_epoch
        mem = None
        if self.memory:
            mem = self.memory.to_dict()
            mem["fixes"] = [asdict(f) for f in self.memory_fixes]
        return {
            "schema": "evenrl.plan/1", "runnable": self.runnable, "counts": self.counts(),
            "layout": self.layout.to_dict(),
            "step": {"prompts_per_step": c.data.prompts_per_step, "samples_per_prompt": c.rollout.samples_per_prompt,
                     "samples_per_step": c.samples_per_step(), "minibatches_per_step": c.algo.minibatches_per_step,
                     "minibatch_sizes": self.minibatch_sizes, "epochs_per_step": c.algo.epochs_per_step,
                     "sample_tokens": self.sample_tokens, "token_cap": c.train.token_cap_per_micro_batch,
                     "min_rows": c.train.min_rows_per_micro_batch, "simulated": self.simulated},
            "ranks": {"training": t, "per_rank": [asdict(r) for r in self.ranks],
                      "samples": _stats([r.samples for r in self.ranks]),
                      "tokens": _stats([r.tokens for r in self.ranks]),
                      "micro_steps_per_minibatch": self.micro_steps, "idle": self.idle,
                      "imbalance": None if self.imbalance is None else round(self.imbalance, 4),
                      "bound_ratio": None if self.bound_ratio is None else round(self.bound_ratio, 4),
                      "oversize_samples": self.oversize},
            "optimizer_steps": {"per_step": self.optimizer_steps_per_step,
                                "total": self.optimizer_steps_per_step * c.train.steps,
                                "dataset_rows": self.dataset_rows,
                                "steps_per_epoch": None if spe is None else round(spe, 3),
                                "per_epoch": None if spe is None else round(spe * self.optimizer_steps_per_step, 3)},
            "memory": mem,
            "findings": [f.to_dict() for f in self.findings],
        }


def _stats(xs: list[int]) -> dict | None:
    return {"min": min(xs), "mean": round(sum(xs) / len(xs), 3), "max": max(xs)} if xs else None


# ------------------------------------------------------------------------------------------ building a plan

def make_plan(cfg: RunConfig, layout: Layout, *, model_config: dict | None = None) -> Plan:
    """Everything derived from (cfg, layout); `model_config` is a config.json dict used instead of model.path."""
    p = Plan(cfg, layout, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    if layout.training_ranks >= 1:
        _simulate(p, _weights(cfg, layout))
    p.dataset_rows = count_rows(cfg.data.path)
    try:
        if model_config is not None:
            p.dims = dims_from_config(model_config)
        elif cfg.model.path and Path(cfg.model.path).expanduser().is_dir():
            p.dims = read_model_dims(cfg.model.path)
    except ValueError as e:
        p.dims_error = str(e)
    if p.dims and layout.training_ranks >= 1:
        p.memory = estimate_memory(cfg, layout, p.dims)
        if p.memory.fits is False:
            p.memory_fixes = memory_fixes(cfg, layout, p.dims)
    found = [f for rule in RULES for f in rule(p)]
    order = {"error": 0, "warning": 1, "note": 2}
    p.findings = sorted(found, key=lambda f: order[f.level])
    return p


def _weights(cfg: RunConfig, layout: Layout) -> list[float] | None:
    w = layout.capacity_weights or cfg.parallel.capacity_weights
    if not w or len(w) != layout.training_ranks or not all(x > 0 and math.isfinite(x) for x in w):
        return None
    return list(w)


def _simulate(p: Plan, weights: list[float] | None) -> None:
    c, t, length = p.config, p.layout.training_ranks, p.sample_tokens
    n, k, cap = c.samples_per_step(), c.rollout.samples_per_prompt, c.train.token_cap_per_micro_batch
    p.oversize = n if length > cap else 0
    if n > SIMULATE_MAX or min(c.algo.minibatches_per_step, n) * t > SIMULATE_MAX:
        return _analytic(p)
    args = dict(world=t, minibatches=c.algo.minibatches_per_step, token_cap=cap,
                groups=[i // k for i in range(n)], weights=weights)
    try:
        sch = make_schedule([length] * n, min_rows=c.train.min_rows_per_micro_batch, **args)
    except ScheduleError as e:
        p.schedule_error = str(e)
        sch = make_schedule([length] * n, min_rows=1, **args)
    p.minibatch_sizes = [len(mb.rows) for mb in sch.minibatches]
    p.micro_steps = sch.micro_steps()
    loads = sch.rank_loads()
    for r in range(t):
        micros = [m for mb in sch.minibatches for m in mb.per_rank[r]]
        idle = sum(1 for mb in sch.minibatches if not any(m.rows for m in mb.per_rank[r]))
        p.ranks.append(RankRow(r, sum(len(m.rows) for m in micros), loads[r], len(micros), idle))
    w = weights or [1.0] * t
    busiest = sum(max(sum(m.tokens for m in mb.per_rank[r]) / w[r] for r in range(t)) for mb in sch.minibatches)
    even = sum(len(mb.rows) * length for mb in sch.minibatches) / sum(w)
    bound = sum(lower_bound([length] * len(mb.rows), t, weights) for mb in sch.minibatches)
    p.imbalance = busiest / even if even else None
    p.bound_ratio = busiest / bound if bound else None


def _analytic(p: Plan) -> None:
    """Equal-length samples, no weights or groups: the schedule's result in closed form, O(M + T), for steps
    too large to simulate in well under a second."""
    c, t, length = p.config, p.layout.training_ranks, p.sample_tokens
    n = c.samples_per_step()
    m = min(c.algo.minibatches_per_step, n)
    q, extra = divmod(n, m)
    p.simulated = False
    p.minibatch_sizes = [q + 1] * extra + [q] * (m - extra)
    per_micro = max(1, c.train.token_cap_per_micro_batch // length)
    kinds = [(q + 1, extra), (q, m - extra)]  # (mini-batch size, how many)
    micro = [max(1, math.ceil(math.ceil(s / t) / per_micro)) for s, _ in kinds]
    p.micro_steps = [micro[0]] * extra + [micro[1]] * (m - extra)
    steps = micro[0] * extra + micro[1] * (m - extra)
    for r in range(t):
        rows = [(s // t + (r < s % t), count) for s, count in kinds if count]
        samples = sum(x * count for x, count in rows)
        idle = sum(count for x, count in rows if x == 0)
        p.ranks.append(RankRow(r, samples, samples * length, steps, idle))
    busiest = sum(math.ceil(s / t) * count for s, count in kinds)
    p.imbalance = busiest / sum(s / t * count for s, count in kinds)
    p.bound_ratio = 1.0  # equal lengths: the ceiling is the lower bound


def count_rows(path: str) -> int | None:
    """Rows of a local .jsonl (non-blank lines) or .parquet (footer metadata) file; None when unknown or costly."""
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


# ------------------------------------------------------------------------------------------ rules
# Each rule looks at the plan and returns findings. They all run: every problem is reported at once.

def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def rule_layout(p: Plan) -> list[Finding]:
    lay = p.layout
    if lay.training_ranks >= 1:
        return []
    return [Finding("error", "no-training-ranks",
                    f"{lay.rollout_devices} rollout devices out of {lay.world}: no rank is left to train",
                    f"--rollout-devices {lay.world - 1}; or more devices (--nproc-per-node {lay.rollout_devices + 1})")]


def rule_capacity_weights(p: Plan) -> list[Finding]:
    t = p.layout.training_ranks
    w = p.layout.capacity_weights or p.config.parallel.capacity_weights
    where = "--capacity-weights" if p.layout.capacity_weights else "parallel.capacity_weights"
    if not w or t < 1:
        return []
    if len(w) != t:
        return [Finding("error", "capacity-weights",
                        f"{where} has {len(w)} weights for {t} training ranks",
                        f"give one weight per training rank, e.g. {where}={','.join(['1'] * t)}; or drop it")]
    if not all(x > 0 and math.isfinite(x) for x in w):
        return [Finding("error", "capacity-weights", f"{where}={list(w)} has a weight <= 0",
                        "every weight must be a positive relative speed, e.g. 1 or 2")]
    return []


def rule_data(p: Plan) -> list[Finding]:
    d = p.config.data
    if not d.path:
        return [Finding("warning", "data-path", "data.path is empty: no prompts to train on",
                        "data.path=FILE.jsonl (or .parquet, or a local Hugging Face dataset directory)")]
    if not Path(d.path).expanduser().exists():
        return [Finding("error", "data-path", f"data.path {d.path!r} does not exist (evenrl never downloads)",
                        "point data.path at a local .jsonl/.parquet file or dataset directory")]
    if p.dataset_rows == 0:
        return [Finding("error", "data-path", f"data.path {d.path!r} has no rows", "use a non-empty dataset")]
    if p.dataset_rows is not None and p.dataset_rows < d.prompts_per_step:
        return [Finding("warning", "prompts-exceed-dataset",
                        f"{_plural(d.prompts_per_step, 'prompt')} per step from a dataset of "
                        f"{_plural(p.dataset_rows, 'row')}: every step repeats prompts",
                        f"data.prompts_per_step={p.dataset_rows}")]
    return []


def rule_model(p: Plan) -> list[Finding]:
    m = p.config.model
    path = Path(m.path).expanduser() if m.path else None
    if path is not None and not path.is_dir():
        return [Finding("error", "model-path", f"model.path {m.path!r} is not a local directory "
                        "(evenrl never downloads)", "download the model, then model.path=/local/dir")]
    if path is not None and not (path / "config.json").is_file():
        return [Finding("error", "model-path", f"model.path {m.path!r} has no config.json",
                        "point model.path at a Hugging Face model directory (config.json, weights, tokenizer)")]
    out = []
    if p.dims and p.dims.max_positions and p.sample_tokens > p.dims.max_positions:
        out.append(Finding("warning", "max-positions",
                           f"max_prompt_tokens + max_new_tokens = {p.sample_tokens:,} exceeds the model's "
                           f"max_position_embeddings {p.dims.max_positions:,}",
                           f"rollout.max_new_tokens={max(1, p.dims.max_positions - p.config.data.max_prompt_tokens)}"))
    return out


def rule_groups(p: Plan) -> list[Finding]:
    c = p.config
    k, adv = c.rollout.samples_per_prompt, c.algo.advantage
    if adv not in GROUP_ADVANTAGES:
        return []
    if k == 1:
        return [Finding("error", "single-sample-group",
                        f"advantage {adv} compares samples of one prompt, but samples_per_prompt=1: "
                        "every advantage is 0 and nothing is learned",
                        "rollout.samples_per_prompt>=2 (4-16 is usual)")]
    if c.rollout.temperature == 0:
        return [Finding("error", "greedy-group",
                        f"temperature 0 makes the {k} samples of a prompt identical: every advantage is 0",
                        "rollout.temperature=1.0")]
    if k < 4 and c.algo.std_scale == "group":
        return [Finding("note", "small-group",
                        f"the group std of {k} samples is coarse (with 0/1 rewards every advantage is "
                        f"{'+-0.71' if k == 2 else '+-0.58 or +-1.15'} or 0)",
                        "rollout.samples_per_prompt>=4; or algo.std_scale=batch")]
    return []


def rule_minibatches(p: Plan) -> list[Finding]:
    c, out = p.config, []
    want, got = c.algo.minibatches_per_step, len(p.minibatch_sizes)
    if p.ranks and got < want:
        n, prompts = c.samples_per_step(), c.data.prompts_per_step
        why = (f"{_plural(n, 'sample')}" if want > n else
               f"{_plural(prompts, 'prompt')} (mini-batch cuts fall between prompt groups)")
        out.append(Finding("error", "empty-minibatches",
                           f"minibatches_per_step={want} but {why} make only {got}: "
                           f"{want - got} mini-batches would be empty",
                           f"algo.minibatches_per_step={got}; or data.prompts_per_step={max(prompts, want)}"))
    sizes = p.minibatch_sizes
    if len(sizes) > 1 and max(sizes) > 1.25 * min(sizes):
        m = len(sizes)
        even = math.ceil(c.data.prompts_per_step / m) * m
        out.append(Finding("note", "uneven-minibatches",
                           f"mini-batches of {min(sizes)}..{max(sizes)} samples: cuts fall between prompt groups",
                           f"data.prompts_per_step={even} (a multiple of minibatches_per_step={m})"))
    return out


def _prompts_for(p: Plan, rows_per_rank: int) -> int:
    """Smallest prompts_per_step whose smallest mini-batch gives every training rank rows_per_rank rows."""
    c, t = p.config, p.layout.training_ranks
    m, k = c.algo.minibatches_per_step, c.rollout.samples_per_prompt
    return m * math.ceil(t * rows_per_rank / k)


def rule_idle(p: Plan) -> list[Finding]:
    c, t = p.config, p.layout.training_ranks
    idle = p.idle
    if not idle:
        return []
    mrows = c.train.min_rows_per_micro_batch
    per_mb = min(p.minibatch_sizes)
    nmb = len(p.minibatch_sizes)
    k, prompts = c.rollout.samples_per_prompt, c.data.prompts_per_step
    head = f"{_plural(prompts, 'prompt')} × {_plural(k, 'sample')}"
    if nmb > 1:
        head += f" in {nmb} mini-batches (smallest {per_mb})"
    why = f" with min_rows_per_micro_batch={mrows}" if mrows > 1 else ""
    fixes = [f"data.prompts_per_step={_prompts_for(p, mrows)}"]
    need_k = math.ceil(t * mrows * nmb / prompts)
    if need_k > k:
        fixes.append(f"rollout.samples_per_prompt>={need_k}")
    if nmb > 1 and c.samples_per_step() // (t * mrows) >= 1:
        fixes.append(f"algo.minibatches_per_step={max(1, c.samples_per_step() // (t * mrows))}")
    fixes.append(f"or fewer training ranks ({max(1, per_mb // mrows)})")
    if mrows > 1:
        fixes.append("or SyncBatchNorm (CUDA, gathers statistics over ranks) with train.min_rows_per_micro_batch=1")
    idle_all = sum(1 for r in p.ranks if r.idle_minibatches == nmb)
    return [Finding("warning", "idle-ranks",
                    f"{head} on {t} training ranks{why} leaves {len(idle)} rank{'s' if len(idle) > 1 else ''} idle"
                    + (f" ({idle_all} for the whole step)" if nmb > 1 and idle_all else ""),
                    ", or ".join(fixes[:-2 if mrows > 1 else -1]) + "; " + "; ".join(fixes[-2 if mrows > 1 else -1:]))]


def rule_rollout_idle(p: Plan) -> list[Finding]:
    c, t = p.config, p.layout.training_ranks
    prompts = c.data.prompts_per_step
    if t < 2 or prompts >= t:
        return []
    return [Finding("warning", "rollout-idle",
                    f"{_plural(prompts, 'prompt')} on {t} ranks: {_plural(t - prompts, 'rank')} "
                    f"generate{'s' if t - prompts == 1 else ''} nothing "
                    "(each prompt is generated on one rank, its samples sharing the prefill)",
                    f"data.prompts_per_step={t}")]


def rule_min_rows(p: Plan) -> list[Finding]:
    c = p.config
    m, length, cap = c.train.min_rows_per_micro_batch, p.sample_tokens, c.train.token_cap_per_micro_batch
    out = []
    if p.schedule_error:
        k, mbs, prompts = c.rollout.samples_per_prompt, c.algo.minibatches_per_step, c.data.prompts_per_step
        out.append(Finding("error", "min-rows", p.schedule_error,
                           f"data.prompts_per_step={mbs * math.ceil(m / k)} ({_prompts_for(p, m)} keeps every rank "
                           f"busy); or algo.minibatches_per_step={max(1, prompts // math.ceil(m / k))}"))
    if m > 1 and m * length > cap:
        out.append(Finding("warning", "min-rows-token-cap",
                           f"min_rows_per_micro_batch={m} rows of up to {length:,} tokens need {m * length:,} "
                           f"tokens, above token_cap_per_micro_batch={cap:,}: such micro-batches exceed the cap",
                           f"train.token_cap_per_micro_batch={m * length}"))
    return out


def rule_token_cap(p: Plan) -> list[Finding]:
    c, length = p.config, p.sample_tokens
    cap = c.train.token_cap_per_micro_batch
    if length <= cap:
        return []
    return [Finding("warning", "token-cap-oversize",
                    f"token_cap_per_micro_batch={cap:,} is below max_prompt_tokens + max_new_tokens = {length:,}: "
                    "such samples run alone as oversize micro-batches (memory follows them, not the cap)",
                    f"train.token_cap_per_micro_batch={length}; or rollout.max_new_tokens="
                    f"{max(1, cap - c.data.max_prompt_tokens)}")]


def rule_imbalance(p: Plan) -> list[Finding]:
    if p.imbalance is None or p.idle:
        return []
    c, t = p.config, p.layout.training_ranks
    k, m = c.rollout.samples_per_prompt, len(p.minibatch_sizes) or 1
    if p.bound_ratio and p.bound_ratio > 1.05:
        return [Finding("note", "imbalance", f"the busiest rank is {100 * (p.bound_ratio - 1):.0f}% above the "
                        "partition's lower bound (capacity weights that do not match the sample counts)",
                        "parallel.capacity_weights closer to 1, or more samples per step")]
    if p.imbalance < 1.10:
        return []
    step = t * m // math.gcd(t * m, k)  # prompts_per_step a multiple of this splits evenly
    even = math.ceil(c.data.prompts_per_step / step) * step
    return [Finding("note", "imbalance",
                    f"the busiest rank does {100 * (p.imbalance - 1):.0f}% more than an even split: "
                    f"{c.samples_per_step():,} whole samples over {t} ranks"
                    + (f" in {m} mini-batches" if m > 1 else "") + " cannot split evenly (others wait)",
                    f"data.prompts_per_step={even} splits evenly")]


def rule_memory(p: Plan) -> list[Finding]:
    c, lay, mem = p.config, p.layout, p.memory
    if mem is None:
        if p.dims_error:
            return [Finding("note", "memory-skipped", f"no memory estimate: {p.dims_error}", "")]
        if not c.model.path:
            return [Finding("note", "memory-skipped", "no memory estimate: model.path is empty",
                            "model.path=/local/model/dir (its config.json gives the dimensions)")]
        return []
    if mem.fits is None:
        return [Finding("note", "memory-unknown", f"estimated peak {mem.total_gib:.1f} GiB per rank; "
                        "device memory unknown", "--device-memory-gib 80 (your device's memory)")]
    top = sorted(((v, k) for k, v in mem.breakdown.items() if v >= 0.05), reverse=True)[:4]
    parts = ", ".join(f"{k} {v:.1f}" for v, k in top)
    if not mem.fits:
        fixes = "; ".join(f.text() + (" (fits)" if f.fits else "") for f in p.memory_fixes)
        return [Finding("error", "memory-over",
                        f"estimated peak {mem.total_gib:.1f} GiB per rank > {lay.device_memory_gib:.1f} GiB "
                        f"device memory ({parts} GiB)",
                        f"each alone, best first: {fixes}" if fixes else "use devices with more memory")]
    if mem.total_gib > 0.9 * lay.device_memory_gib:
        return [Finding("warning", "memory-tight", f"estimated peak {mem.total_gib:.1f} GiB of "
                        f"{lay.device_memory_gib:.1f} GiB per rank (> 90%; fragmentation may push it over)",
                        "model.gradient_checkpointing=true; or a lower train.token_cap_per_micro_batch")]
    return []


def rule_parallel(p: Plan) -> list[Finding]:
    c, lay, out = p.config, p.layout, []
    if c.parallel.cpu_offload == "full" and c.parallel.sharding != "fsdp":
        out.append(Finding("warning", "offload-replicated", "cpu_offload=full keeps parameters on the host only "
                           "under FSDP (CPUOffloadPolicy); with sharding=replicated only the optimizer moves",
                           "parallel.sharding=fsdp; or parallel.cpu_offload=optimizer"))
    if c.parallel.sharding == "fsdp" and lay.training_ranks == 1:
        out.append(Finding("note", "fsdp-one-rank", "sharding=fsdp over 1 training rank shards nothing",
                           "parallel.sharding=replicated, or more ranks"))
    if lay.rollout_devices and c.rollout.engine == "hf":
        out.append(Finding("warning", "rollout-devices-unused",
                           f"{lay.rollout_devices} device(s) reserved for rollout, but engine 'hf' generates on "
                           "the training ranks: the reserved devices sit idle",
                           f"--rollout-devices 0 (then {lay.world} ranks train and generate)"))
    if c.rollout.memory_fraction > 0 and c.rollout.engine == "hf":
        out.append(Finding("warning", "rollout-reserve-unused",
                           f"rollout.memory_fraction={c.rollout.memory_fraction} reserves memory for a separate "
                           "engine; engine 'hf' samples with the training model", "rollout.memory_fraction=0"))
    if c.model.dtype == "float16" and lay.device == "cpu":
        out.append(Finding("warning", "fp16-cpu", "float16 on CPU is slow and lacks kernels for some ops",
                           "model.dtype=float32 (or bfloat16)"))
    total = p.optimizer_steps_per_step * c.train.steps
    if c.train.warmup_steps and c.train.warmup_steps >= total:
        out.append(Finding("warning", "warmup-longer-than-run",
                           f"warmup_steps={c.train.warmup_steps} >= {total} optimizer steps in the whole run: "
                           "the learning rate never reaches train.lr", f"train.warmup_steps={total // 10}"))
    return out


RULES = [rule_layout, rule_capacity_weights, rule_data, rule_model, rule_groups, rule_minibatches, rule_min_rows,
         rule_idle, rule_rollout_idle, rule_token_cap, rule_imbalance, rule_memory, rule_parallel]


# ------------------------------------------------------------------------------------------ --fit

def fit(plan: Plan) -> tuple[RunConfig, list[tuple[str, Any, Any]]]:
    """The nearest config that runs well on plan.layout, and its changes as (key, old, new).
    Layout problems (no training ranks) and missing files cannot be fixed here; they stay in the re-plan."""
    cfg, lay, s = plan.config, plan.layout, {}
    t = max(lay.training_ranks, 1)
    if cfg.algo.advantage in GROUP_ADVANTAGES and cfg.rollout.samples_per_prompt == 1:
        s["rollout.samples_per_prompt"] = 4
    if cfg.rollout.temperature == 0 and cfg.algo.advantage in GROUP_ADVANTAGES:
        s["rollout.temperature"] = 1.0
    if cfg.parallel.capacity_weights and len(cfg.parallel.capacity_weights) != t:
        s["parallel.capacity_weights"] = None
    if cfg.parallel.cpu_offload == "full" and cfg.parallel.sharding != "fsdp":
        s["parallel.sharding" if t > 1 else "parallel.cpu_offload"] = "fsdp" if t > 1 else "optimizer"
    if cfg.rollout.memory_fraction > 0 and cfg.rollout.engine == "hf":
        s["rollout.memory_fraction"] = 0.0
    k = s.get("rollout.samples_per_prompt", cfg.rollout.samples_per_prompt)
    prompts, m, mrows = cfg.data.prompts_per_step, cfg.algo.minibatches_per_step, cfg.train.min_rows_per_micro_batch
    m = min(m, prompts)
    need = max(prompts, m * math.ceil(t * mrows / k), t)  # every rank trains and generates
    if plan.imbalance and plan.imbalance >= 1.10:
        step = t * m // math.gcd(t * m, k)
        even = math.ceil(need / step) * step
        need = even if even <= 2 * need else need
    if need != prompts:
        s["data.prompts_per_step"] = need
    if m != cfg.algo.minibatches_per_step:
        s["algo.minibatches_per_step"] = m
    length = plan.sample_tokens
    if cfg.train.token_cap_per_micro_batch < max(length, mrows * length):
        s["train.token_cap_per_micro_batch"] = max(length, mrows * length)
    new = with_settings(cfg, s) if s else cfg
    if plan.dims and lay.training_ranks >= 1 and lay.device_memory_gib:
        new = _fit_memory(new, lay, plan.dims)
    changes = []
    old_d, new_d = _flat(cfg.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    for key, value in new_d.items():
        if old_d.get(key) != value:
            changes.append((key, old_d.get(key), value))
    return new, changes


# Least intrusive first; algorithm-changing knobs (kl, prompts) only when nothing else fits.
_PREFERENCE = ["model.gradient_checkpointing", "parallel.sharding", "train.token_cap_per_micro_batch", "model.dtype",
               "parallel.cpu_offload", "rollout.memory_fraction", "algo.kl_coef", "data.prompts_per_step"]


def _fit_memory(cfg: RunConfig, lay: Layout, dims: ModelDims) -> RunConfig:
    for _ in range(len(_PREFERENCE)):
        if estimate_memory(cfg, lay, dims).total_gib <= lay.device_memory_gib:
            return cfg
        fixes = memory_fixes(cfg, lay, dims)
        if not fixes:
            return cfg
        fitting = [f for f in fixes if f.fits]
        rank = {key: i for i, key in enumerate(_PREFERENCE)}
        pick = (min(fitting, key=lambda f: (max(rank.get(k, 99) for k in f.settings), len(f.settings))) if fitting
                else next((f for f in fixes if not {"algo.kl_coef", "data.prompts_per_step"} & set(f.settings)),
                          fixes[0]))
        cfg = with_settings(cfg, pick.settings)
    return cfg


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


ALWAYS_SHOWN = {"data": ("prompts_per_step",), "rollout": ("samples_per_prompt",), "algo": ("minibatches_per_step",)}


def minimal_yaml(cfg: RunConfig) -> str:
    """The batch keys and those that differ from the defaults, as a config file (defaults fill in the rest)."""
    default = RunConfig().model_dump(mode="json")
    full = cfg.model_dump(mode="json")
    diff = {sec: {k: v for k, v in vals.items() if default[sec].get(k) != v or k in ALWAYS_SHOWN.get(sec, ())}
            for sec, vals in full.items()}
    diff = {sec: vals for sec, vals in diff.items() if vals}
    return yaml.safe_dump(diff, sort_keys=False) if diff else "{}\n"


# ------------------------------------------------------------------------------------------ text output

def render(p: Plan) -> str:
    c, lay = p.config, p.layout
    t, k, prompts = lay.training_ranks, c.rollout.samples_per_prompt, c.data.prompts_per_step
    out = [f"layout     {lay.describe()}"]
    sizes = p.minibatch_sizes
    mbs = (f"{len(sizes)} mini-batch{'es' if len(sizes) != 1 else ''} of {_range(sizes)}" if sizes
           else "no mini-batches")
    out.append(f"step       {_plural(prompts, 'prompt')} × {_plural(k, 'sample')} = "
               f"{c.samples_per_step():,} samples; {mbs}; "
               f"{_plural(c.algo.epochs_per_step, 'epoch')} over them")
    out.append(f"samples    worst case {p.sample_tokens:,} tokens each (prompt {c.data.max_prompt_tokens:,} + new "
               f"{c.rollout.max_new_tokens:,}); token cap {c.train.token_cap_per_micro_batch:,} per micro-batch"
               + (f"; min {c.train.min_rows_per_micro_batch} rows" if c.train.min_rows_per_micro_batch > 1 else ""))
    if p.ranks:
        out += _rank_lines(p)
    total = p.optimizer_steps_per_step * c.train.steps
    line = (f"optimizer  {p.optimizer_steps_per_step} per RL step; {c.train.steps:,} RL steps = {total:,} "
            "optimizer steps")
    if p.steps_per_epoch is not None:
        line += (f"; dataset {p.dataset_rows:,} rows = {p.steps_per_epoch:,.1f} RL steps "
                 f"({p.steps_per_epoch * p.optimizer_steps_per_step:,.1f} optimizer steps) per epoch")
    else:
        line += "; dataset size unknown"
    out.append(line)
    if p.memory:
        out += _memory_lines(p)
    counts = p.counts()
    out.append("findings   " + (", ".join(_plural(n, lv) for lv, n in counts.items() if n) or "none: runnable"))
    for f in p.findings:
        out.append(f"  {f.level.upper():<7} {f.rule}: {f.message}")
        for i, alt in enumerate(x for x in f.fix.split("; ") if x):
            out.append(f"  {'':7} {'fix: ' if i == 0 else '     '}{alt}")
    return "\n".join(out)


def _range(xs: list[int]) -> str:
    return f"{min(xs):,}" if min(xs) == max(xs) else f"{min(xs):,}..{max(xs):,}"


def _rank_lines(p: Plan) -> list[str]:
    rows, nmb = p.ranks, len(p.minibatch_sizes)
    head = "per rank   " + ("(computed: too many samples to simulate) " if not p.simulated else "")
    lines = []
    if len(rows) <= 16:
        lines.append(head + f"{'rank':>4} {'samples':>8} {'est. tokens':>12} {'micro-steps':>12}")
        for r in rows:
            idle = "" if not r.idle_minibatches else (
                "  idle" if r.idle_minibatches == nmb else f"  idle in {r.idle_minibatches}/{nmb} mini-batches")
            lines.append(f"{'':11}{r.rank:>4} {r.samples:>8,} {r.tokens:>12,} {r.micro_steps:>12}{idle}")
    s = _stats([r.samples for r in rows])
    tk = _stats([r.tokens for r in rows])
    summary = (f"samples {s['min']:,}/{s['mean']:,.1f}/{s['max']:,}, tokens {tk['min']:,}/{tk['mean']:,.0f}/"
               f"{tk['max']:,} (min/mean/max); {_plural(rows[0].micro_steps, 'micro-step')} per rank "
               f"({', '.join(map(str, p.micro_steps))} per mini-batch)")
    lines.append((f"{'':11}" if len(rows) <= 16 else head) + summary)
    idle = p.idle
    lines.append(f"{'':11}idle ranks: " + (_ranks_text(idle) if idle else "none")
                 + ("" if p.imbalance is None else f"; busiest rank / even split = {p.imbalance:.3f}")
                 + ("" if not p.bound_ratio or p.bound_ratio < 1.0005 else f" (lower bound x{p.bound_ratio:.3f})"))
    return lines


def _ranks_text(ranks: list[int], most: int = 12) -> str:
    spans, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            spans.append(str(start) if start == a else f"{start}-{a}")
            start = b
    more = f",... ({len(ranks):,} ranks)" if len(spans) > most else ""
    return ",".join(spans[:most]) + more


def _memory_lines(p: Plan) -> list[str]:
    mem, c, d = p.memory, p.config, p.dims
    off = {"none": "no offload", "optimizer": "optimizer on host", "full": "params+optimizer on host"}
    lines = [f"memory     per rank: {d.model_type} {mem.params / 1e9:.2f} B params, {c.model.dtype}, "
             f"{c.parallel.sharding}, {off[c.parallel.cpu_offload]}, "
             f"{'checkpointing' if c.model.gradient_checkpointing else 'no checkpointing'}",
             f"{'':11}largest micro-batch {mem.micro_tokens:,} tokens; "
             f"generates {_plural(mem.rollout_samples, 'sample')}"
             + (f"; {mem.host_gib:.1f} GiB on the host" if mem.host_gib else "")]
    for key, gib in mem.breakdown.items():
        if gib >= 0.005:
            lines.append(f"{'':13}{key:<17}{gib:>8.2f} GiB")
    cap = f" of {mem.capacity_gib:.1f} GiB" if mem.capacity_gib else " (device memory unknown)"
    verdict = {True: "fits", False: "DOES NOT FIT", None: ""}[mem.fits]
    lines.append(f"{'':13}{'peak':<17}{mem.total_gib:>8.2f} GiB{cap}  {verdict}".rstrip())
    lines.append(f"{'':13}peak = params + optimizer + gather + reference + reserve + overhead"
                 " + max(gradients + activations + logits, KV cache)")
    return lines


# ------------------------------------------------------------------------------------------ command line

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (via the CLI), no usage dump
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="evenrl plan", description=__doc__.splitlines()[0])
    p.add_argument("config", help="evenrl YAML config (or the peer's file with --from)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.prompts_per_step=64")
    add_layout_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema evenrl.plan/1)")
    p.add_argument("--fit", action="store_true", help="print the nearest config that runs well, and its plan")
    p.add_argument("--from", dest="framework", choices=["verl", "easyr1", "trl", "openrlhf"],
                   help="read CONFIG as that framework's config and show its checks and evenrl's equivalent")
    return p


def main(argv: list[str]) -> int:
    ns = parser().parse_intermixed_args(argv)
    if ns.framework:
        from evenrl.foreign import run_foreign

        return run_foreign(ns)
    cfg = load_config(ns.config, ns.overrides)
    layout = layout_from_args(ns)
    plan = make_plan(cfg, layout)
    return report(plan, as_json=ns.json, with_fit=ns.fit, title=f"evenrl plan: {ns.config}")


def report(plan: Plan, *, as_json: bool, with_fit: bool, title: str, head: dict | None = None,
           head_text: str = "") -> int:
    """Print a plan (and with_fit: the fitted config and its plan); return the exit code."""
    final = plan
    doc = dict(head, plan=plan.to_dict()) if head else plan.to_dict()
    text = [title, head_text, render(plan)] if head_text else [title, render(plan)]
    if with_fit:
        cfg, changes = fit(plan)
        final = make_plan(cfg, plan.layout)
        doc["fit"] = {"changes": [{"key": k, "from": a, "to": b} for k, a, b in changes],
                      "config": cfg.model_dump(mode="json"), "plan": final.to_dict()}
        text.append("\n--fit: " + ("no change needed" if not changes else
                                   "; ".join(f"{k} {a} -> {b}" for k, a, b in changes)))
        text.append("fitted config (keys that differ from the defaults):\n" + minimal_yaml(cfg).rstrip())
        text.append("plan of the fitted config:\n" + render(final))
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        print("\n".join(text))
    return 0 if final.runnable else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
