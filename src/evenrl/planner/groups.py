"""Mixed devices in one job: the training ranks by device group, each group's memory estimate at its own token
cap per micro-batch, and the findings that name a group.

    evenrl plan CONFIG --nodes "8xH100-80,8xA10-24"

train.token_cap_per_micro_batch is the cap of the devices with the most memory. A group with less memory gets the
largest cap (a whole number of worst-case samples) that its estimate fits into its memory; the schedule then
gives its ranks fewer tokens per micro-step and as many micro-steps as the others (evenrl.core.capacity). A group
that does not fit even one sample per micro-batch is an error naming the group, with the settings that make it fit
(evenrl.planner.memory_fixes.memory_fixes on that group's memory); so is the largest group when it does not fit at the
configured cap. With one kind of device there is one group and the plan is what it always was.

Speeds: where the training groups' datasheet speeds differ (evenrl.planner.cluster) and the work is split equally,
a warning points at parallel.capacity_weights=auto; with auto the plan simulates the step on the datasheet ratios,
which is where evenrl train starts before it measures.
Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import replace

from evenrl.config import RunConfig, with_settings
from evenrl.distributed.devices import DeviceGroup
from evenrl.planner.cluster import DATASHEET, achieved_rates, unknown_models
from evenrl.planner.layout import Layout
from evenrl.planner.dims import ModelDims
from evenrl.planner.memory import estimate_memory
from evenrl.planner.memory_fixes import TIGHT, memory_fixes, row_tokens, rows_that_fit, tight_fix
from evenrl.planner.text import plural, ranks_text
from evenrl.planner.types import Finding, GroupPlan, Plan


def group_layout(layout: Layout, group: DeviceGroup) -> Layout:
    """The layout as the group's ranks see it: every device like theirs (what the memory model sizes)."""
    return replace(layout, device=group.device.kind, device_memory_gib=group.device.memory_gib, devices=None)


def plan_groups(cfg: RunConfig, layout: Layout, dims: ModelDims | None) -> list[GroupPlan]:
    """Each training group's token cap and memory estimate (module docstring)."""
    groups = layout.training_groups()
    largest = max(g.device.memory_gib for g in groups)
    cap = cfg.train.token_cap_per_micro_batch
    out = []
    for g in groups:
        if dims is None:
            out.append(GroupPlan(g, cap, None))
            continue
        unit = row_tokens(cfg, dims)  # one worst-case sample under the cap
        rows = cap // unit
        lay, ranks = group_layout(layout, g), g.ranks
        est = estimate_memory(cfg, lay, dims, ranks)
        if est.fits is not False:  # a tight fit gets its fixes too (memory-tight)
            tight = est.fits and est.total_gib > TIGHT * g.device.memory_gib
            out.append(GroupPlan(g, cap, est, fixes=tuple(memory_fixes(cfg, lay, dims, ranks)) if tight else ()))
            continue
        if g.device.memory_gib < largest and rows >= 2:  # a smaller device: fewer samples per micro-batch
            fit = rows_that_fit(cfg, lay, dims, rows - 1, ranks)
            small = with_settings(cfg, {"train.token_cap_per_micro_batch": (fit or 1) * unit})
            est = estimate_memory(small, lay, dims, ranks)
            if fit:
                out.append(GroupPlan(g, small.train.token_cap_per_micro_batch, est, lowered=True))
                continue
            out.append(GroupPlan(g, small.train.token_cap_per_micro_batch, est, lowered=True,
                                 fixes=tuple(memory_fixes(small, lay, dims, ranks))))
            continue
        out.append(GroupPlan(g, cap, est, fixes=tuple(memory_fixes(cfg, lay, dims, ranks))))
    return out


def group_name(g: GroupPlan) -> str:
    """'8xA10-24 (ranks 8-15)'."""
    which = "rank" if len(g.group.ranks) == 1 else "ranks"
    return f"{g.group.label} ({which} {ranks_text(list(g.group.ranks))})"


def rule_group_memory(p: Plan) -> list[Finding]:
    """With more than one device group: each group that does not fit, and each whose token cap was lowered."""
    if len(p.groups) < 2:
        return []  # rule_memory speaks for one group
    cap, out = p.config.train.token_cap_per_micro_batch, []
    for g in p.groups:
        mem = g.memory
        if mem is None or g.fits is None:
            continue
        phase = max(mem.phases, key=mem.phases.get) if mem.phases else "the step"
        where = f"{group_name(g)}: estimated peak {mem.total_gib:.1f} GiB"
        if not g.fits:
            at = (f"even at {plural(g.token_cap, 'token')} ({_samples(p, g.token_cap)}) per micro-batch" if g.lowered
                  else f"at train.token_cap_per_micro_batch={cap:,}")
            fixes = "; ".join(f.text() + (" (fits)" if f.fits else "") for f in g.fixes)
            out.append(Finding("error", "memory-over",
                               f"{where} > {g.group.device.memory_gib:.1f} GiB device memory {at}, in {phase}",
                               f"each alone, best first: {fixes}" if fixes else
                               f"devices with more memory, or --rollout-devices for {group_name(g)}"))
        elif g.lowered:
            keep = [f for f in memory_fixes(p.config, group_layout(p.layout, g.group), p.dims, g.group.ranks)
                    if f.fits and not {"train.token_cap_per_micro_batch", "data.prompts_per_step"} & set(f.settings)]
            out.append(Finding("note", "token-cap-lowered",
                               f"{group_name(g)} with {g.group.device.memory_gib:.1f} GiB runs at most "
                               f"{g.token_cap:,} tokens per micro-batch ({_samples(p, g.token_cap)}; estimated peak "
                               f"{mem.total_gib:.1f} GiB) against {cap:,} on the others: its ranks get fewer rows "
                               "per micro-step, in as many micro-steps",
                               f"to keep {cap:,} there: {keep[0].text()}" if keep else ""))
        elif mem.total_gib > TIGHT * g.group.device.memory_gib:
            out.append(Finding("warning", "memory-tight",
                               f"{where} of {g.group.device.memory_gib:.1f} GiB (> {TIGHT:.0%}; fragmentation may "
                               "push it over)", tight_fix(list(g.fixes), g.group.device.memory_gib)))
    return out


def _samples(p: Plan, tokens: int) -> str:
    return plural(max(tokens // (p.sample_tokens + p.vision_tokens), 1), "sample")


def rule_mixed_speeds(p: Plan) -> list[Finding]:
    """Training groups whose datasheet speeds differ while every rank gets the same share."""
    c = p.config
    if c.parallel.capacity_weights is not None or p.layout.capacity_weights or len(p.groups) < 2:
        return []
    speeds = [(achieved_rates(g.group.device, c.model.dtype), g) for g in p.groups]
    known = [(s[0], g) for s, g in speeds if s]
    if len(known) < 2 or max(s for s, _ in known) < 1.2 * min(s for s, _ in known):
        return []
    (fast, fg), (slow, sg) = max(known, key=lambda x: x[0]), min(known, key=lambda x: x[0])
    return [Finding("warning", "mixed-speeds",
                    f"{group_name(fg)} computes ~{fast / slow:.1f}x as fast as {group_name(sg)} in {c.model.dtype} "
                    f"(datasheets), but every rank gets the same share: the fast ones wait",
                    "parallel.capacity_weights=auto (measured on the first steps, then balanced by)")]


def rule_unknown_models(p: Plan) -> list[Finding]:
    """--nodes naming a GPU model without a datasheet here and without its rates (often a typo of a known one)."""
    unknown = unknown_models(p.layout.rank_devices()) if p.layout.source == "--nodes" else []
    if not unknown:
        return []
    return [Finding("warning", "unknown-gpu-model",
                    f"--nodes names GPU model {', '.join(unknown)}, which evenrl has no datasheet for: its speed is "
                    f"assumed (the step-time estimate's default rates), not known",
                    f"a known model ({', '.join(DATASHEET)}), or give its rates: 8x{unknown[0]}-80@TFLOPS/GBPS")]

