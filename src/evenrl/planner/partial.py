"""The planner's rules for partial rollouts (rollout.partial): budgets that carry nothing, drop samples or make steps
wait (what they do not run with is config.compatibility's), and an estimate for the response lengths of
rollout.response_lengths (lognormal, cut at max_new_tokens): samples and tokens in flight, their host memory, and
the generation time the budget removes from a step. Listed in evenrl.planner.rules.RULES; torch-free like every rule.

The estimate, per step in steady state (S samples drawn per step, each of length L ~ lognormal, cut at g =
max_new_tokens; B tokens per round, C = max_carry_steps; evenrl.core.carry's rules give each length its finishing
age A(L), or a drop):
  synchronous   the step decodes E[max of S lengths] steps; its rows hold E[L] tokens each: idle share
                1 - E[L] / E[max]
  partial       each step decodes B steps (more when a sample waits at its last step: E[max over S of L - C*B])
                over the samples in flight, S * E[A + 1] of them; idle share 1 - S*E[L] / (rows * steps)
  held          between steps, carried samples hold S * E[sum over the steps they are carried of their tokens];
                a done sample of age A and length L holds L while the last of its n - 1 group-mates is still
                generated (E[max(A, their ages)] - A steps); 12 bytes a token (rollout.carry: int32 id, float32
                log-prob, int32 version), on the generating ranks (and trainer 0's copy with reserved rollout
                ranks), and in every checkpoint
  time          with the model's dimensions: decode steps at evenrl.planner.timing's rates for the rows each
                generator holds, plus re-prefilling the carried tokens (what continuing a sample costs)
An estimate at assumed rates and lengths, printed as such, never a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from evenrl.core.carry import carry_rules, finishing_age, oldest_token_age
from evenrl.planner.memory import GIB, compute_bytes
from evenrl.planner.text import plural, seconds, size_text
from evenrl.planner.timing import assumed_rates
from evenrl.planner.types import Finding, Plan

BYTES_PER_TOKEN = 12
GRID = 2000  # lengths evaluated at most


@dataclass(frozen=True)
class PartialEstimate:
    median: int
    sigma: float
    mean_len: float         # E[min(L, g)]
    sync_steps: float       # decode steps of a synchronous step
    partial_steps: float    # decode steps of a step with partial rollouts
    rows: float             # samples generated per step (new and carried)
    held_tokens: float      # tokens of carried and waiting samples between steps
    dropped: float          # share of samples dropped (with their groups)
    sync_idle: float
    partial_idle: float
    gen_sync_s: float | None = None
    gen_partial_s: float | None = None


def _cdf(x: float, median: float, sigma: float) -> float:
    return 0.0 if x <= 0 else 0.5 * (1 + math.erf((math.log(x) - math.log(median)) / (sigma * math.sqrt(2))))


def estimate(cfg, replicas: int, dims=None, rates=None) -> PartialEstimate:
    """The module docstring's estimate for `replicas` generators (rollout devices, or the training ranks)."""
    rules, r = carry_rules(cfg), cfg.rollout
    g, n, S = rules.max_new, r.samples_per_prompt, cfg.samples_per_step()  # with env: a trajectory's sampled
    median = r.response_lengths.median or max(1, math.ceil(g / 4))
    sigma = r.response_lengths.sigma
    width = max(1, math.ceil(g / GRID))
    points = list(range(width, g, width)) + [g]
    prob, last = [], 0.0
    for x in points:  # the mass of each grid cell; a length past g is cut there
        c = 1.0 if x == g else _cdf(x, median, sigma)
        prob.append(c - last)
        last = c
    mean_len = sum(p * x for p, x in zip(prob, points))
    sync_steps = min(g, sum((1 - _cdf(x, median, sigma) ** S) * width for x in points[:-1]) + width)
    ages, held, dropped, wait_over = [], 0.0, 0.0, []
    for x, p in zip(points, prob):
        age = finishing_age(rules, x)
        dropped += p if age is None else 0.0
        lived = rules.max_carry if age is None else age  # steps it is carried after
        ages.append(lived)
        held += p * sum(min(x, (a + 1) * rules.budget) for a in range(lived))
        wait_over.append(max(0, x - rules.max_carry * rules.budget) if rules.at_limit == "wait" else 0)
    rows = S * sum(p * (a + 1) for p, a in zip(prob, ages))
    over = [sum(p for p, w in zip(prob, wait_over) if w <= y) for y in sorted(set(wait_over))]
    longest_wait = sum((1 - c ** S) * (b - a) for c, a, b in zip(over, sorted(set(wait_over)),
                                                                  sorted(set(wait_over))[1:]))
    partial_steps = max(rules.budget, longest_wait)
    # a done sample of age a waits for the last of its n - 1 group-mates: E[steps] = sum over k >= a of
    # P(some mate is older than k); it holds its whole length meanwhile
    age_cdf = [sum(p for p, a in zip(prob, ages) if a <= k) for k in range(rules.max_carry + 1)]
    held += sum(p * x * sum(1 - age_cdf[k] ** (n - 1) for k in range(a, rules.max_carry))
                for x, p, a in zip(points, prob, ages))
    est = PartialEstimate(median, sigma, mean_len, sync_steps, partial_steps, rows, S * held, dropped,
                          1 - mean_len / sync_steps, 1 - S * mean_len * (1 - dropped) / (rows * partial_steps))
    if dims is None or rates is None:
        return est
    N, c = dims.linear_params, compute_bytes(cfg.model.dtype)
    F, B, f, p = rates.tflops * 1e12, rates.gbps * 1e9, rates.floor_s, cfg.data.max_prompt_tokens
    kv = dims.layers * 2 * dims.kv_heads * dims.head_dim * c

    def decode(rows_each: float, steps: float, context: float) -> float:
        return steps * max(2 * N * rows_each / F, (c * N + rows_each * context * kv) / B, f)

    sync = (max(2 * N * math.ceil(S / n / replicas) * p / F, f)
            + decode(math.ceil(S / replicas), sync_steps, p + sync_steps / 2))
    reprefill = 2 * N * (S * held / max(rows, 1)) * rows / replicas / F  # carried tokens, prefilled again
    part = (max(2 * N * math.ceil(S / n / replicas) * p / F + reprefill, f)
            + decode(math.ceil(rows / replicas), partial_steps, p + S * held / max(rows, 1) + partial_steps / 2))
    return PartialEstimate(**{**est.__dict__, "gen_sync_s": sync, "gen_partial_s": part})


def rule_partial(p: Plan) -> list[Finding]:
    c = p.config
    r = c.rollout
    if not r.partial:
        return []
    out, off = [], "rollout.partial=false"
    rules = carry_rules(c)
    most = "sampled tokens per trajectory " if r.env else "max_new_tokens="  # what rules.max_new counts
    if rules.budget >= rules.max_new:
        return out + [Finding("warning", "partial-no-carry", f"rollout.tokens_per_round={rules.budget} >= "
                              f"{most}{rules.max_new}: every sample finishes in the step that drew it, so "
                              "partial rollouts change nothing", f"rollout.tokens_per_round="
                              f"{math.ceil(rules.max_new / 4)}; or {off}")]
    reach = rules.budget * (rules.max_carry + 1)
    longer = (f"rollout.tokens_per_round={math.ceil(rules.max_new / (rules.max_carry + 1))}; or "
              f"rollout.max_carry_steps={math.ceil(rules.max_new / rules.budget) - 1}")  # what reaches max_new
    rounds = f"{rules.budget:,} tokens a step for at most {plural(rules.max_carry + 1, 'step')}"
    if reach < rules.max_new and rules.at_limit == "drop":
        out.append(Finding("warning", "partial-drops", f"{rounds} reach {reach:,} of {most}"
                           f"{rules.max_new:,}: every sample longer is dropped with its group (at_max_carry=drop), a "
                           "bias against long answers", f"{longer}; or rollout.at_max_carry=wait"))
    note, est = _estimate_note(p, rules, reach)
    if est.partial_steps > 1.5 * rules.budget:
        out.append(Finding("warning", "partial-waits", f"{rounds} reach {reach:,} of {most}"
                           f"{rules.max_new:,}: a longer sample is generated to its end in its last step "
                           f"(at_max_carry=wait), so such a step decodes ~{est.partial_steps:,.0f} tokens, not "
                           f"{rules.budget:,}, for the response lengths assumed", longer))
    return out + [note]


def _estimate_note(p: Plan, rules, reach: int) -> tuple[Finding, PartialEstimate]:
    c, lay = p.config, p.layout
    replicas = lay.rollout_devices or max(lay.training_ranks, 1)
    rates = assumed_rates(lay, c.model.dtype, p.rates) if p.dims else None
    est = estimate(c, replicas, p.dims, rates)
    assumed = "" if c.rollout.response_lengths.median else ", assumed: set rollout.response_lengths"
    oldest = oldest_token_age(c.rollout.max_staleness, rules.max_carry)
    wait = (f"; a sample longer than {reach:,} tokens is generated to its end in its last step, which waits for it"
            if reach < rules.max_new and rules.at_limit == "wait" else "")
    groups = 1 - (1 - est.dropped) ** c.rollout.samples_per_prompt
    dropped = (f"; {est.dropped:.1%} of samples dropped, and with them {groups:.1%} of the groups"
               if est.dropped else "")
    timing = ""
    if est.gen_sync_s is not None:
        timing = (f"; generation est. {seconds(est.gen_sync_s)} -> {seconds(est.gen_partial_s)} a step on "
                  f"{plural(replicas, 'generator')} ({seconds(est.gen_sync_s - est.gen_partial_s)} of waiting for "
                  "the longest sample removed, re-prefilling the carried tokens counted)")
    return Finding("note", "partial-estimate", (
        f"rollout.partial: at most {rules.budget:,} new tokens a sample per step, carried up to "
        f"{plural(rules.max_carry, 'step')}{wait}{dropped}; tokens are up to {plural(oldest, 'step')} off-policy, "
        f"corrected per token (algo.importance_correction={c.algo.importance_correction}). For response lengths "
        f"lognormal(median {est.median:,}, sigma {est.sigma:g}) cut at {rules.max_new:,}{assumed}: a synchronous "
        f"step decodes ~{est.sync_steps:,.0f} steps for its longest sample (its rows {est.sync_idle:.0%} idle), a "
        f"partial step ~{est.partial_steps:,.0f} over ~{est.rows:,.0f} samples in flight ({est.partial_idle:.0%} "
        f"idle){timing}; carried and waiting samples hold ~{est.held_tokens:,.0f} tokens = "
        f"{size_text(est.held_tokens * BYTES_PER_TOKEN / GIB)} of host memory on the generating ranks, and in each "
        "checkpoint"), ""), est
