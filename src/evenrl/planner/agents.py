"""The planner's rules for agent rollouts (rollout.agent, docs/agents.md): the function found without importing it,
the chat template, and the call and token caps against rollout.max_trajectory_tokens (the settings the endpoint
cannot serve beside it are config.compatibility's rows; either engine serves it, hf or vllm). Listed in
evenrl.planner.rules.RULES; torch-free like every rule."""

from __future__ import annotations

from pathlib import Path

from evenrl.agents.job import agent_problem, allowed
from evenrl.envs.template import file_render
from evenrl.errors import shown
from evenrl.planner.text import plural
from evenrl.planner.types import Finding, Plan


def rule_agent(p: Plan) -> list[Finding]:
    c = p.config
    r = c.rollout
    if not r.agent:
        return []
    out = []
    problem = agent_problem(r.agent, r.agent_args)
    if problem:
        out.append(Finding("error", "agent-name", f"rollout.agent {shown(r.agent, 40)} {problem}", allowed(r.agent)))
    path = c.model.path
    if path and (Path(path).expanduser() / "config.json").is_file() and file_render(path) is None:
        out.append(Finding("error", "agent-template", f"rollout.agent renders chat requests with the chat template "
                           f"of model.path, and {path} has none", "save the tokenizer with a chat template into "
                                                                  "model.path (chat_template.jinja)"))
    if r.max_trajectory_tokens < r.max_new_tokens:
        out.append(Finding("warning", "agent-cap", f"rollout.max_trajectory_tokens={r.max_trajectory_tokens:,} is "
                           f"below max_new_tokens={r.max_new_tokens:,}: no call gets its whole budget",
                           f"rollout.max_trajectory_tokens={r.agent_max_calls * r.max_new_tokens}"))
    elif r.agent_max_calls * r.max_new_tokens > r.max_trajectory_tokens:
        fit = r.max_trajectory_tokens // r.max_new_tokens
        out.append(Finding("note", "agent-cap", f"rollout.max_trajectory_tokens={r.max_trajectory_tokens:,} holds "
                           f"{plural(fit, 'call')} of max_new_tokens={r.max_new_tokens:,}, fewer than "
                           f"agent_max_calls={r.agent_max_calls}: later calls get shorter replies, then empty ones cut "
                           "for length", f"rollout.agent_max_calls={max(1, fit)}, or a larger "
                                         "rollout.max_trajectory_tokens"))
    if r.max_staleness:
        out.append(Finding("note", "agent-deterministic", "a resumed run regenerates in-flight trajectories from "
                           "their keys: the agent must act only on its row and the replies it gets",
                           "no clocks, no unseeded randomness, no outside state in the agent"))
    return out
