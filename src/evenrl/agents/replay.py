"""Partial rollouts of agents (rollout.partial with rollout.agent): a trajectory's calls kept as a transcript, so
that a trajectory cut at a step's token budget continues at the next step (docs/overlap.md, docs/agents.md).

An agent is a running program, which no checkpoint holds; its transcript is data. So each step starts every
carried trajectory's agent again on its row, and the endpoint answers its calls from the transcript, in order,
without sampling (`Transcript.call`), up to the call that was cut, which then samples on from the token where it
stopped (the stream of (seed, birth step, position, sample, the call's key) from that position on), under the
step's policy. The agent must be deterministic given the same responses: a replayed request whose prompt ids or
token budget differ from the recorded one stops the run in one line naming the trajectory and the call, never
diverging silently. A step gives a trajectory rollout.tokens_per_round sampled tokens (core.carry.step_budget)
across its calls; a call whose budget is spent is held open (the agent blocked on it) until every agent of the
rank has returned or is held, which ends the step's generation: what each call samples and where it is cut follows
from step numbers, budgets and the agents' requests, never from timing. The calls of one trajectory must be made
one at a time (the budget goes to them in their order).

Torch-free: the transcript as lists, and as the JSON-able `talk` that evenrl.rollout.carry.Carried keeps beside the
transcript's sampled tokens, log-probs and versions (the calls' ids one after another).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Requests are served in rounds (next_round); a round goes ahead anyway once no request has come (nor an answer
# gone out) for this long: longer than an agent's own work between calls, as a rule; short enough that a hung agent
# costs the others seconds a call, not their time limit
ROUND_WAIT_S = 5.0


@dataclass
class Recorded:
    """One call of a carried trajectory: its prompt ids as the endpoint rendered them, its token budget, what it
    sampled so far (ids, log-probs, the policy version of each) and whether it is complete (else it was cut)."""

    prompt: list[int]
    most: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    eos: bool = False
    complete: bool = False


class Transcript:
    """A carried trajectory's calls in one step: `calls` replayed in order, then new ones recorded; `left` is what
    remains of the step's token budget (None: no limit, its last allowed step with at_max_carry=wait)."""

    def __init__(self, calls: list[Recorded], left: int | None, birth: int, version: int):
        self.calls, self.left, self.birth, self.version = calls, left, birth, version
        self.recorded = len(calls)  # calls made in earlier steps: replayed before anything new
        self.made = 0

    def call(self, prompt: list[int], most: int) -> Recorded:
        """The call this request is: the recorded one with its number, or a new one. ValueError (its line) when a
        replayed request is not the recorded one."""
        k, self.made = self.made, self.made + 1
        if k < self.recorded:
            if self.calls[k].prompt != prompt or self.calls[k].most != most:
                raise ValueError(f"agent is not deterministic: call {k + 1}'s request differs from the recorded one")
            return self.calls[k]
        self.calls.append(Recorded(list(prompt), most))
        return self.calls[-1]

    def grant(self, call: Recorded) -> int:
        """How many tokens `call` samples now: what is left of its own budget and of the step's (0: it is held)."""
        if call.complete:
            return 0
        n = call.most - len(call.ids)
        return n if self.left is None else min(n, self.left)

    def add(self, call: Recorded, ids: list[int], logprobs: list[float], eos: bool, asked: int) -> None:
        """What the engine sampled for `call` (at most `asked` tokens): spent from the step's budget; the call is
        complete at EOS, at its own budget, or where the engine stopped short of `asked`."""
        call.ids, call.logprobs = call.ids + list(ids), call.logprobs + list(logprobs)
        call.versions = call.versions + [self.version] * len(ids)
        call.eos = eos
        call.complete = eos or len(call.ids) >= call.most or len(ids) < asked
        if self.left is not None:
            self.left -= len(ids)

    def returned_early(self) -> str | None:
        """Why an agent that returned diverged: it made fewer calls than it had recorded (None: it did not)."""
        if self.made < self.recorded:
            return (f"agent is not deterministic: it returned after {self.made} calls where it had made "
                    f"{self.recorded} before")
        return None


def to_talk(calls: list[Recorded]) -> tuple[dict, list[int], list[float], list[int]]:
    """(talk, ids, log-probs, versions): the transcript as a carried sample keeps it, the calls' sampled tokens one
    after another in the flat lists."""
    talk = {"calls": [[c.prompt, c.most, len(c.ids), c.eos, c.complete] for c in calls], "complete": False}
    return (talk, [i for c in calls for i in c.ids], [x for c in calls for x in c.logprobs],
            [v for c in calls for v in c.versions])


def from_talk(talk: dict, ids: list[int], logprobs: list[float], versions: list[int]) -> list[Recorded]:
    """The transcript `to_talk` kept."""
    out, at = [], 0
    for prompt, most, n, eos, complete in talk["calls"]:
        out.append(Recorded(list(prompt), most, ids[at:at + n], logprobs[at:at + n], versions[at:at + n], eos,
                            complete))
        at += n
    return out


def next_round(waiting: list, records: dict, order: dict[str, int], late: bool) -> list:
    """The requests (evenrl.agents.server.Pending) to serve now, taken from `waiting`: all of them, in the
    trajectories' order, once every agent (records: token -> evenrl.agents.prompts.Record) that has not returned
    waits on one or is held. So a batch is the same set on every run (each agent's next call), and the engine's
    log-probs, which the loss uses for tokens of older policies, do not depend on how requests happened to arrive.
    `late`: nothing arrived for ROUND_WAIT_S (an agent busy in a tool, hung, or gone with its worker) or the agents
    are done: served as they are, so that a slow agent does not hold the others to their time limit; the tokens stay
    keyed, only the batching (fp32 rounding of the log-probs) then follows arrival."""
    asked = {p.token for p in waiting}
    if not late and any(not (rec.returned or rec.held or rec.cut or token in asked) for token, rec in records.items()):
        return []
    batch = sorted(waiting, key=lambda p: order.get(p.token, -1))
    waiting.clear()
    return batch
