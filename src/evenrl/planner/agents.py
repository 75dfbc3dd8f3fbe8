"""The planner's rules for agent rollouts (rollout.agent, docs/agents.md): the function found without importing it,
the settings the endpoint cannot serve (either engine serves it, hf or vllm), and the call and token caps against
rollout.max_trajectory_tokens. Listed in evenrl.planner.rules.RULES; torch-free like every rule."""

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
    if r.env:
        out.append(Finding("error", "agent-env", f"rollout.agent and rollout.env ({r.env}) are both set: a "
                           "trajectory comes from one of them", "rollout.env='' (or rollout.agent='')"))
    if c.parallel.sharding == "fsdp" and not c.parallel.rollout_devices:
        out.append(Finding("error", "agent-sharding", "rollout.agent with parallel.sharding=fsdp on the training "
                           "ranks: agents call at their own pace, but every call to a sharded model is a collective "
                           "all ranks must join", "parallel.rollout_devices>=1 (the endpoint on whole copies), or "
                           "parallel.sharding=replicated"))
    models = [s.model or "judge" for s in c.rewards.functions if s.model or s.judge is not None]
    if models:
        out.append(Finding("error", "agent-reward-models", f"rollout.agent with reward models or judges in "
                           f"rewards.functions ({', '.join(models)}): the agent's None reward is scored by reward "
                           "functions only", "score in the agent (return a number), or reward functions only"))
    if c.rewards.sandbox == "all":
        out.append(Finding("error", "agent-sandbox", "rollout.agent with rewards.sandbox=all: the sandbox's private "
                           "/tmp and file system view hide the endpoint's socket from the agents",
                           "rewards.sandbox=tools (the agents still run in workers of their own network namespace)"))
    if p.dims and p.dims.vision:
        out.append(Finding("error", "agent-vision", f"rollout.agent with the vision-language model "
                           f"{c.model.path}: the endpoint serves text", "a text model"))
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
