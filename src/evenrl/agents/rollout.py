"""Agent rollouts (rollout.agent): a user's async function drives the model through an OpenAI-compatible endpoint,
and its calls become trajectories, token for token (docs/agents.md).

`Agents` satisfies evenrl.rollout.source.TrajectorySource (load, generate, advance) as rollout.env's
evenrl.rollout.trajectories.Turns does, so the step, reserved rollout ranks, evaluation and every algorithm take its
trajectories as they take rollout.env's (evenrl.rollout.trajectories.make_turns picks one). Per generate: each
trajectory gets a token naming it, the agents run in the reward workers (evenrl.agents.job, contained, their
only way out the endpoint), and this thread serves their requests in batches on the engine until every agent has
returned: each request's prompt is rendered and spliced (evenrl.agents.prompts), sampled from the stream keyed
by (seed, step, prompt position, sample, the call's key), recorded, and answered in the template's tool-call format.
The recorded calls are then assembled by token prefix (evenrl.agents.calls). With rollout.partial, `advance` runs
a step of carried trajectories instead: their transcripts replayed, requests served in rounds (evenrl.agents.replay).
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from dataclasses import replace

import torch

from evenrl.agents.answers import MODEL_NAME, answer
from evenrl.agents.calls import Call
from evenrl.agents.job import AgentRunner, agent_problem
from evenrl.agents.openai_api import BadRequest, reply_message
from evenrl.agents.openai_responses import chat_request
from evenrl.agents.prompts import Prompts, Record, Turn
from evenrl.agents.replay import ROUND_WAIT_S, Transcript, from_talk, next_round, to_talk
from evenrl.agents.rows import carried_rows, score_replies, trajectory
from evenrl.agents.server import GONE, AgentServer, Pending, error
from evenrl.config import RunConfig
from evenrl.core.carry import CarryRules, step_budget
from evenrl.engines.base import Engine, Request, SamplingParams, Trajectory
from evenrl.envs.template import file_render, tokenizer_render
from evenrl.envs.toolcalls import ends_inside_call
from evenrl.errors import RunStopped, UsageError, bad, describe_error
from evenrl.isolation import pool
from evenrl.isolation.pool import Limits, run_contained
from evenrl.rewards.registry import resolve as resolve_reward

# Requests are served in batches: after the first of a batch arrives, more are taken until none has come for this
# long (agents that are between calls, running a tool, are not waited for). Batching changes speed, never tokens.
_QUIET_S = 0.01
# The worker's own limit on a job of agents: their time limit plus this, so that the agents' own timeouts fire first
# (the agent's module is imported before, when the worker loads it: evenrl.agents.job.AgentRunner).
_JOB_SLACK_S = 3.0
CUT = ("the step's token budget (rollout.tokens_per_round) ended here; the trajectory continues at the next step, "
       "its agent started again and its calls answered from its transcript (rollout.partial)")
ONE_AT_A_TIME = ("rollout.partial: a trajectory's calls must be made one at a time (the step's budget goes to them "
                 "in order)")


def user_openings(rows: list[dict]) -> list[list[dict]]:
    """Each row's prompt as one user message: what weighs and filters a row (the agent renders its own
    conversation)."""
    return [[{"role": "user", "content": r["prompt"] if isinstance(r["prompt"], str) else str(r["prompt"])}]
            for r in rows]


class Agents:
    """rollout.agent for one process: the function's spec checked, the endpoint started at the first rollout."""

    def __init__(self, cfg: RunConfig, load_openings, tokenizer=None):
        # load_openings: the trainer's reading of a prompt set as openings (evenrl.rollout.trajectories.load_openings,
        # shared with rollout.env; given by make_turns because the trainer's data reading sits above this package)
        self.cfg, self.tokenizer, self.load_openings = cfg, tokenizer, load_openings
        problem = agent_problem(cfg.rollout.agent, cfg.rollout.agent_args)
        if problem:
            raise bad("rollout.agent", cfg.rollout.agent, problem)
        # beside reward models, judges or rewards.sandbox=all: refused before anything loaded (config.compatibility)
        if file_render(cfg.model.path) is None:
            raise UsageError(f"rollout.agent: model.path {cfg.model.path} has no chat template; the endpoint renders "
                             "chat requests with it (save one with the tokenizer, or into chat_template.jinja)")
        self.server: AgentServer | None = None
        self.reward_fns = [(resolve_reward(s.name), s.weight) for s in cfg.rewards.functions if s.name]

    def load(self, tokenizer, path: str | None = None) -> tuple[list[dict], list[list[int]], list[list[dict]], int]:
        """(rows, prompt tokens, openings, rows skipped) as Turns.load gives them; a row's prompt tokens (its
        prompt as a user message, rendered) only weigh and filter it: the agent renders its own conversation."""
        self.tokenizer = tokenizer
        return self.load_openings(self.cfg, tokenizer, path, user_openings, None)

    def generate(self, engine: Engine, requests: list[Request], params: SamplingParams, *, rows: list[dict],
                 openings: list[list[dict]]) -> list[list[Trajectory]]:
        """[request][sample] trajectories, each with its split-off samples in `splits` (`rows`: each request's
        dataset row; the agent writes its own opening, so `openings` is unused: the trajectory loops' one call)."""
        if self.server is None:
            self.server = AgentServer(MODEL_NAME)
        self.prompts = Prompts(self.tokenizer, tokenizer_render(self.tokenizer), self._eos_ids())
        assert len({r.step for r in requests}) <= 1, "one step's requests: the agents' calls draw from its streams"
        step = requests[0].step if requests else 0
        records: dict[str, Record] = {}
        for req, row in zip(requests, rows):
            for s in req.sample_range(params):
                records[secrets.token_hex(16)] = Record(req.key, s, row)
        self.server.live.update(records)
        try:
            outcomes = self._run(records, engine, params, step)
        finally:  # agents that never said they returned (a worker killed) are done too: nothing more is recorded
            self.server.live.difference_update(records)
        out, at, unscored = [], iter(records.items()), []
        for req in requests:
            out.append([])
            for token, rec in (next(at) for _ in req.sample_range(params)):
                out[-1].append(trajectory(self.cfg, req.prompt, rec, outcomes[token], self._eos_ids()))
                if outcomes[token] == ("ok", None) and rec.failure is None:
                    unscored.append((out[-1][-1], rec))
        score_replies(self.cfg, self.reward_fns, self.prompts.reply_text, unscored)
        if self.cfg.rollout.router_replay == "engine":  # a trajectory without calls: its prompt's routes
            bare = [t for ts in out for t in ts if t.routes is None]
            got = self._generate(engine, params, [(t.prompt_ids, t.prompt_key, t.sample_index, 1, None, step)
                                                  for t in bare]) if bare else []
            for t, c in zip(bare, got):  # (one untrained token after the prompt: the prompt's routes cover the row)
                t.routes = c.routes[:len(t.prompt_ids)]
        return out

    # ------------------------------------------------------------------ running the agents and serving them

    def _run(self, records: dict[str, Record], engine: Engine, params: SamplingParams, step: int) -> dict:
        r, rc = self.cfg.rollout, self.cfg.rewards
        tokens = list(records)
        size = pool.workers()
        groups = [tokens[k::size] for k in range(min(size, len(tokens)))]
        jobs = [(j, 0, (self.server.socket_path, [(t, records[t].row) for t in g], MODEL_NAME, r.agent_timeout_s))
                for j, g in enumerate(groups)]
        limits = Limits(r.agent_timeout_s + _JOB_SLACK_S, r.agent_timeout_s + _JOB_SLACK_S, rc.memory_limit_mib)
        results: dict = {}

        def work():
            try:
                results.update(run_contained([AgentRunner(r.agent, r.agent_args)], jobs, limits, isolate=True,
                                             what="agent")[0])
            except BaseException as e:  # the pool itself failed: every job fails with it
                results.update({j: ("raised", f"{type(e).__name__}: {e}") for j, _, _ in jobs})
        runner = threading.Thread(target=work, name="evenrl-agents", daemon=True)
        runner.start()
        partial, released, waiting = any(rec.transcript is not None for rec in records.values()), False, []
        order, heard = {token: i for i, token in enumerate(records)}, time.monotonic()
        while runner.is_alive() or not self.server.requests.empty() or waiting:
            batch = self._take(runner)
            if partial:  # in rounds: served once every running agent waits on a call (evenrl.agents.replay)
                heard = time.monotonic() if batch else heard
                waiting += batch
                batch = next_round(waiting, records, order, late=time.monotonic() - heard > ROUND_WAIT_S
                                   or not runner.is_alive())
            if batch:
                self._serve(batch, records, engine, params, step)
                heard = time.monotonic()  # a round's wait counts from its answers
            # rollout.partial: the step's generation ends when every agent returned or is held on a call whose
            # budget is spent (never on a clock); the held calls are refused, those agents end, their trajectories
            # are carried (their transcripts), and everything they send until they return is refused
            if partial and not released and all(rec.returned or rec.held for rec in records.values()):
                released = True
                for rec in records.values():
                    if rec.held is not None:
                        rec.cut = True
                        rec.held.future.set_result(error(400, CUT))
        outcomes = {}
        for (j, _, _), group in zip(jobs, groups):
            kind, value = results.get(j, ("raised", "no answer from the worker"))
            for t, res in zip(group, value if kind == "ok" else [(kind, value)] * len(group)):
                outcomes[t] = res
        return outcomes

    def _take(self, runner: threading.Thread) -> list[Pending]:
        try:
            batch = [self.server.requests.get(timeout=0.05)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self.server.requests.get(timeout=_QUIET_S))
            except queue.Empty:
                return batch

    def _serve(self, batch: list[Pending], records: dict[str, Record], engine: Engine, params: SamplingParams,
               step: int) -> None:
        """Answer one batch: requests that cannot be sampled at once, the rest in one engine call."""
        r, cap = self.cfg.rollout, self.cfg.rollout.max_trajectory_tokens
        todo = []  # (pending, record, prompt ids, conversation, tools, root length, budget)
        for p in batch:
            rec = records.get(p.token)
            if p.kind == "returned":
                if rec is not None:
                    rec.returned = True
                continue
            if rec is None or rec.returned:  # queued before the endpoint knew (the agent returned since)
                p.future.set_result(GONE)
                continue
            if rec.cut:
                p.future.set_result(error(400, CUT))
                continue
            if rec.failure is not None:
                p.future.set_result(error(400, rec.failure))
                continue
            if len(rec.calls) + len([t for t in todo if t[1] is rec]) >= r.agent_max_calls:
                rec.failure = f"made more than {r.agent_max_calls} calls (rollout.agent_max_calls)"
                p.future.set_result(error(400, rec.failure))
                continue
            try:
                body, history = (p.body, None) if p.kind != "responses" else chat_request(p.body, rec.responses)
                if body.get("n", 1) not in (1, None):
                    raise BadRequest("n must be 1: each call is one sample (call again for another)")
                # the first given (0 is given: a 400, not the default)
                named = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
                asked = body[named] if named else r.max_new_tokens
                if not (isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1):
                    raise BadRequest(f"{named}: got {asked!r:.20}; must be an integer >= 1")
                if p.kind != "completion":
                    ids, conv, tools, root = self.prompts.chat(rec, body)
                else:
                    (ids, conv, root), tools = self.prompts.completion(rec, body), None
            except Exception as e:  # anything an agent sends is answered, never raised into the rollout
                p.future.set_result(error(400, str(e) if isinstance(e, BadRequest) else describe_error(e)))
                continue
            if root > self.cfg.data.max_prompt_tokens and root == len(ids):
                p.future.set_result(error(400, f"the prompt has {len(ids)} tokens, over data.max_prompt_tokens "
                                               f"({self.cfg.data.max_prompt_tokens})"))
                continue
            budget = min(asked, r.max_new_tokens, cap - (len(ids) - root), cap - rec.sampled)
            if budget < 1:  # the trajectory's cap is reached: an empty reply cut for length, no call recorded
                rec.truncated = True
                p.future.set_result(answer(p, rec, self.prompts.reply_text([]), 0, False, len(ids), history))
                continue
            call = None
            if rec.transcript is not None:  # rollout.partial: the call replayed, continued or new
                try:
                    if rec.held is not None or any(t[1] is rec for t in todo):
                        raise BadRequest(ONE_AT_A_TIME)
                    call = rec.transcript.call(ids, budget)
                except (BadRequest, ValueError) as e:
                    rec.failure, rec.diverged = str(e), (str(e) if isinstance(e, ValueError) else None)
                    p.future.set_result(error(400, rec.failure))
                    continue
            todo.append((p, rec, ids, conv, tools, root, budget, history, call))
        if not todo:
            return
        if todo[0][8] is not None:
            replies = self._continue(todo, engine, params)
        else:
            got = self._generate(engine, params, [(t[2], t[1].call_key(t[2]), t[1].sample, t[6], None, step)
                                                  for t in todo])
            replies = [(c.token_ids[:t[6]], c.logprobs[:t[6]], [], c.routes) for t, c in zip(todo, got)]
        for (p, rec, ids, conv, tools, root, budget, history, _), reply in zip(todo, replies):
            if reply is None:  # rollout.partial: cut by the step's budget, held open (evenrl.agents.replay)
                rec.held = p
                continue
            sampled, lps, versions, routes = reply
            eos = bool(sampled) and sampled[-1] in self.prompts.eos_ids
            text = self.prompts.reply_text(sampled)
            answered = answer(p, rec, text, len(sampled), eos, len(ids), history)
            content, calls = reply_message(text) if p.kind != "completion" else (None, [])
            cut = not eos and len(sampled) >= budget and ends_inside_call(text)
            routes = None if routes is None else routes[:len(ids) + len(sampled) - 1]  # (a reply cut to its budget)
            rec.calls.append(Call(ids, sampled, lps, eos, len(calls), versions, cut, routes))
            rec.sampled += len(sampled)
            if p.kind != "completion":  # a Responses call is a chat call: either kind continues the other
                reply = {"role": "assistant", "content": content or ""}
                if calls:
                    reply["tool_calls"] = [{"type": "function", "function": {
                        "name": tc["function"]["name"], "arguments": json.loads(tc["function"]["arguments"])}}
                        for tc in calls]
                conv = conv + [reply]
            elif conv is not None:
                conv = (conv, text)
            rec.turns.append(Turn("completion" if p.kind == "completion" else "chat", conv, tools, ids, sampled,
                                  eos, root))
            p.future.set_result(answered)

    def _generate(self, engine: Engine, params: SamplingParams, asks: list[tuple]) -> list:
        """One sample per ask (prompt ids, key, sample, most tokens, first token or None, step): in one engine call,
        or under train.reproducibility=bitwise each alone (its logits then do not depend on which came together).
        A new call's sample runs to the most tokens of its call and is cut after (its budget is not the engine's)."""
        out = []
        for g in [[a] for a in asks] if self.cfg.train.reproducibility == "bitwise" else [asks]:
            got = engine.generate([Request(ids, key, step, range(s, s + 1), first_token=first or 0,
                                           max_tokens=None if first is None else most)
                                   for ids, key, s, most, first, step in g],
                                  replace(params, max_new_tokens=max(a[3] for a in g)))
            out += [c for (c,) in got]
        return out

    def _continue(self, todo: list[tuple], engine: Engine, params: SamplingParams) -> list:
        """rollout.partial: each call's (ids, log-probs, versions, no routes), replayed from its transcript or sampled on
        within the step's budget from the token where it stopped (its stream keyed by the trajectory's birth step),
        or None where the budget ran out before it completed (evenrl.agents.replay)."""
        asks, calls = [], []
        for p, rec, ids, *_, call in todo:
            key = rec.call_key(ids)  # every call's, replayed or not: repeated prompts count the same each step
            n = rec.transcript.grant(call)
            if n > 0:
                asks.append((ids + call.ids, key, rec.sample, n, len(call.ids), rec.transcript.birth))
                calls.append((rec, call, n))
        for (rec, call, n), c in zip(calls, self._generate(engine, params, asks)):
            ids = c.token_ids[:n]
            rec.transcript.add(call, ids, c.logprobs[:n], bool(ids) and ids[-1] in self.prompts.eos_ids, n)
        return [(call.ids, call.logprobs, call.versions, None) if call.complete else None for *_, call in todo]

    def _eos_ids(self) -> set[int]:
        return {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()

    # ------------------------------------------------------------------ partial rollouts (evenrl.agents.replay)

    def advance(self, engine: Engine, prompts, records: list, ages: list[int], rules: CarryRules,
                params: SamplingParams, version: int) -> list[bool]:
        """One step of rollout.partial for these trajectories (evenrl.rollout.carry.Carried: talk None for a new one)
        under policy `version`, each at its age: every agent started on its row, its recorded calls answered from
        the transcript, the cut one sampled on, new ones sampled within the step's budget. Their tokens,
        log-probs, versions and talk (the transcript; once complete, its outcome) are set in place. Returns per
        record whether it is complete (its agent returned)."""
        if self.server is None:
            self.server = AgentServer(MODEL_NAME)
        self.prompts = Prompts(self.tokenizer, tokenizer_render(self.tokenizer), self._eos_ids())
        by: dict[str, Record] = {}
        for c, age in zip(records, ages):
            rec = by[secrets.token_hex(16)] = Record(c.position, c.sample, prompts.rows[c.row_id])
            calls = [] if c.talk is None else from_talk(c.talk, c.tokens.tolist(), c.logprobs.tolist(),
                                                        c.versions.tolist())
            rec.transcript = Transcript(calls, step_budget(rules, age), c.birth, version)
        self.server.live.update(by)
        try:
            outcomes = self._run(by, engine, params, None)
        finally:
            self.server.live.difference_update(by)
        done, unscored = [], []
        for c, (token, rec) in zip(records, by.items()):
            problem = rec.diverged or (rec.held is None and outcomes[token][0] == "ok"
                                       and rec.transcript.returned_early())
            if problem:
                raise RunStopped(f"rollout.agent {self.cfg.rollout.agent}: the trajectory of step {c.birth}, prompt "
                                 f"{c.position}, sample {c.sample}: {problem}")
            c.talk, ids, lps, versions = to_talk(rec.transcript.calls)
            c.tokens, c.logprobs = torch.tensor(ids, dtype=torch.int32), torch.tensor(lps, dtype=torch.float32)
            c.versions, c.ended = torch.tensor(versions, dtype=torch.int32), bool(rec.calls) and rec.calls[-1].finished
            if rec.held is None:  # its agent returned: complete, scored as an uncut trajectory is
                t = trajectory(self.cfg, prompts.tokens[c.row_id], rec, outcomes[token], self._eos_ids())
                done.append((c, t, rec))
                if outcomes[token] == ("ok", None) and rec.failure is None:
                    unscored.append((t, rec))
        score_replies(self.cfg, self.reward_fns, self.prompts.reply_text, unscored)
        for c, t, rec in done:
            c.talk.update(complete=True, reward=t.reward, failed=t.failed, error=t.error, failure=rec.failure,
                          truncated=rec.truncated, tool_calls=[x.tool_calls for x in rec.calls],
                          cut_calls=[x.cut for x in rec.calls])
        return [c.talk["complete"] for c in records]

    def carried_rows(self, c, prompt: list[int]) -> tuple[list[Trajectory], list[list[int]]]:
        """A complete carried trajectory (advance's) as the rows an uncut rollout makes of it (evenrl.agents.rows)."""
        return carried_rows(c, prompt, self._eos_ids())
