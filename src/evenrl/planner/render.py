"""The text form of a plan: what `evenrl plan` prints and every run directory keeps as plan.txt.

    evenrl plan examples/plan_512x8.yaml --nproc-per-node 6

One labelled block per question a user asks before a run: where (layout), how much (step, samples), who does
what (per rank), how often (optimizer), will it fit (memory), what to change (findings). Ranks with the same
numbers share one table row, so 6 ranks and 64 ranks both fit on a screen; --json has every rank.
Pure Python: never imports torch.
"""

from __future__ import annotations

import itertools
import textwrap

from evenrl.planner.memory import PHASES, RESIDENT
from evenrl.planner.text import count_unit, plural, ranks_text, seconds, size_text
from evenrl.planner.types import Plan

WIDTH = 120  # long rows wrap here
LABEL = 11  # "optimizer  " — the label column
MAX_ROWS = 8  # distinct per-rank rows shown as a table; more are summarised as min/mean/max


def render(p: Plan) -> str:
    c, lay = p.config, p.layout
    k, prompts = c.rollout.samples_per_prompt, c.data.prompts_per_step
    sizes = p.minibatch_sizes
    mbs = f"{plural(len(sizes), 'mini-batch')} of {_range(sizes)}" if sizes else "no mini-batches"
    cap, length = c.train.token_cap_per_micro_batch, p.sample_tokens
    cost, sp = length + p.vision_tokens, p.sequence_parallel
    fits = f" ({plural(sp * cap // cost, 'sample')})" if sp * cap >= cost else " (below one sample)"
    if sp > 1:  # the cap is per rank; an SP group's micro-batch holds sp ranks' worth
        fits = f" per rank, {sp * cap:,} per SP group of {sp}{fits}"
    vision = f" + {p.vision_tokens:,} of the vision encoder's" if p.vision_tokens else ""
    out = [_row("layout", lay.describe()),
           *([_row("devices", _devices_text(p))] if lay.devices is not None else []),
           _row("step", f"{plural(prompts, 'prompt')} × {plural(k, 'sample')} = "
                        f"{plural(c.samples_per_step(), 'sample')}; {mbs}; "
                        f"{plural(c.algo.epochs_per_step, 'epoch')} over them"),
           _row("samples", f"worst case {length:,} tokens each (prompt {c.data.max_prompt_tokens:,} + "
                           + (f"trajectory {c.rollout.max_trajectory_tokens:,}: up to "
                              f"{plural(c.rollout.max_turns, 'turn')} of {c.rollout.max_new_tokens:,} new tokens"
                              if c.rollout.env else f"trajectory {c.rollout.max_trajectory_tokens:,}: up to "
                              f"{plural(c.rollout.agent_max_calls, 'call')} of {c.rollout.max_new_tokens:,} new tokens"
                              if c.rollout.agent else f"new {c.rollout.max_new_tokens:,}")
                           + f"){vision}; token cap {cap:,}{'' if sp > 1 else ' per micro-batch'}{fits}"
                           + (f"; min {c.train.min_rows_per_micro_batch} rows"
                              if c.train.min_rows_per_micro_batch > 1 else ""))]
    if (parallel := parallel_text(p)):
        out.append(_row("parallel", parallel))
    if p.ranks:
        out += _rank_lines(p)
    out += [_row("optimizer", _optimizer_text(p)), _row("", _dataset_text(p))]
    if p.memory:
        out += _memory_lines(p)
    if p.overlap and (p.overlap.at or p.layout.world > 1):  # none reserved: the best split alone
        out += _overlap_lines(p)
    counts = {lv: n for lv, n in p.counts().items() if n}
    verdict = "runnable" if p.runnable else "not runnable"
    out.append(_row("findings", (", ".join(plural(n, lv) for lv, n in counts.items()) + f"; {verdict}")
                    if counts else "none: runnable"))
    for f in p.findings:
        out += _wrap(f"{f.level.upper():<7} {f.rule}: {f.message}", "  ", " " * 10)
        for i, alt in enumerate(x for x in f.fix.split("; ") if x):
            out += _wrap(alt, " " * 10 + ("fix: " if i == 0 else "     "), " " * 17)
    return "\n".join(out)


def _row(label: str, text: str, indent: int = LABEL) -> str:
    """A labelled row, wrapped at WIDTH; continuation lines start at `indent`."""
    return "\n".join(_wrap(text, f"{label:<{LABEL}}", " " * indent))


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False,
                         break_long_words=False) or [first.rstrip()]


def _range(xs: list[int]) -> str:
    return f"{min(xs):,}" if min(xs) == max(xs) else f"{min(xs):,}..{max(xs):,}"


def _optimizer_text(p: Plan) -> str:
    c, per = p.config, p.optimizer_steps_per_step
    why = (f" ({plural(len(p.minibatch_sizes), 'mini-batch')} × {plural(c.algo.epochs_per_step, 'epoch')})"
           if c.algo.epochs_per_step > 1 else "")
    text = (f"{plural(per, 'step')} per RL step{why} × {plural(c.train.steps, 'RL step')} = "
            f"{plural(per * c.train.steps, 'optimizer step')}")
    return text


def _dataset_text(p: Plan) -> str:
    if not p.config.data.path:
        return "no dataset (data.path is empty)"
    if p.steps_per_epoch is None:
        return "dataset size unknown (rows are counted in local .jsonl and .parquet files)"
    return (f"dataset {plural(p.dataset_rows, 'row')} = {p.steps_per_epoch:,.1f} RL steps "
            f"({p.steps_per_epoch * p.optimizer_steps_per_step:,.1f} optimizer steps) per epoch")


def _devices_text(p: Plan) -> str:
    """Every rank's device by group: 'ranks 0-7 H100-80 (cuda); ranks 8-15 A10-24 (cuda), token cap 4,096'."""
    lay, caps = p.layout, {r: g.token_cap for g in p.groups for r in g.group.ranks}
    parts = []
    for g in lay.training_groups() + lay.rollout_groups():
        which = f"rank{'s' if len(g.ranks) > 1 else ''} {ranks_text(list(g.ranks))}"
        text = f"{which} {g.device.describe()}"
        if g.ranks[0] >= lay.training_ranks:
            text += ", rollout"
        elif p.token_caps:
            text += f", token cap {caps[g.ranks[0]]:,}"
        parts.append(text)
    return "; ".join(parts)


def parallel_text(p: Plan) -> str:
    """The mesh's sizes (evenrl.distributed.mesh_shape: dp x sp x tp, tp fastest) and the vLLM engines' devices,
    where any is above 1 ('' otherwise)."""
    c, lay, sp, tp, m = p.config, p.layout, p.sequence_parallel, p.tensor_parallel, p.replica
    parts = []
    if m > 1:
        groups = ", ".join(f"{g[0]}-{g[-1]}" for g in p.mesh.groups("replica")[:4])
        what = " x ".join(x for x, n in ((f"sequence parallel {sp}", sp), (f"tensor parallel {tp}", tp)) if n > 1)
        parts.append(f"{what}: {plural(p.dp_size, 'data-parallel group')} of {m} ranks "
                     f"({groups}{', ...' if p.dp_size > 4 else ''})"
                     + (f", each sample's tokens split over its {'SP ' if tp > 1 else ''}group" if sp > 1 else "")
                     + (f", each layer's heads, MLP width and vocabulary split over {tp} consecutive ranks"
                        if tp > 1 else ""))
    tp = c.rollout.tensor_parallel_size
    if tp > 1:
        devices = lay.rollout_devices or lay.world
        where = "reserved rollout devices" if lay.rollout_devices else "devices (colocated)"
        parts.append(f"vLLM tensor parallel {tp}: {plural(devices // tp, 'engine')} of {tp} devices on {devices} "
                     f"{where}, {max(1, min(lay.nproc_per_node, devices) // tp)} per node")
    return "; ".join(parts)


def _rank_lines(p: Plan) -> list[str]:
    rows, nmb = p.ranks, len(p.minibatch_sizes)
    mixed = len(p.groups) > 1 and p.replica == 1  # device labels are per rank
    device = {r: g.group.device.label for g in p.groups for r in g.group.ranks}
    # Consecutive ranks with the same numbers share a row: 64 equal ranks are one line.
    groups = [list(g) for _, g in itertools.groupby(
        rows, key=lambda r: (r.samples, r.tokens, r.idle_minibatches, device.get(r.rank) if mixed else None))]
    computed = "" if p.simulated else "   (computed, not simulated: too many samples)"
    lines = []
    if len(groups) <= MAX_ROWS:
        labels = [f"{g[0].rank}-{g[-1].rank}" if len(g) > 1 else str(g[0].rank) for g in groups]
        w = max(5, *map(len, labels))
        names = [device.get(g[0].rank, "") for g in groups] if mixed else []
        dw = max(map(len, names), default=0)
        head = f"{'device':<{dw}} " if mixed else ""
        what = "ranks" if p.replica == 1 else p.unit + "s"
        lines.append(_row(f"per {p.unit.split()[-1]}",
                          f"{what:<{w}} {head}{'samples':>9} {'est. tokens':>13}{computed}"))
        for i, (label, (r, *_)) in enumerate(zip(labels, groups)):
            idle = "" if not r.idle_minibatches else (
                "  idle" if r.idle_minibatches == nmb else f"  idle in {r.idle_minibatches} of {nmb} mini-batches")
            name = f"{names[i]:<{dw}} " if mixed else ""
            lines.append(_row("", f"{label:<{w}} {name}{r.samples:>9,} {r.tokens:>13,}{idle}"))
    else:
        s, t = [r.samples for r in rows], [r.tokens for r in rows]
        lines.append(_row(f"per {p.unit.split()[-1]}",
                          f"samples {min(s):,}..{max(s):,} (mean {sum(s) / len(s):,.1f}), est. tokens "
                          f"{min(t):,}..{max(t):,} (mean {sum(t) / len(t):,.0f}); "
                          f"{len(groups)} kinds of {p.unit.split()[-1]} (--json lists each){computed}"))
    steps = {r.micro_steps for r in rows}
    unit = p.unit.split()[-1] if p.replica == 1 else p.unit
    micro = (plural(rows[0].micro_steps, "micro-step") + " on every rank" if len(steps) == 1
             else f"{min(steps)}..{max(steps)} micro-steps per {unit}")
    per_mb = set(p.micro_steps)
    if nmb > 1:
        micro += (f" ({p.micro_steps[0]} per mini-batch)" if len(per_mb) == 1
                  else f" ({', '.join(map(str, p.micro_steps))} per mini-batch)" if nmb <= 8
                  else f" ({min(per_mb)}..{max(per_mb)} per mini-batch)")
    idle = p.idle
    parts = [micro, f"idle {unit}s: {ranks_text(idle)} ({len(idle)} of {len(rows)})" if idle else f"no idle {unit}s"]
    if p.imbalance is not None:
        bound = f" (lower bound x{p.bound_ratio:.3f})" if p.bound_ratio and p.bound_ratio >= 1.0005 else ""
        parts.append(f"busiest {unit} / even split = {p.imbalance:.3f}{bound}")
    lines.append(_row("", "; ".join(parts)))
    return lines


def _memory_lines(p: Plan) -> list[str]:
    mem, c, d = p.memory, p.config, p.dims
    off = {"none": "no offload", "full": "state offloaded to the host"}
    precision = "fp32" if c.model.dtype == "float32" else f"{c.model.dtype} compute over fp32 weights"
    if c.model.lora.rank:
        precision = (f"LoRA rank {c.model.lora.rank} (fp32 adapters{', on the experts too' if c.model.lora.experts else ''})"
                     f" on a frozen {c.model.dtype} base")
    active = f" ({count_unit(d.active_params)} active)" if d.experts else ""  # a mixture of experts
    lines = [_row("memory", f"{d.model_type} {count_unit(mem.params)} params{active}, {precision}, "
                            f"{c.parallel.sharding}, {off[c.parallel.cpu_offload]}, "
                            f"{'checkpointing' if c.model.gradient_checkpointing else 'no checkpointing'}"),
             *(_group_lines(p) if len(p.groups) > 1 else []),
             _row("", f"per rank: largest micro-batch {mem.micro_tokens:,} tokens; generates "
                      f"{plural(mem.rollout_samples, 'sample')}"
                      + (" with its TP group" if p.tensor_parallel > 1 and c.rollout.engine == "hf" else "")
                      + (f"; {mem.host_gib:.1f} GiB on the host" if mem.host_gib else ""))]
    b = mem.breakdown
    rows = [("resident", sum(b.get(k, 0.0) for k in RESIDENT), RESIDENT)]
    rows += [(phase, mem.phases[phase], keys) for phase, keys in PHASES.items() if phase in mem.phases]
    for phase, total, keys in rows:
        parts = " + ".join(f"{k} {b[k]:.2f}" for k in keys if b.get(k, 0.0) >= 0.005)
        if phase != "resident":
            parts = "resident + " + parts if parts else "resident"
        lines.append(_row("", f"  {phase:<11}{total:>9.2f} GiB  {parts}".rstrip(), indent=LABEL + 28))
    largest = max(mem.phases, key=mem.phases.get) if mem.phases else "update"
    cap = f"; device {mem.capacity_gib:.1f} GiB" if mem.capacity_gib else "; device memory unknown"
    verdict = {True: ": fits", False: ": DOES NOT FIT", None: ""}[mem.fits]
    lines.append(_row("", f"  {'peak':<11}{mem.total_gib:>9.2f} GiB  = {largest} (the largest phase)"
                          f"{cap}{verdict}"))
    return lines


def _group_lines(p: Plan) -> list[str]:
    """One row per device group: its memory, token cap and estimated peak; the breakdown below is the tightest's."""
    names = [f"{g.group.label} ({ranks_text(list(g.group.ranks))})" for g in p.groups]
    w = max(map(len, names))
    lines = [_row("", f"  {'group':<{w}} {'device':>9} {'token cap':>10} {'est. peak':>10}")]
    for name, g in zip(names, p.groups):
        peak = f"{g.memory.total_gib:>6.2f} GiB" if g.memory else f"{'?':>10}"
        verdict = {True: "fits", False: "DOES NOT FIT", None: ""}[g.fits]
        if g.lowered and g.fits:
            verdict += " (token cap lowered to fit)"
        lines.append(_row("", f"  {name:<{w}} {g.group.device.memory_gib:>5.1f} GiB {g.token_cap:>10,} "
                              f"{peak}  {verdict}".rstrip()))
    tightest = min(p.groups, key=lambda g: g.group.device.memory_gib)
    lines.append(_row("", f"  below: {tightest.group.label}, the group with the least memory"))
    return lines


def _overlap_lines(p: Plan) -> list[str]:
    ov = p.overlap
    at, best = ov.at, ov.best
    rows = _planned_split_rows(p) if at else []
    planned = ", the planned split" if at and best.rollout_devices == at.rollout_devices else ""
    rows.append(("best split", best.overlapped_s,
                 f"overlapped, {p.layout.world:,} ranks as --rollout-devices {best.rollout_devices}{planned}: "
                 f"generation {seconds(best.generation_s)}, training {seconds(best.training_s)} on "
                 f"{plural(best.training_ranks, 'rank')}"))
    mixed = len(set(p.layout.rank_devices())) > 1
    lines = [_row("overlap", f"estimates at assumed rates: {ov.rates.describe()}; --device-tflops, --device-gbps, "
                             "--link-gbps replace them" + ("; mixed devices: each side at its own devices' rates "
                                                           "(datasheets, or as --nodes gives them)" if mixed else ""))]
    lines += [_row("", f"  {name:<12}{seconds(v):>9}  {text}", indent=LABEL + 25) for name, v, text in rows]
    return lines


def _planned_split_rows(p: Plan) -> list[tuple]:
    """The planned split's generation, training, weight push and step: (name, seconds, text) rows."""
    ov, c = p.overlap, p.config
    at, k = ov.at, ov.max_staleness
    r, t = at.rollout_devices, at.training_ranks
    passes = ", ".join(f"{name} {v:g}" for name, v in ov.passes.items())
    on = "on 1 rollout device" if r == 1 else f"on each of {r:,} rollout devices"
    pushed = "of LoRA adapters" if c.model.lora.rank else f"in {c.model.dtype}"
    rows = [("generation", at.generation_s,
             f"{on}: {plural(at.samples_per_replica, 'sample')} in one batch, prefill {seconds(at.prefill_s)} + "
             f"{plural(c.rollout.max_new_tokens, 'decode step')} {seconds(at.decode_s)}"),
            ("training", at.training_s,
             f"on the busiest of {plural(t, 'training rank')}: {at.training_tokens:,} tokens x "
             f"{sum(ov.passes.values()):g} forward passes ({passes})"),
            ("weight push", at.push_s,
             f"{size_text(ov.weights_gib)} {pushed}, trainer 0 to the rollout devices, once per step")]
    if k:
        rows.append(("step", at.overlapped_s,
                     f"overlapped (max_staleness={k}) = max(generation, training) + push; synchronous "
                     f"{seconds(at.sync_s)}: {seconds(at.saved_s)} idle time removed per step "
                     f"({100 * at.saved_s / at.sync_s:.0f}%)"))
    else:
        rows.append(("step", at.sync_s,
                     f"synchronous = generation + push + training; overlapped (rollout.max_staleness=1) "
                     f"{seconds(at.overlapped_s)}: {seconds(at.saved_s)} less"))
    return rows
