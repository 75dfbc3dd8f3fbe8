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
The rules that produce findings live in evenrl.rules, the text form in evenrl.render; `Finding` and
`render` are importable from here too.

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
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evenrl.config import RunConfig, load_config
from evenrl.errors import ArgumentParser
from evenrl.planner.layout import Layout, add_layout_args, has_shape_flags, layout_from_args
from evenrl.planner.memory import ModelDims, MemoryEstimate, MemoryFix, dims_from_config, estimate_memory, memory_fixes, read_model_dims, with_settings
from evenrl.core.partition import lower_bound
from evenrl.planner.render import render
from evenrl.planner.rules import GROUP_ADVANTAGES, RULES, Finding
from evenrl.core.schedule import ScheduleError, make_schedule

SIMULATE_MAX = 50_000  # samples (or mini-batches x ranks) beyond which per-rank numbers are computed, not simulated
COUNT_MAX_BYTES = 512 * 1024**2  # jsonl files larger than this are not line-counted


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
    need = max(prompts, m * math.ceil(t * mrows / k))  # every rank trains and generates (>= 1 sample each)
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


# ------------------------------------------------------------------------------------------ command line

def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="evenrl plan", description=__doc__.splitlines()[0])
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
        from evenrl.planner.peers import run_foreign

        return run_foreign(ns)
    cfg = load_config(ns.config, ns.overrides)
    layout = layout_from_args(ns)
    plan = make_plan(cfg, layout)
    hint = ""
    if has_shape_flags(ns) and ns.device is None and layout.device == "cpu":  # e.g. planning a cluster on a laptop
        hint = "no GPU on this machine: planning CPU processes (--device cuda --device-memory-gib N plans GPUs)"
    return report(plan, as_json=ns.json, with_fit=ns.fit, title=f"evenrl plan: {ns.config}", head_text=hint)


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
    try:
        print(json.dumps(doc, indent=1) if as_json else "\n".join(text), flush=True)
    except BrokenPipeError:  # `evenrl plan ... | head`: the reader left early; the plan itself is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if final.runnable else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
