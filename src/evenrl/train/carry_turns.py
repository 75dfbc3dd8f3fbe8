"""Partial rollouts of multi-turn trajectories (rollout.partial with rollout.env): a step of every in-flight
trajectory of a rank, its turn loop's state kept as data on the sample (evenrl.train.carry's Carried.talk), so it
travels from a reserved rollout rank and lies in a checkpoint like the tokens.

A step gives each trajectory B sampled tokens (core.carry.step_budget) to spend across turns: each sub-round, every
trajectory with budget left samples its reply on (at most B left, what is left of max_new_tokens for the reply and
of max_trajectory_tokens); a reply that ends (EOS, max_new_tokens, or the trajectory full) goes to the environment,
whose turn is appended as in an uncut trajectory (evenrl.train.trajectories.Turns.close_turn); a reply cut by the
budget is continued next step from the token where it stopped. Every rank makes rollout.max_turns engine calls a
step, with samples or not (the hf engine's call gathers a sharded model, a collective), which is enough: a sub-round
ends a turn or spends the budget.

Reply k of a trajectory draws from the stream of its (birth step, position, sample, turn k) from its token
position in the reply on (engines.base.Request's first_token), the environment from keyed_seed("evenrl-env", seed,
birth, position, sample) and the state it pickled after the last turn: where and when a trajectory was cut changes
which policy sampled a token, never which stream drew it.
"""

from __future__ import annotations

import base64
import json

import torch

from evenrl.core.carry import CarryRules, step_budget
from evenrl.engines.base import Engine, Request, SamplingParams, Trajectory, keyed_seed
from evenrl.envs.template import tokenizer_render
from evenrl.train.trajectories import Turns, Live


def opening(turns: Turns, messages: list[dict]) -> dict:
    """A new trajectory's talk: its opening messages and their rendering, no turn taken."""
    return {"messages": list(messages), "history": tokenizer_render(turns.tokenizer)(messages, turns.tools, True),
            "state": None, "reply": 0, "complete": False, "mask": "", "turns": 0, "reward": 0.0, "failed": False,
            "error": None, "tool_calls": 0, "tool_errors": 0, "cut_calls": 0}


def encode(talk: dict | None) -> bytes:
    """A talk as UTF-8 JSON (the environment's pickled state in base64): what pack stores as uint8."""
    if talk is None:
        return b""
    if talk.get("state") is None:  # no pickle (an agent's transcript has none): JSON as it is
        return json.dumps(talk).encode()
    return json.dumps({**talk, "state": base64.b64encode(talk["state"]).decode()}).encode()


def decode(raw: bytes) -> dict | None:
    if not raw:
        return None
    talk = json.loads(raw.decode())
    if talk.get("state") is not None:
        talk["state"] = base64.b64decode(talk["state"])
    return talk


def trajectory(r) -> Trajectory:
    """A carried sample (evenrl.train.carry.Carried with talk) as the Trajectory the uncut loop makes."""
    t = r.talk
    return Trajectory(r.position, r.sample, r.tokens.tolist(), r.logprobs.tolist(), r.ended,
                      loss_mask=[c == "1" for c in t["mask"]], reward=t["reward"], failed=t["failed"],
                      error=t["error"], turns=t["turns"], tool_calls=t["tool_calls"], tool_errors=t["tool_errors"],
                      cut_calls=t.get("cut_calls", 0))  # absent from checkpoints written before it was counted


def advance_turns(turns: Turns, engine: Engine, prompts, records: list, ages: list[int], rules: CarryRules,
                  params: SamplingParams, version: int) -> list[bool]:
    """One step of these trajectories (Carried, talk set) under policy `version`, each at its age; their tokens,
    log-probs, versions and talk updated in place. Returns per record whether it is complete."""
    r = turns.cfg.rollout
    render = tokenizer_render(turns.tokenizer)
    eos = turns.eos_ids()
    xs = [Live(trajectory(c), prompts.rows[c.row_id], prompts.tokens[c.row_id], c.talk["messages"],
                c.talk["history"], keyed_seed("evenrl-env", params.seed, c.birth, c.position, c.sample),
                c.talk["state"]) for c in records]
    reply = [c.talk["reply"] for c in records]
    complete = [c.talk["complete"] for c in records]
    left = [step_budget(rules, a) for a in ages]
    before = [len(c.tokens) for c in records]
    for _ in range(r.max_turns):  # every rank as many engine calls: see the module's docstring
        caps = [0 if complete[i] else min(r.max_new_tokens - reply[i], r.max_trajectory_tokens
                                          - len(x.traj.token_ids), r.max_new_tokens if left[i] is None else left[i])
                for i, x in enumerate(xs)]
        active = [i for i, cap in enumerate(caps) if cap > 0]
        got = engine.generate([Request(xs[i].prompt + xs[i].traj.token_ids, records[i].position, records[i].birth,
                                       range(records[i].sample, records[i].sample + 1), xs[i].traj.turns, reply[i],
                                       caps[i]) for i in active], params)
        ended = []
        for i, [c] in zip(active, got):
            t = xs[i].traj
            t.token_ids += c.token_ids
            t.logprobs += c.logprobs
            t.loss_mask += [True] * len(c.token_ids)
            reply[i] += len(c.token_ids)
            left[i] = None if left[i] is None else left[i] - len(c.token_ids)
            if c.finished or reply[i] >= r.max_new_tokens or len(t.token_ids) >= r.max_trajectory_tokens:
                ended.append(i)  # else cut by the step's budget: continued next step from here
        replies = [xs[i].traj.token_ids[len(xs[i].traj.token_ids) - reply[i]:] for i in ended]
        texts = [turns.decode(ids[:-1] if ids and ids[-1] in eos else ids) for ids in replies]
        results = turns.env_steps(engine, [(xs[i].state, xs[i].row, xs[i].seed, t) for i, t in zip(ended, texts)])
        for i, ids, text, result in zip(ended, replies, texts, results):
            complete[i] = not turns.close_turn(xs[i], ids, text, result, render)
            reply[i] = 0
    for c, x, n, rep, done in zip(records, xs, before, reply, complete):
        t = x.traj
        c.tokens = torch.tensor(t.token_ids, dtype=torch.int32)
        c.logprobs = torch.tensor(t.logprobs, dtype=torch.float32)
        c.versions = torch.cat([c.versions, torch.full((len(t.token_ids) - n,), version, dtype=torch.int32)])
        c.ended = t.finished
        c.talk = {"messages": x.messages, "history": x.history, "state": x.state, "reply": rep, "complete": done,
                  "mask": "".join("1" if m else "0" for m in t.loss_mask), "turns": t.turns, "reward": t.reward,
                  "failed": t.failed, "error": t.error, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
                  "cut_calls": t.cut_calls}
    return complete
