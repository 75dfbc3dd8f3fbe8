"""The planner's rules: each looks at a `Plan` and returns findings, each with the numbers and the fix.

    evenrl plan examples/plan_512x8.yaml data.prompts_per_step=2 rollout.samples_per_prompt=1 --nproc-per-node 4

Every rule in RULES runs on every plan, so all problems are reported at once. A rule is a plain torch-free
function `Plan -> list[Finding]`, here or in its topic's module, listed in RULES (and a row in tests/test_plan.py).
Here: the layout, the algorithms' settings, memory, parallelism and overlap; planner.inputs: the dataset, the model's
files and the trackers' clients; planner.batches: prompt groups, mini-batches, micro-batches and ranks; the others by
feature."""

from __future__ import annotations

import math
from pathlib import Path

from evenrl.planner.compatibility import rule_compatibility
from evenrl.planner.batches import (rule_groups, rule_idle, rule_imbalance, rule_min_rows, rule_minibatches,
                                    rule_token_cap)
from evenrl.planner.groups import rule_group_memory, rule_mixed_speeds, rule_unknown_models
from evenrl.planner.inputs import rule_data, rule_model, rule_trackers
from evenrl.planner.lora import rule_lora
from evenrl.planner.memory import PHASES, RESIDENT
from evenrl.planner.memory_fixes import TIGHT, tight_fix
from evenrl.planner.moe import rule_expert_parallel, rule_moe
from evenrl.planner.model_parallel import rule_rollout_parallel, rule_sequence_parallel
from evenrl.planner.partial import rule_partial
from evenrl.planner.reproducibility import rule_reproducibility
from evenrl.planner.rewards import rule_reward_models, rule_rewards
from evenrl.planner.tensor_parallel import rule_engine_memory, rule_tensor_parallel
from evenrl.planner.text import plural, seconds, size_text
from evenrl.planner.agents import rule_agent
from evenrl.planner.turns import rule_env, rule_tool_call_fits, rule_trajectory_cap
from evenrl.planner.types import Finding, Plan
from evenrl.planner.vision import rule_vision


def rule_layout(p: Plan) -> list[Finding]:
    lay = p.layout
    if lay.training_ranks >= 1:
        return []
    return [Finding("error", "no-training-ranks",
                    f"{plural(lay.rollout_devices, 'rollout device')} out of {lay.world}: no rank is left to train",
                    f"--rollout-devices {lay.world - 1}; or more devices (--nproc-per-node {lay.rollout_devices + 1})")]


def rule_capacity_weights(p: Plan) -> list[Finding]:
    t = p.layout.training_ranks
    w = p.layout.capacity_weights or p.config.parallel.fixed_capacity_weights()
    where = "--capacity-weights" if p.layout.capacity_weights else "parallel.capacity_weights"
    if not w or t < 1:
        return []
    if len(w) != t:
        ones = ",".join(["1"] * t) if t <= 16 else f"1,...,1 ({t} numbers)"
        example = f"--capacity-weights {ones}" if where.startswith("--") else f"{where}=[{ones}]"
        return [Finding("error", "capacity-weights",
                        f"{where} has {plural(len(w), 'weight')} for {plural(t, 'training rank')}",
                        f"give one weight per training rank, e.g. {example}; or drop it")]
    # The flags and the config refuse such weights; a Layout built in code can still carry them.
    if not all(x > 0 and math.isfinite(x) for x in w):
        return [Finding("error", "capacity-weights", f"{where}={list(w)} has a weight <= 0",
                        "every weight must be a positive relative speed, e.g. 1 or 2")]
    return []


def rule_algorithms(p: Plan) -> list[Finding]:
    """Settings of dynamic sampling, the overlong penalty and the critic that cannot work as given."""
    c, out = p.config, []
    if c.algo.filter_groups and c.algo.advantage in ("reinforce_pp", "gae"):
        out.append(Finding("note", "filter-per-token",
                           f"algo.filter_groups with {c.algo.advantage}: groups are still filtered by their rewards, "
                           "though this advantage does not compare a prompt's samples", "algo.filter_groups=false"))
    if c.rewards.overlong_buffer > c.sampled_tokens():
        what = ("the most a trajectory's turns sample" if c.multi_turn() else "rollout.max_new_tokens")
        out.append(Finding("error", "overlong-buffer",
                           f"rewards.overlong_buffer={c.rewards.overlong_buffer} is longer than "
                           f"{what} ({c.sampled_tokens()})",
                           f"rewards.overlong_buffer<={c.sampled_tokens()} (DAPO: 4096 of 20480)"))
    if c.algo.advantage == "gae" and c.critic.path and not Path(c.critic.path).expanduser().is_dir():
        out.append(Finding("error", "critic-path", f"critic.path {c.critic.path!r} is not a local directory "
                           "nor a hub id", "critic.path='' (the policy's weights), a local directory or a hub id "
                                           "(org/name)"))
    if c.algo.advantage != "gae" and c.critic.path:
        out.append(Finding("warning", "critic-unused", f"critic.path is set but algo.advantage={c.algo.advantage} "
                           "trains no critic", "algo.advantage=gae; or critic.path=''"))
    return out


def rule_memory(p: Plan) -> list[Finding]:
    c, lay, mem = p.config, p.layout, p.memory
    if len(p.groups) > 1:
        return []  # each device group has its own: evenrl.planner.groups.rule_group_memory
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
    # the parts of the phase that sets the peak: what a fix has to shrink
    phase = max(mem.phases, key=mem.phases.get) if mem.phases else ""
    keys = set(RESIDENT) | set(PHASES.get(phase, mem.breakdown))
    top = sorted(((v, k) for k, v in mem.breakdown.items() if v >= 0.05 and k in keys), reverse=True)[:4]
    parts = ", ".join(f"{k} {v:.1f}" for v, k in top)
    if not mem.fits:
        fixes = "; ".join(f.text() + (" (fits)" if f.fits else "") for f in p.memory_fixes)
        return [Finding("error", "memory-over",
                        f"estimated peak {mem.total_gib:.1f} GiB per rank > {lay.device_memory_gib:.1f} GiB "
                        f"device memory in {phase or 'the step'} ({parts} GiB)",
                        f"each alone, best first: {fixes}" if fixes else "use devices with more memory")]
    if mem.total_gib > TIGHT * lay.device_memory_gib:
        return [Finding("warning", "memory-tight", f"estimated peak {mem.total_gib:.1f} GiB of "
                        f"{lay.device_memory_gib:.1f} GiB per rank (> {TIGHT:.0%}; fragmentation may push it over)",
                        tight_fix(p.memory_fixes, lay.device_memory_gib))]
    return []


def rule_parallel(p: Plan) -> list[Finding]:
    c, lay, out = p.config, p.layout, []
    if c.parallel.sharding == "fsdp" and lay.training_ranks == 1 and c.parallel.cpu_offload == "none":
        out.append(Finding("note", "fsdp-one-rank", "sharding=fsdp over 1 training rank shards nothing "
                           "(it still gathers each block before use)", "parallel.sharding=replicated, or more ranks"))
    if lay.rollout_devices and lay.training_ranks >= 1 and not c.rollout.max_staleness:
        r, t = lay.rollout_devices, lay.training_ranks
        out.append(Finding("note", "rollout-reserved",
                           f"reserved placement is synchronous: {plural(t, 'training rank')} wait{'s' if t == 1 else ''} while "
                           f"{plural(r, 'rollout device')} generate{'s' if r == 1 else ''} the whole step, and "
                           f"{'it waits' if r == 1 else 'they wait'} while they train; a step takes ~ G/{r} + U/{t} "
                           f"against ~ G/{lay.world} + U/{lay.world} colocated (G, U: one device's generation and "
                           f"update time). Reserved pays where G is small next to U or an engine needs its own "
                           f"devices", f"--rollout-devices 0 (then {plural(lay.world, 'rank')} train and generate); "
                           "or rollout.max_staleness=1 (the next step generates while this one trains)"))
    if c.rollout.memory_fraction > 0 and c.rollout.engine == "hf":
        out.append(Finding("warning", "rollout-reserve-unused",
                           f"rollout.memory_fraction={c.rollout.memory_fraction} reserves memory for a separate "
                           "engine; engine 'hf' samples with the training model", "rollout.memory_fraction=0"))
    total = p.optimizer_steps_per_step * c.train.steps
    if c.train.warmup_steps and c.train.warmup_steps >= total:
        out.append(Finding("warning", "warmup-longer-than-run",
                           f"warmup_steps={c.train.warmup_steps} >= {plural(total, 'optimizer step')} in the whole "
                           "run: the learning rate never reaches train.lr", f"train.warmup_steps={total // 10}"))
    return out


def rule_overlap(p: Plan) -> list[Finding]:
    """Overlapping generation with training (rollout.max_staleness) on reserved rollout devices pays only where both
    sides take a similar time; the numbers are evenrl.planner.timing's estimates."""
    c, lay, ov, out = p.config, p.layout, p.overlap, []
    k = c.rollout.max_staleness  # without reserved devices: the table's staleness-needs-reserved
    if not (k and lay.rollout_devices and lay.training_ranks >= 1):
        return out
    at = ov.at if ov else None
    if at and at.saved_s < 0.10 * at.sync_s:
        best = ov.best
        gen, train = at.generation_s, at.training_s
        side = (f"generation dominates (the {plural(at.training_ranks, 'training rank')} wait)" if gen >= train else
                f"training dominates (the {plural(at.rollout_devices, 'rollout device')} wait)")
        fixes = []
        if best.rollout_devices != at.rollout_devices and best.overlapped_s < 0.95 * at.overlapped_s:
            fixes.append(f"--rollout-devices {best.rollout_devices} (parallel.rollout_devices="
                         f"{best.rollout_devices}: est. {seconds(best.overlapped_s)} per step)")
        fixes.append("rollout.max_staleness=0 (on-policy samples for about the same step time)")
        out.append(Finding("warning", "overlap-no-gain",
                           f"overlap saves an estimated {seconds(at.saved_s)} of a {seconds(at.sync_s)} step "
                           f"({100 * at.saved_s / at.sync_s:.0f}% < 10%): generation {seconds(gen)} on "
                           f"{plural(at.rollout_devices, 'rollout device')} vs training {seconds(train)} on "
                           f"{plural(at.training_ranks, 'rank')}; {side}", "; ".join(fixes)))
    corr, cap = c.algo.importance_correction, c.algo.importance_cap
    how = (f"corrected by algo.importance_correction={corr} (weights capped at {cap:g})" if corr != "none" else
           "not corrected (algo.importance_correction=none)")
    size = f" (+{size_text(k * ov.weights_gib)} per checkpoint)" if ov else ""
    out.append(Finding("note", "off-policy-overlap",
                       f"rollout.max_staleness={k}: samples are up to {plural(k, 'step')} off-policy, {how}; "
                       f"checkpoints hold {plural(k, 'earlier weight version')} in {c.model.dtype}{size}, so a "
                       "resumed run regenerates the steps in flight exactly",
                       "algo.importance_correction=stale" if corr == "none" else ""))
    return out


RULES = [rule_layout, rule_capacity_weights, rule_data, rule_model, rule_rewards, rule_reward_models, rule_groups,
         rule_algorithms, rule_minibatches, rule_min_rows, rule_idle, rule_token_cap, rule_imbalance, rule_memory,
         rule_group_memory, rule_mixed_speeds, rule_parallel, rule_overlap, rule_compatibility, rule_partial,
         rule_vision, rule_lora, rule_trackers, rule_env, rule_trajectory_cap, rule_tool_call_fits,
         rule_unknown_models, rule_agent, rule_sequence_parallel, rule_rollout_parallel, rule_tensor_parallel,
         rule_engine_memory, rule_moe, rule_expert_parallel, rule_reproducibility]
