"""An agent's endpoint calls as trajectories, by token prefix (docs/agents.md).

The endpoint records every call: the prompt token ids it rendered, the token ids it sampled and their log-probs.
A call whose prompt starts with an earlier call's prompt and sampled tokens continues that call's sample: what lies
between (the template's end of the assistant turn, the tool results, the next generation prompt) is appended with
loss_mask False, then the call's sampled tokens with loss_mask True. Any other call (the agent edited or dropped
history, the template rendered an earlier turn differently, two calls sent in parallel from one conversation)
starts a sample of its own. Calls are taken in the order (prompt length, prompt ids), not as they arrived, so
concurrent calls assemble the same way on every run: a continuation's prompt is always longer than the call it
continues. Sampled tokens are never re-tokenised: they are the engine's ids, as returned.

With rollout.router_replay=engine a call carries the experts each of its tokens went to (its prompt's and its
sampled ids' but the last: the engine's routes), and a sample holds its last call's: that call's prompt is the whole
sample before its tokens, so its routes cover the sample as one prefill computed them (as a multi-turn trajectory's
come from its last turn's call).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Call:
    prompt_ids: list[int]
    ids: list[int]            # sampled, as the engine returned them
    logprobs: list[float]     # the engine's, one per sampled id
    finished: bool            # ended with EOS
    tool_calls: int = 0       # tool calls read from the reply
    versions: list[int] = field(default_factory=list)  # rollout.partial: the policy version of each sampled id
    cut: bool = False         # the reply ended at its token limit inside a tool call (never made)
    routes: object = None     # rollout.router_replay=engine: [len(prompt_ids) + len(ids) - 1, MoE layers, top-k]


@dataclass
class Segment:
    """One sample: `prompt_ids`, then `token_ids` (sampled and in-between tokens) marked by `loss_mask`."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # rollout.partial: per token (a call's first for those between)
    calls: int = 0
    tool_calls: int = 0
    cut_calls: int = 0
    finished: bool = False
    routes: object = None  # rollout.router_replay=engine: the last call's, which cover the whole sample

    def whole(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add(self, call: Call) -> None:
        between = call.prompt_ids[len(self.whole()):]
        self.token_ids += between + call.ids
        self.logprobs += [0.0] * len(between) + call.logprobs
        self.loss_mask += [False] * len(between) + [True] * len(call.ids)
        self.versions += call.versions[:1] * len(between) + call.versions
        self.calls, self.tool_calls, self.finished = self.calls + 1, self.tool_calls + call.tool_calls, call.finished
        self.cut_calls += call.cut
        self.routes = call.routes


def assemble(calls: list[Call]) -> list[Segment]:
    """The samples of one trajectory's calls: each call continues the longest earlier sample its prompt extends,
    or starts one. The first sample is the one holding the first call (in prompt order)."""
    segments: list[Segment] = []
    for call in sorted(calls, key=lambda c: (len(c.prompt_ids), c.prompt_ids, c.ids)):
        best = None
        for seg in segments:
            whole = seg.whole()
            if call.prompt_ids[:len(whole)] == whole and (best is None or len(whole) > len(best.whole())):
                best = seg
        if best is None:
            best = Segment(list(call.prompt_ids))
            segments.append(best)
        best.add(call)
    return segments
