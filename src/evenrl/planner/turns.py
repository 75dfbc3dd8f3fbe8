"""The planner's rules for multi-turn rollouts (rollout.env): the environment's name, the chat template's prefix
property, whether the trajectory cap holds max_turns turns, how much of a trajectory the environment may take, and
settings an environment makes moot. Listed in evenrl.planner.rules.RULES; torch-free like every rule."""

from __future__ import annotations

from pathlib import Path

from evenrl.envs.registry import ENVS, unresolvable
from evenrl.envs.template import PREFIX_FIX, file_render, prefix_problem
from evenrl.planner.text import plural
from evenrl.planner.types import Finding, Plan


def rule_env(p: Plan) -> list[Finding]:
    c = p.config
    spec = c.rollout.env
    if not spec:
        return []
    why = unresolvable(spec)
    if why:
        return [Finding("error", "env-name", f"rollout.env {spec!r} {why}",
                        f"one of {', '.join(ENVS)}, or 'package.module:Name' importable by the trainer")]
    if p.dims and p.dims.vision:  # refused: config.compatibility's env-vision
        return []
    out = _template(p, spec)
    if [s.name for s in c.rewards.functions] != ["exact_match"] or c.rewards.functions[0].weight != 1.0:
        out.append(Finding("warning", "rewards-unused", f"rewards.functions are not used with rollout.env: the "
                           f"environment {spec} scores its trajectories", "score in the environment's step (a "
                           "ToolEnv's score); or rollout.env='' for single-turn rewards"))
    if c.rollout.max_staleness and c.rollout.env not in ENVS:
        out.append(Finding("note", "env-deterministic", "a resumed run regenerates in-flight trajectories from "
                           "their keys: the environment must act only on its row, its seed and the replies",
                           "use the seed reset() gets for any randomness"))
    return out


def _template(p: Plan, spec: str) -> list[Finding]:
    """The chat template of model.path checked as the trainer checks it before loading weights (there with the
    tools' schemas too): for a built-in environment with the roles it answers with; for a user's class (not imported
    here) with user and tool messages, as a warning (it may answer with one of them only)."""
    path = p.config.model.path
    if not path or not (Path(path).expanduser() / "config.json").is_file():
        return []  # rule_model reports the directory
    render = file_render(path)
    if render is None:
        return [Finding("error", "env-template", f"rollout.env needs the chat template of model.path, and {path} has "
                        "none", "save the tokenizer with a chat template into model.path (chat_template.jinja)")]
    if spec in ENVS:  # rendered without the tools' schemas: deriving them imports torch (transformers' converter)
        problem = prefix_problem(render, None, ENVS[spec].roles)
        return [Finding("error", "env-template", f"{path}: {problem}", PREFIX_FIX)] if problem else []
    problem = prefix_problem(render, None, ("user", "tool"))
    return [Finding("warning", "env-template", f"{path}: {problem} (the trainer checks it with {spec}'s roles before "
                    "loading weights)", PREFIX_FIX)] if problem else []


# The shortest tool call a reply can make that is read as one (evenrl.envs.toolcalls: Hermes format, no arguments)
SHORTEST_CALL = '<tool_call>{"name":"f"}</tool_call>'


def rule_tool_call_fits(p: Plan) -> list[Finding]:
    """rollout.env / rollout.agent: a reply of rollout.max_new_tokens that cannot hold even the shortest tool call
    (counted with model.path's tokenizer.json; tokenizers imports no torch) cuts every call the model starts before
    </tool_call>: none is ever made (the run warns, tools/cut_calls counts them)."""
    r = p.config.rollout
    tools = r.agent or (r.env and getattr(ENVS.get(r.env), "tools", True))  # a user's environment: may have some
    file = Path(p.config.model.path).expanduser() / "tokenizer.json"
    if not tools or not file.is_file():
        return []
    try:
        from tokenizers import Tokenizer

        shortest = len(Tokenizer.from_file(str(file)).encode(SHORTEST_CALL, add_special_tokens=False).ids)
    except Exception:  # a tokenizer file this library cannot read: the trainer's own check names it
        return []
    if r.max_new_tokens >= shortest:
        return []
    return [Finding("warning", "tool-call-cut", f"rollout.max_new_tokens={r.max_new_tokens} cannot hold the shortest "
                    f"tool call ({SHORTEST_CALL}: {shortest} tokens with this tokenizer): any tool call the model "
                    f"writes is cut before it closes and never made", f"rollout.max_new_tokens>={4 * shortest} "
                    "(room for a call's arguments), if the model is to call tools")]


def rule_trajectory_cap(p: Plan) -> list[Finding]:
    r = p.config.rollout
    if not r.env:
        return []
    out, fit = [], r.max_trajectory_tokens // r.max_new_tokens
    if fit < r.max_turns:
        out.append(Finding("warning", "trajectory-cap",
                           f"rollout.max_trajectory_tokens={r.max_trajectory_tokens:,} holds {plural(fit, 'turn')} of "
                           f"max_new_tokens={r.max_new_tokens:,} before any environment tokens, fewer than "
                           f"max_turns={r.max_turns}: long trajectories end cut, unfinished",
                           f"rollout.max_trajectory_tokens={2 * r.max_turns * r.max_new_tokens} (room for "
                           f"environment turns as long as the model's); or rollout.max_turns={max(1, fit)}"))
    sampled = p.config.sampled_tokens()
    env_share = 1 - sampled / r.max_trajectory_tokens
    if env_share > 0.5:
        out.append(Finding("note", "env-tokens",
                           f"the model samples at most {sampled:,} of a trajectory's {r.max_trajectory_tokens:,} "
                           f"tokens ({plural(r.max_turns, 'turn')} x {r.max_new_tokens:,}): up to "
                           f"{100 * env_share:.0f}% can be environment turns, which the plan counts in memory and "
                           "balance (forward and backward) but which carry no gradient",
                           f"rollout.max_trajectory_tokens={2 * sampled} if the environment's turns are shorter"))
    return out
