"""Partial rollouts of agents (rollout.partial with rollout.agent), the logic below a run (evenrl.agents.replay): a
trajectory's step budget spent across its calls, the cut call held and continued at the next step from the token
where it stopped, the calls before it answered from the transcript without sampling, a replayed request that
differs named in one line, and the transcript as a carried sample keeps it (packed for travel and checkpoints).
The runs are in tests/test_partial_agents_runs.py."""

from __future__ import annotations

import hashlib

import pytest
import torch

from evenrl.agents.prompts import Record
from evenrl.agents.replay import Transcript, from_talk, next_round, to_talk
from evenrl.agents.server import Pending
from evenrl.rollout.carry import Carried, pack, unpack

MOST = 5  # each call's token budget


def draw(prompt: list[int], first: int, n: int) -> list[int]:
    """A keyed stream, as the engines draw: token i of a call depends on its prompt and i alone."""
    return [hashlib.blake2b(repr((prompt, i)).encode(), digest_size=2).digest()[0] % 50 + 1
            for i in range(first, first + n)]


def step(calls, budget: int | None, version: int, sampled: list[int]) -> tuple[list, bool]:
    """One step of a deterministic agent making 3 calls, each prompt the last one + its reply + a tool result (9),
    driven as the endpoint drives it: (its transcript after the step, whether the agent returned)."""
    t = Transcript(calls, budget, 1, version)
    prompt = [1, 2]
    for _ in range(3):
        call = t.call(prompt, MOST)
        n = t.grant(call)
        if n:
            sampled.append(n)
            t.add(call, draw(prompt, len(call.ids), n), [-0.5] * n, False, n)
        if not call.complete:
            return t.calls, False  # held: the step's budget is spent
        prompt = prompt + call.ids + [9]
    return t.calls, True


@pytest.mark.parametrize("budget", [1, 4, 5, 7, 15])
def test_calls_cut_at_the_step_budget_continue_where_they_stopped(budget):
    uncut, done = step([], None, 0, [])
    assert done and [len(c.ids) for c in uncut] == [MOST] * 3
    calls, steps, per_step = [], 0, []
    while True:
        sampled = []
        talk, ids, lps, versions = to_talk(calls)  # what a carried sample keeps between steps
        calls, done = step(from_talk(talk, ids, lps, versions), budget, steps, sampled)
        per_step.append(sum(sampled))
        steps += 1
        if done:
            break
    # the same tokens as the call never cut: no token drawn twice, none skipped, replayed calls never sampled
    assert [c.ids for c in calls] == [c.ids for c in uncut] and [c.prompt for c in calls] == [c.prompt for c in uncut]
    assert steps == -(-3 * MOST // budget)
    assert per_step[:-1] == [budget] * (steps - 1) and sum(per_step) == 3 * MOST  # the budget is spent whole
    tokens = [v for c in calls for v in c.versions]  # each token's version: the step that sampled it
    assert tokens == [k // budget for k in range(3 * MOST)]


def test_a_replayed_request_that_differs_is_named():
    calls, _ = step([], 7, 0, [])
    assert [c.complete for c in calls] == [True, False]  # 5 + 2 of 7: the second call cut
    t = Transcript(from_talk(*to_talk(calls)), 7, 1, 1)
    assert t.call([1, 2], MOST) is t.calls[0]  # the first call replayed: its recorded reply, nothing to sample
    assert t.grant(t.calls[0]) == 0
    with pytest.raises(ValueError, match=r"^agent is not deterministic: call 2's request differs from the recorded "
                                         r"one$"):
        t.call([1, 2, 3], MOST)
    t = Transcript(from_talk(*to_talk(calls)), 7, 1, 1)
    with pytest.raises(ValueError, match="call 1's request differs"):
        t.call([1, 2], MOST + 1)  # the same prompt with another token budget
    t = Transcript(from_talk(*to_talk(calls)), 7, 1, 1)
    t.call([1, 2], MOST)
    assert t.returned_early() == "agent is not deterministic: it returned after 1 calls where it had made 2 before"


def test_an_agents_transcript_travels_packed():
    calls, _ = step([], 7, 3, [])
    talk, ids, lps, versions = to_talk(calls)
    r = Carried(2, 1, 0, 5, 0, 0, tokens=torch.tensor(ids, dtype=torch.int32),
                logprobs=torch.tensor(lps, dtype=torch.float32), versions=torch.tensor(versions, dtype=torch.int32),
                talk=talk)
    [back] = unpack(pack([r]))
    assert back.talk == talk and back.sampled_versions() == versions == [3] * 7
    again = from_talk(back.talk, back.tokens.tolist(), back.logprobs.tolist(), back.versions.tolist())
    assert again == calls


def test_requests_are_served_in_rounds_of_every_running_agents_next_call():
    """The endpoint's batches with rollout.partial (replay.next_round): nothing until every agent that has not
    returned waits on a call or is held, then all of them in the trajectories' order, whatever order they came in;
    `late` (no request for ROUND_WAIT_S, or the agents are done) serves what is there."""
    records = {t: Record(0, k, {}) for k, t in enumerate("abcd")}
    records["b"].returned, records["c"].held = True, object()
    waiting = [Pending("d", "chat", {}, None)]
    assert next_round(waiting, records, {t: k for k, t in enumerate(records)}, False) == [] and len(waiting) == 1
    assert [p.token for p in next_round(list(waiting), records, {t: k for k, t in enumerate(records)}, True)] == ["d"]
    waiting.append(Pending("a", "chat", {}, None))
    assert [p.token for p in next_round(waiting, records, {t: k for k, t in enumerate(records)}, False)] == ["a", "d"]
    assert waiting == []
