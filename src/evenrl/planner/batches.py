"""The planner's rules on how a step's samples fill prompt groups, mini-batches, micro-batches and ranks: groups
that cannot compare, empty or uneven mini-batches, idle ranks, rows per micro-batch, the token cap, imbalance. Each
is a `Plan -> list[Finding]` listed in evenrl.planner.rules.RULES; a fix names the nearest setting that splits
evenly. Pure Python: never imports torch.
"""

from __future__ import annotations

import math

from evenrl.planner.text import plural
from evenrl.planner.types import Finding, Plan

GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


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
        why = (f"{plural(n, 'sample')}" if want > n else
               f"{plural(prompts, 'prompt')} (mini-batch cuts fall between prompt groups)")
        out.append(Finding("error", "empty-minibatches",
                           f"minibatches_per_step={want} but {why} make only {got}: "
                           f"{plural(want - got, 'mini-batch')} would be empty",
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
    """Smallest prompts_per_step whose smallest mini-batch gives every training rank (SP group) rows_per_rank rows."""
    c, t = p.config, p.dp_size
    m, k = c.algo.minibatches_per_step, c.rollout.samples_per_prompt
    return m * math.ceil(t * rows_per_rank / k)


def rule_idle(p: Plan) -> list[Finding]:
    c, t = p.config, p.dp_size
    idle = p.idle
    if not idle:
        return []
    mrows = c.train.min_rows_per_micro_batch
    per_mb = min(p.minibatch_sizes)
    nmb = len(p.minibatch_sizes)
    k, prompts = c.rollout.samples_per_prompt, c.data.prompts_per_step
    head = f"{plural(prompts, 'prompt')} × {plural(k, 'sample')}"
    if nmb > 1:
        head += f" in {nmb} mini-batches (smallest {per_mb})"
    why = f" with min_rows_per_micro_batch={mrows}" if mrows > 1 else ""
    if c.train.reproducibility == "bitwise" and per_mb >= t * mrows:  # rows enough; whole micro-batches too few
        cap = math.ceil(per_mb / t) * p.sample_tokens  # packed longest first: at most that many rows each
        return [Finding("warning", "idle-ranks",
                        f"{head} on {plural(t, p.unit)} leaves {plural(len(idle), p.unit.split()[-1])} idle: "
                        f"train.reproducibility=bitwise deals whole micro-batches of train.token_cap_per_micro_batch="
                        f"{c.train.token_cap_per_micro_batch} tokens, fewer than the ranks",
                        f"train.token_cap_per_micro_batch={cap}")]
    fixes = [f"data.prompts_per_step={_prompts_for(p, mrows)}"]
    need_k = math.ceil(t * mrows * nmb / prompts)
    if need_k > k:
        fixes.append(f"rollout.samples_per_prompt>={need_k}")
    fewer = c.samples_per_step() // (t * mrows)  # mini-batches that each give every rank its rows
    if 1 <= fewer < nmb:
        fixes.append(f"algo.minibatches_per_step={fewer}")
    fixes.append(f"or fewer training ranks ({max(1, per_mb // mrows)})")
    if mrows > 1:
        fixes.append("or SyncBatchNorm (CUDA, gathers statistics over ranks) with train.min_rows_per_micro_batch=1")
    idle_all = sum(1 for r in p.ranks if r.idle_minibatches == nmb)
    return [Finding("warning", "idle-ranks",
                    f"{head} on {plural(t, p.unit)}{why} leaves {plural(len(idle), p.unit.split()[-1])} idle"
                    + (f" ({idle_all} for the whole step)" if nmb > 1 and idle_all else ""),
                    ", or ".join(fixes[:-2 if mrows > 1 else -1]) + "; " + "; ".join(fixes[-2 if mrows > 1 else -1:]))]


def rule_min_rows(p: Plan) -> list[Finding]:
    c = p.config
    m, length, cap = c.train.min_rows_per_micro_batch, p.sample_tokens, c.train.token_cap_per_micro_batch
    out = []
    if p.schedule_error:
        k, mbs, prompts = c.rollout.samples_per_prompt, c.algo.minibatches_per_step, c.data.prompts_per_step
        fewer = max(1, prompts // math.ceil(m / k))  # mini-batches that each hold min_rows rows
        out.append(Finding("error", "min-rows", p.schedule_error,
                           f"data.prompts_per_step={mbs * math.ceil(m / k)} ({_prompts_for(p, m)} keeps every rank "
                           "busy)" + (f"; or algo.minibatches_per_step={fewer}" if fewer < mbs else "")))
    if m > 1 and m * length > cap:
        out.append(Finding("warning", "min-rows-token-cap",
                           f"min_rows_per_micro_batch={m} rows of up to {length:,} tokens need {m * length:,} "
                           f"tokens, above token_cap_per_micro_batch={cap:,}: such micro-batches exceed the cap",
                           f"train.token_cap_per_micro_batch={m * length}"))
    return out


def rule_token_cap(p: Plan) -> list[Finding]:
    c, length, v = p.config, p.sample_tokens, p.vision_tokens
    cap, sp = c.train.token_cap_per_micro_batch, p.sequence_parallel  # an SP group's micro-batch: sp x the cap
    if length + v <= cap * sp:
        return []
    return [Finding("warning", "token-cap-oversize",
                    f"token_cap_per_micro_batch={cap:,}{f' x {sp} ranks' if sp > 1 else ''} is below max_prompt_"
                    f"tokens + max_new_tokens = {length:,}" + (f" + {v:,} vision-encoder tokens" if v else "")
                    + ": such samples run alone as oversize micro-batches (memory follows them, not the cap)",
                    f"train.token_cap_per_micro_batch={-(-(length + v) // sp)}"
                    + (f"; or rollout.max_new_tokens={new}" if (new := cap * sp - v - c.data.max_prompt_tokens) >= 1
                       else ""))]


def rule_imbalance(p: Plan) -> list[Finding]:
    if p.imbalance is None or p.idle or p.token_caps:  # per-device caps: uneven on purpose (rule_group_memory)
        return []
    c, t = p.config, p.dp_size
    k, m = c.rollout.samples_per_prompt, len(p.minibatch_sizes) or 1
    if p.bound_ratio and p.bound_ratio > 1.05:
        return [Finding("note", "imbalance", f"the busiest rank is {100 * (p.bound_ratio - 1):.0f}% above the "
                        "partition's lower bound (capacity weights that do not match the sample counts)",
                        "parallel.capacity_weights closer to 1, or more samples per step")]
    if p.imbalance < 1.10:
        return []
    # mini-batches hold whole prompt groups: an even split needs prompts_per_step a multiple of m, and each
    # mini-batch's samples (prompts / m x k) a multiple of t
    step = m * (t // math.gcd(t, k))
    even = math.ceil(c.data.prompts_per_step / step) * step
    return [Finding("note", "imbalance",
                    f"the busiest rank does {100 * (p.imbalance - 1):.0f}% more than an even split: "
                    f"{c.samples_per_step():,} whole samples over {plural(t, p.unit.removeprefix('training '))}"
                    + (f" in {m} mini-batches" if m > 1 else "") + " cannot split evenly (others wait)",
                    f"data.prompts_per_step={even} splits evenly" if even != c.data.prompts_per_step else "")]
