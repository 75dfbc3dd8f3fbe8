"""The plan's rules for rewards.functions: function names `evenrl train` would not resolve, reward models and LLM
judges whose files it would refuse, inputs longer than those models take, and a note on where they run and what
they cost per step (their memory is in evenrl.planner.memory's reward phase).

    evenrl plan CONFIG 'rewards.functions=[{model: /models/rm}, {judge: {template: "...{completion}..."}}]'

Cost, on the busiest training rank (s samples of at most p + g tokens, P' a scorer's parameters): a reward model
makes one forward, 2P' FLOPs per token; a judge prefills its prompt (template + question + completion) and decodes
its max_new_tokens, 2P' FLOPs per token of both, in one batch per step; seconds at the rates of
evenrl.planner.timing (its assumed rates or --device-tflops), a floor per forward aside.
Pure Python: never imports torch.
"""

from __future__ import annotations

import math
from pathlib import Path

from evenrl.errors import UsageError
from evenrl.models.files import check_model_dir, check_reward_model_dir
from evenrl.planner.memory import scorer_dims, scorer_params
from evenrl.planner.rank_work import share_of
from evenrl.planner.text import count_unit, plural, seconds
from evenrl.planner.timing import assumed_rates
from evenrl.planner.types import Finding, Plan
from evenrl.rewards import REGISTRY
from evenrl.rewards.judge import PARSERS
from evenrl.rewards.registry import findable


def rule_rewards(p: Plan) -> list[Finding]:
    """Reward and judge-parser names `evenrl train` would not resolve. A user function is found, not imported: its
    module may be slow or heavy to import (the planner never imports torch), so only the top-level package must
    exist."""
    out = []
    for i, spec in enumerate(p.config.rewards.functions):
        if spec.name and spec.name not in REGISTRY and (why := _unresolved(spec.name)):
            out.append(Finding("error", "reward-name", f"reward {spec.name!r} {why}",
                               f"one of {', '.join(REGISTRY)}, or 'package.module:function' importable by the "
                               "trainer"))
        if spec.judge and spec.judge.parser not in PARSERS and (why := _unresolved(spec.judge.parser)):
            out.append(Finding("error", "judge-parser", f"rewards.functions.{i}.judge.parser "
                               f"{spec.judge.parser!r} {why}", f"one of {', '.join(PARSERS)}, or "
                                                               "'package.module:function'"))
    return out


def _unresolved(name: str) -> str | None:
    """Why `name` is no 'package.module:function' the trainer could import (None when it looks importable)."""
    module, sep, attr = name.partition(":")
    if not (sep and module and attr):
        return "is neither a built-in nor 'package.module:function'"
    return None if findable(module) else f"names module {module!r}, which is not importable here (not on PYTHONPATH?)"


def rule_reward_models(p: Plan) -> list[Finding]:
    """Reward models and judges: their files (the checks the trainer runs before loading them), inputs longer than
    they take, and a note on where they run and their cost per step."""
    c, out = p.config, []
    sample = c.data.max_prompt_tokens + c.rollout.max_new_tokens
    for i, spec in enumerate(c.rewards.functions):
        field = f"rewards.functions.{i}"
        try:
            if spec.model:
                check_reward_model_dir(spec.model, f"{field}.model")
            elif spec.judge and spec.judge.model:
                if not Path(spec.judge.model).expanduser().is_dir():
                    raise UsageError(f"{field}.judge.model: {spec.judge.model!r} is not a local directory; give "
                                     "one, or a hub id (org/name)")
                check_model_dir(spec.judge.model)
        except UsageError as e:
            out.append(Finding("error", "reward-model-files", str(e),
                               "point it at a local Hugging Face directory (config.json, weights, tokenizer)"))
    scorers = scorer_dims(c, p.dims) if p.dims else []
    for spec, path, d in scorers:
        need = sample if spec.model else len(spec.judge.template) + sample + spec.judge.max_new_tokens
        if d.max_positions and need > d.max_positions:
            what = "reward model" if spec.model else "judge"
            parts = "prompt + response" if spec.model else "template + prompt + response + its own tokens"
            out.append(Finding("warning", "reward-model-length",
                               f"the {what} {path} takes {d.max_positions:,} positions, but a sample can need "
                               f"{need:,} ({parts}): such samples fail their reward (rewards.on_failure)",
                               f"rollout.max_new_tokens={max(1, c.rollout.max_new_tokens - need + d.max_positions)}"
                               "; or a model with more positions"))
    if scorers and p.layout.training_ranks >= 1:
        out.append(_cost_note(p, scorers))
    return out


def _cost_note(p: Plan, scorers) -> Finding:
    c, lay = p.config, p.layout
    t = lay.training_ranks
    s = max(1, math.ceil(c.samples_per_step() * share_of(c, lay) - 1e-9))
    sample = c.data.max_prompt_tokens + c.rollout.max_new_tokens
    rates = assumed_rates(lay, c.model.dtype, p.rates)
    parts, total = [], 0.0
    for spec, path, d in scorers:
        params, matmul, _ = scorer_params(spec, d)
        if spec.model:
            flops = 2 * matmul * s * sample
            parts.append(f"reward model {Path(path).name} ({d.model_type}, {count_unit(params)} params) scores "
                         f"{plural(s, 'sample')} of <= {sample:,} tokens")
        else:
            prompt = len(spec.judge.template) + sample
            flops = 2 * matmul * s * (prompt + spec.judge.max_new_tokens)
            parts.append(f"judge {Path(path).name} ({d.model_type}, {count_unit(params)} params, engine "
                         f"{c.rollout.engine}) reads {plural(s, 'prompt')} of <= {prompt:,} tokens and writes <= "
                         f"{plural(spec.judge.max_new_tokens, 'token')} each")
        total += flops
    where = {"fsdp": f"sharded over the {plural(t, 'training rank')} (FSDP2)",
             "replicated": f"whole on each of the {plural(t, 'training rank')}"
                           + (", in host memory outside the reward phase" if lay.device == "cuda" else "")}
    reserved = " (not on the rollout devices)" if lay.rollout_devices else ""
    mem = f"; the reward phase holds {p.memory.phases['reward']:.2f} GiB" if p.memory and \
        "reward" in p.memory.phases else ""
    return Finding("note", "reward-models",
                   f"reward phase, {where[c.parallel.sharding]}{reserved}, in {c.model.dtype}: " + "; ".join(parts)
                   + f" per step on the busiest rank: {total / 1e12:,.3g} TFLOP, est. "
                   f"{seconds(total / (rates.tflops * 1e12))} at {rates.tflops:.3g} TFLOP/s{mem}", "")
