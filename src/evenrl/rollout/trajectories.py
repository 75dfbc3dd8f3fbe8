"""Multi-turn rollouts (rollout.env): the turn loop that runs an engine and an environment in turns, token in, token
out, and the step's columns of the trajectories it makes.

A trajectory is one sample: its tokens are the prompt, then each assistant turn's tokens exactly as the engine
sampled them, then each environment turn's text (what the chat template appends: evenrl.envs.template) tokenized
alone, in order; `loss_mask` is True on the sampled tokens only and the engine's log-probs are kept for them (0 on
environment tokens). Sampled text is decoded only to hand it to the environment and to the template, never
re-tokenized.

Turns run in lockstep: turn k of every live trajectory is one engine call (one per distinct token budget), then
their environment steps run at once in the reward workers. Turn k of sample s of the prompt at position p draws
from the stream (seed, step, p, s, k) (engines.base.row_seed; turn 0 is the single-turn stream) and the environment
gets the seed keyed_seed("evenrl-env", seed, step, p, s): a trajectory is the same on any layout and placement,
and a resumed run regenerates it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from evenrl.agents.rollout import Agents
from evenrl.config import RunConfig
from evenrl.core.batch import Ragged
from evenrl.core.carry import CarryRules, step_budget
from evenrl.data.prompts import filter_by_length, load_prompts
from evenrl.distributed import collectives as dist
from evenrl.engines.base import Engine, Request, SamplingParams, Trajectory, keyed_seed
from evenrl.envs.registry import resolve
from evenrl.envs.session import EnvSession
from evenrl.envs.template import (PREFIX_FIX, TemplateDrift, check_template, env_turn_text, file_render,
                                  tokenizer_render)
from evenrl.envs.toolcalls import ends_inside_call, tool_schemas
from evenrl.errors import RunStopped, UsageError
from evenrl.rollout.source import TrajectorySource
from evenrl.rollout.talk import trajectory


@dataclass
class Live:
    traj: Trajectory
    row: dict
    prompt: list[int]
    messages: list[dict]
    history: str  # the conversation so far as the template renders it, with the generation prompt
    seed: int
    state: bytes | None = None
    step: int = 0  # the step whose streams it draws from


class Turns:
    """rollout.env's turn loop for one process: its environment, the tools' schemas and the template checked."""

    def __init__(self, cfg: RunConfig, tokenizer=None):
        self.cfg, self.tokenizer = cfg, tokenizer
        env = resolve(cfg.rollout.env)
        self.roles, self.tools = env.roles, tool_schemas(env.tools)
        # before any weights load: the template as saved in model.path, rendered without the tokenizer
        check_template(file_render(cfg.model.path), self.tools, self.roles, f"model.path {cfg.model.path}")
        self.session = EnvSession(cfg.rollout.env, cfg.rewards, env.tools)

    def load(self, tokenizer, path: str | None = None) -> tuple[list[dict], list[list[int]], list[list[dict]], int]:
        """(rows, prompt tokens, opening messages, rows skipped as longer than data.max_prompt_tokens) of data.path
        (or `path`), as evenrl.train.data.load_data reads them, the prompt being the environment's opening rendered
        with the tools and the generation prompt."""
        self.tokenizer = tokenizer
        return load_openings(self.cfg, tokenizer, path, self.session.openings, self.tools)

    def opening(self, messages: list[dict]) -> dict:
        """A new carried trajectory's talk (evenrl.rollout.talk): its opening messages and their rendering, no turn
        taken."""
        return {"messages": list(messages), "history": tokenizer_render(self.tokenizer)(messages, self.tools, True),
                "state": None, "reply": 0, "complete": False, "mask": "", "turns": 0, "reward": 0.0, "failed": False,
                "error": None, "tool_calls": 0, "tool_errors": 0, "cut_calls": 0}

    def generate(self, engine: Engine, requests: list[Request], params: SamplingParams, *, rows: list[dict],
                 openings: list[list[dict]]) -> list[list[Trajectory]]:
        """Engine.generate's [request][sample] result, as whole trajectories (`rows`, `openings`: each request's
        dataset row and opening messages)."""
        r = self.cfg.rollout
        render = tokenizer_render(self.tokenizer)
        out: list[list[Trajectory]] = []
        live: list[Live] = []
        for req, row, opening in zip(requests, rows, openings):
            history = render(opening, self.tools, True)
            out.append([])
            for s in req.sample_range(params):
                t = Trajectory(req.key, s, [], [], True)
                out[-1].append(t)
                live.append(Live(t, row, req.prompt, list(opening), history,
                                  keyed_seed("evenrl-env", params.seed, req.step, req.key, s), step=req.step))
        for turn in range(r.max_turns):  # every turn on every rank, live trajectories or not: see _sample
            replies = self._sample(engine, live, params, turn)
            calls = [(x.state, x.row, x.seed, text) for x, (_, text) in zip(live, replies)]
            results = self.env_steps(engine, calls)
            live = [x for x, (ids, text), result in zip(live, replies, results)
                    if self.close_turn(x, ids, text, result, render)]
        return out

    def advance(self, engine: Engine, prompts, records: list, ages: list[int], rules: CarryRules,
                params: SamplingParams, version: int) -> list[bool]:
        """One step of rollout.partial for these trajectories (evenrl.rollout.carry.Carried; talk None for a new one,
        which gets its opening) under policy `version`, each at its age; their tokens, log-probs, versions and talk
        updated in place. Returns per record whether it is complete.

        A step gives each trajectory B sampled tokens (core.carry.step_budget) to spend across turns: each
        sub-round, every trajectory with budget left samples its reply on (at most B left, what is left of
        max_new_tokens for the reply and of max_trajectory_tokens); a reply that ends (EOS, max_new_tokens, or the
        trajectory full) goes to the environment, whose turn is appended as in an uncut trajectory (close_turn); a
        reply cut by the budget is continued next step from the token where it stopped. Every rank makes
        rollout.max_turns engine calls a step, with samples or not (the hf engine's call gathers a sharded model, a
        collective), which is enough: a sub-round ends a turn or spends the budget.

        Reply k of a trajectory draws from the stream of its (birth step, position, sample, turn k) from its token
        position in the reply on (engines.base.Request's first_token), the environment from keyed_seed("evenrl-env",
        seed, birth, position, sample) and the state it pickled after the last turn: where and when a trajectory
        was cut changes which policy sampled a token, never which stream drew it."""
        for c in records:
            if c.talk is None:
                c.talk = self.opening(prompts.openings[c.row_id])
        r = self.cfg.rollout
        render = tokenizer_render(self.tokenizer)
        eos = self.eos_ids()
        xs = [Live(trajectory(c), prompts.rows[c.row_id], prompts.tokens[c.row_id], c.talk["messages"],
                    c.talk["history"], keyed_seed("evenrl-env", params.seed, c.birth, c.position, c.sample),
                    c.talk["state"]) for c in records]
        reply = [c.talk["reply"] for c in records]
        complete = [c.talk["complete"] for c in records]
        left = [step_budget(rules, a) for a in ages]
        before = [len(c.tokens) for c in records]
        for _ in range(r.max_turns):  # every rank as many engine calls: see above
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
            texts = [self.decode(ids[:-1] if ids and ids[-1] in eos else ids) for ids in replies]
            results = self.env_steps(engine, [(xs[i].state, xs[i].row, xs[i].seed, t) for i, t in zip(ended, texts)])
            for i, ids, text, result in zip(ended, replies, texts, results):
                complete[i] = not self.close_turn(xs[i], ids, text, result, render)
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

    def close_turn(self, x: Live, ids: list[int], text: str, result: tuple[str, object], render) -> bool:
        """After a turn's reply (its sampled `ids`, its `text`) and its environment step (`result`, as
        EnvSession.steps gives it): the trajectory's reward, counts and end; True when it goes on, the environment's
        turn appended."""
        t, (kind, value) = x.traj, result
        turn, t.turns = t.turns, t.turns + 1
        ended_with_eos = bool(ids) and ids[-1] in self.eos_ids()
        t.cut_calls += int(not ended_with_eos and len(ids) >= self.cfg.rollout.max_new_tokens and ends_inside_call(text))
        if kind != "ok":
            t.failed, t.error, t.finished = True, f"{kind}: {value}", ended_with_eos
            return False
        x.state, (messages, done, reward, calls, errors) = value
        t.reward += self.cfg.algo.turn_discount ** turn * reward
        t.tool_calls, t.tool_errors = t.tool_calls + calls, t.tool_errors + errors
        t.finished = ended_with_eos
        if done or turn + 1 == self.cfg.rollout.max_turns:
            return False
        # a reply cut at max_new_tokens goes on like one that ended: the template closes it
        eos_text = self.decode(ids[-1:]) if ended_with_eos else None
        return self._append_env_turn(x, render, text, messages, eos_text)

    def _sample(self, engine: Engine, live: list[Live], params: SamplingParams, turn: int):
        """Turn `turn` of every live trajectory: (sampled ids, reply text) each, appended to its trajectory. One
        engine call per turn on every rank, even with nothing to sample: the hf engine's call gathers a sharded
        model, a collective every rank must join as often. A trajectory whose budget (what is left of
        max_trajectory_tokens) is below the call's keeps the start of its sample: a sample's first tokens do not
        depend on how many follow."""
        r = self.cfg.rollout
        budget = [min(r.max_new_tokens, r.max_trajectory_tokens - len(x.traj.token_ids)) for x in live]
        call = replace(params, max_new_tokens=max(budget, default=r.max_new_tokens))
        if turn == 0:  # each prompt once, its samples sharing the prefill, as in a single-turn rollout
            groups: dict[int, list[int]] = {}
            for i, x in enumerate(live):
                groups.setdefault(x.traj.prompt_key, []).append(i)
            rows = list(groups.values())
            heads = [live[g[0]] for g in rows]
            res = engine.generate([Request(x.prompt, x.traj.prompt_key, x.step, range(x.traj.sample_index,
                                                                                   x.traj.sample_index + len(g)))
                                   for x, g in zip(heads, rows)], call)
            got = {i: c for g, cs in zip(rows, res) for i, c in zip(g, cs)}
        else:
            res = engine.generate([Request(x.prompt + x.traj.token_ids, x.traj.prompt_key, x.step,
                                           range(x.traj.sample_index, x.traj.sample_index + 1), turn) for x in live],
                                  call)
            got = {i: cs[0] for i, cs in enumerate(res)}
        eos = self.eos_ids()
        out = []
        for i, x in enumerate(live):
            ids, logprobs = got[i].token_ids[:budget[i]], got[i].logprobs[:budget[i]]
            if got[i].routes is not None:  # this call saw the whole trajectory so far: its routes cover all of it
                x.traj.routes = got[i].routes[:len(x.prompt) + len(x.traj.token_ids) + len(ids) - 1]
            x.traj.token_ids += ids
            x.traj.logprobs += logprobs
            x.traj.loss_mask += [True] * len(ids)
            out.append((ids, self.decode(ids[:-1] if ids and ids[-1] in eos else ids)))
        return out

    def env_steps(self, engine: Engine, calls: list) -> list:
        """This turn's environment steps. The ranks of a tensor-parallel group sample the same trajectories from
        their split model in lockstep (the engine's `lockstep` dimension): its first rank steps them and the others
        take its results, so a step that a limit ends on one rank alone cannot part the group's trajectories (nor
        its next engine call's collectives)."""
        dim = getattr(engine, "lockstep", None)
        members = dist.shape().group_of(dim, dist.rank()) if dim else None
        if not members or len(members) == 1:
            return self.session.steps(calls)
        return dist.broadcast_object(self.session.steps(calls) if members[0] == dist.rank() else None, over=dim)

    def _append_env_turn(self, x: Live, render, reply: str, messages: list[dict], eos_text: str | None) -> bool:
        """Append the environment's messages as the template renders them; False (the trajectory ends,
        unfinished) when they do not fit in rollout.max_trajectory_tokens with a token to spare."""
        x.messages += [{"role": "assistant", "content": reply}, *messages]
        try:
            text, x.history = env_turn_text(render, x.messages, self.tools, x.history, reply, eos_text)
        except TemplateDrift as e:
            raise RunStopped(f"rollout.env: {e}; use {PREFIX_FIX}") from None
        ids = self._encode(text)
        t = x.traj
        if len(t.token_ids) + len(ids) >= self.cfg.rollout.max_trajectory_tokens:
            t.finished = False
            return False
        t.token_ids += ids
        t.logprobs += [0.0] * len(ids)
        t.loss_mask += [False] * len(ids)
        return True

    def eos_ids(self) -> set[int]:
        return {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def make_turns(cfg: RunConfig) -> TrajectorySource | None:
    """The trajectory loop of the run: rollout.agent's (evenrl.agents), rollout.env's (its template checked before
    any weights load), or None for one completion per prompt."""
    if cfg.rollout.agent:
        return Agents(cfg, load_openings)
    return Turns(cfg) if cfg.rollout.env else None


def load_openings(cfg: RunConfig, tokenizer, path: str | None, openings_of, tools
                  ) -> tuple[list[dict], list[list[int]], list[list[dict]], int]:
    """(rows, prompt tokens, opening messages, rows skipped as longer than data.max_prompt_tokens) of data.path (or
    `path`): openings_of(rows) gives each row's opening messages, whose tokens are their rendering with `tools` and
    the generation prompt (rollout.env's environments and rollout.agent's user messages alike)."""
    path = path or cfg.data.path
    if not path:
        raise UsageError("data.path: empty; give a .jsonl/.parquet file or a dataset directory")
    rows = load_prompts(path, prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field,
                        extra_fields=cfg.data.extra_fields)
    openings = openings_of(rows)
    render = tokenizer_render(tokenizer)
    tokens = [list(tokenizer(render(m, tools, True), add_special_tokens=False)["input_ids"]) for m in openings]
    kept, skipped = filter_by_length(list(range(len(rows))), [len(t) for t in tokens], cfg.data.max_prompt_tokens)
    if not kept:
        raise UsageError(f"data.max_prompt_tokens: got {cfg.data.max_prompt_tokens}; the openings of all "
                         f"{len(rows)} prompts of {path} are longer (rendered with the chat template) — raise it")
    return [rows[i] for i in kept], [tokens[i] for i in kept], [openings[i] for i in kept], skipped


def trajectory_columns(samples: list[Trajectory]) -> dict:
    """The step's columns that only trajectories carry: which tokens were sampled, their count, the environment's
    reward and failures, turns and tool calls."""
    return {
        "loss_mask": Ragged.of([torch.tensor(t.loss_mask, dtype=torch.bool) for t in samples], torch.bool),
        "sampled_len": torch.tensor([sum(t.loss_mask) for t in samples], dtype=torch.long),
        "reward": torch.tensor([t.reward for t in samples], dtype=torch.float32),
        "reward_failed": torch.tensor([t.failed for t in samples], dtype=torch.bool),
        "turns": torch.tensor([t.turns for t in samples], dtype=torch.long),
        "tool_calls": torch.tensor([t.tool_calls for t in samples], dtype=torch.long),
        "tool_errors": torch.tensor([t.tool_errors for t in samples], dtype=torch.long),
        "cut_calls": torch.tensor([t.cut_calls for t in samples], dtype=torch.long),
        "error": [t.error if t.failed else None for t in samples],
        "segment": torch.tensor([t.segment for t in samples], dtype=torch.long),
        "history_breaks": torch.tensor([t.history_breaks for t in samples], dtype=torch.long),
    }


def overlong_lengths(cfg: RunConfig, rows) -> tuple[torch.Tensor, int]:
    """(each sample's length, the most it can be) as DAPO's overlong penalty weighs them: response tokens against
    rollout.max_new_tokens, or a trajectory's sampled tokens against the most its turns can sample."""
    return rows["sampled_len" if "sampled_len" in rows else "response_len"], cfg.sampled_tokens()
