"""An agent's trajectory as training rows (rollout.agent): its recorded calls assembled by token prefix
(evenrl.agents.calls) into the first sample and its splits, each row carrying the agent's outcome and failure, and
the reward of an agent that returned None: rewards.functions on its last reply. evenrl.agents.rollout makes a
trajectory's record; this module turns a finished one into rows, for an uncut rollout and for a carried trajectory
completed under rollout.partial alike, so both train the same rows.
"""

from __future__ import annotations

from evenrl.agents.calls import Call, Segment, assemble
from evenrl.agents.prompts import Record
from evenrl.agents.replay import from_talk
from evenrl.config import RunConfig
from evenrl.engines.base import Trajectory
from evenrl.rewards import score_all

# the error of an agent's trajectory whose None reward rewards.functions failed to score: a reward's failure, not the
# agent's (evenrl.train.sampling leaves it to the reward warnings)
REPLY_SCORE_FAILED = "rewards.functions failed on the last reply"


def trajectory(cfg: RunConfig, prompt: list[int], rec: Record, outcome: tuple[str, object],
               eos_ids: set[int]) -> Trajectory:
    """A record whose agent returned (`outcome`: (kind, value) from its worker) as its rows, the reward the agent's
    float (0.0 where it failed; None: scored later by score_replies)."""
    kind, value = outcome
    segments = assemble(rec.calls)
    if rec.failure is None and kind != "ok":
        rec.failure = f"{kind}: {value}"
    if rec.failure is None and not segments:
        rec.failure = "the agent made no call to the endpoint"
    if rec.failure is None and len(segments) > 1 and cfg.rollout.agent_history == "refuse":
        rec.failure = (f"{len(segments) - 1} calls did not extend the conversation of an earlier call "
                       "(rollout.agent_history=refuse)")
    t = parts(rec.position, rec.sample, prompt, segments, rec.failure, rec.truncated, eos_ids)
    for part in (t, *t.splits):
        part.reward = value if kind == "ok" and isinstance(value, float) and rec.failure is None else 0.0
    if rec.failure is not None:
        print(f"evenrl: rollout.agent: trajectory (prompt {rec.position}, sample {rec.sample}) failed: "
              f"{rec.failure}", flush=True)
    return t


def parts(position: int, sample: int, prompt: list[int], segments: list[Segment], failure: str | None,
          truncated: bool, eos_ids: set[int]) -> Trajectory:
    """A trajectory's samples as rows: the first, its splits in `splits` (no reward yet)."""
    t = Trajectory(position, sample, [], [], False)
    if not segments:  # nothing sampled: one untrained token so the row exists
        t.token_ids, t.logprobs, t.loss_mask, t.prompt_ids = [min(eos_ids, default=0)], [0.0], [False], list(prompt)
    rows = [t] + [Trajectory(position, sample, [], [], False) for _ in segments[1:]]
    for part, seg in zip(rows, segments):
        part.prompt_ids, part.token_ids, part.logprobs = seg.prompt_ids, seg.token_ids, seg.logprobs
        part.loss_mask, part.turns, part.tool_calls = seg.loss_mask, seg.calls, seg.tool_calls
        part.cut_calls, part.routes = seg.cut_calls, seg.routes
        part.finished = seg.finished and not truncated
    for k, part in enumerate(rows):
        part.segment, part.history_breaks = k, (len(rows) - 1 if k == 0 else 0)
        part.failed, part.error = failure is not None, failure
    t.splits = rows[1:]
    return t


def score_replies(cfg: RunConfig, reward_fns: list, reply_text, unscored: list[tuple[Trajectory, Record]]) -> None:
    """Trajectories whose agent returned None: rewards.functions on the text of the last call's reply (calls in
    prompt order, as assembled; `reply_text`: sampled ids -> text) and the row."""
    if not unscored:
        return
    rc = cfg.rewards
    texts = [reply_text(max(rec.calls, key=lambda c: (len(c.prompt_ids), c.prompt_ids, c.ids)).ids)
             for _, rec in unscored]
    scores, stats = score_all(reward_fns, texts, [rec.row for _, rec in unscored], rc.timeout_s,
                              isolate=rc.isolate, memory_limit_mib=rc.memory_limit_mib,
                              cpu_time_limit_s=rc.cpu_time_limit_s)
    for (t, _), score, failed in zip(unscored, scores, stats["failed"]):
        for part in (t, *t.splits):
            part.reward, part.failed = score, bool(failed)
            part.error = REPLY_SCORE_FAILED if failed else None


def carried_rows(c, prompt: list[int], eos_ids: set[int]) -> tuple[list[Trajectory], list[list[int]]]:
    """A complete carried trajectory (evenrl.rollout.carry.Carried, its talk as Agents.advance left it) as the rows an
    uncut rollout makes of it, with each row's token versions."""
    talk = c.talk
    cuts = talk.get("cut_calls") or [False] * len(talk["calls"])  # absent from older checkpoints
    calls = [Call(x.prompt, x.ids, x.logprobs, x.eos, n, x.versions, cut) for x, n, cut in
             zip(from_talk(talk, c.tokens.tolist(), c.logprobs.tolist(), c.versions.tolist()), talk["tool_calls"],
                 cuts)]
    segments = assemble(calls)
    t = parts(c.position, c.sample, prompt, segments, talk["failure"], talk["truncated"], eos_ids)
    for part in (t, *t.splits):
        part.reward, part.failed, part.error = talk["reward"], talk["failed"], talk["error"]
    return [t, *t.splits], [s.versions for s in segments] or [[0]]
