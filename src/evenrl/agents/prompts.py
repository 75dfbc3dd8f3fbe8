"""A trajectory's calls to the agent endpoint as token ids: each request's prompt rendered by the chat template, and
spliced onto the trajectory's earlier calls so that sampled tokens are never re-tokenised (docs/agents.md).

A chat request continues an earlier call when its messages are that call's messages, then the reply the endpoint
gave (content and tool calls, as sent back by the agent), then new messages (tool results, a user turn). Its prompt
is then the earlier prompt ids + the sampled ids as the engine returned them + the rest tokenised alone: the
template's end of the assistant turn (after its EOS, if the reply ended with one) and everything the template
renders after that turn. That holds only if the template renders the conversation with the new messages as an
extension of the conversation up to the reply; where it does not (a thinking template that strips earlier
<think> blocks once a user message arrives), and for requests that continue nothing, the prompt is the whole
conversation rendered and tokenised, and evenrl.agents.calls makes it a sample of its own. A completions
request continues an earlier one when its prompt text starts with that prompt + the returned text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from evenrl.agents.calls import Call
from evenrl.agents.openai_api import BadRequest, same_reply, template_messages, template_tools
from evenrl.engines.base import keyed_seed

_SENTINEL = "\u2063evenrl-reply\u2063"


@dataclass
class Turn:
    """What a later request may continue: a call's conversation (chat: the messages and the reply; completion: the
    prompt text and the returned text), its ids, and the prompt length of the sample it belongs to."""

    kind: str
    conversation: object
    tools: list | None
    prompt_ids: list[int]
    ids: list[int]
    ended_with_eos: bool
    root_len: int


@dataclass
class Record:
    """One trajectory: its key, row, calls and the outcome of its agent."""

    position: int
    sample: int
    row: dict
    calls: list[Call] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    repeats: dict = field(default_factory=dict)  # prompt digest -> requests seen with it
    responses: dict = field(default_factory=dict)  # Responses API: response id -> its conversation (input, reply)
    sampled: int = 0
    truncated: bool = False  # a request found the trajectory's token cap reached
    failure: str | None = None  # set by the endpoint (calls cap) or from the agent's outcome
    returned: bool = False  # its agent returned: later calls are refused, never recorded
    # rollout.partial (evenrl.agents.replay): the trajectory's transcript; the request held open when the step's
    # budget ran out (a Pending); set once the step's generation ended with it held (its later calls refused)
    transcript: object = None
    held: object = None
    cut: bool = False
    diverged: str | None = None  # a replayed request differed from the recorded one (the run stops)

    def call_key(self, prompt_ids: list[int]) -> int:
        """The key of this request's random stream: the trajectory (position; the sample rides in the engine's
        sample index), the prompt's tokens and how many earlier requests of this trajectory had the same prompt.
        Concurrent requests of one agent get their keys whatever order they arrive in."""
        digest = hashlib.blake2b(b"".join(i.to_bytes(4, "little") for i in prompt_ids), digest_size=8).digest()
        d = int.from_bytes(digest, "little")
        repeat = self.repeats[d] = self.repeats.get(d, -1) + 1
        return keyed_seed("evenrl-agent-call", self.position, d, repeat)


class Prompts:
    """Renders requests for one tokenizer; `encode` and `render` as evenrl.rollout.trajectories uses them."""

    def __init__(self, tokenizer, render, eos_ids: set[int]):
        self.tokenizer, self.render, self.eos_ids = tokenizer, render, eos_ids

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def reply_text(self, ids: list[int]) -> str:
        return self.decode(ids[:-1] if ids and ids[-1] in self.eos_ids else ids)

    def chat(self, rec: Record, body: dict) -> tuple[list[int], object, list | None, int]:
        """(prompt ids, the conversation, tools, the prompt length of the sample it continues or starts)."""
        messages = template_messages(body.get("messages"))
        tools = template_tools(body.get("tools"))
        try:
            full = self.render(messages, tools, True)
        except Exception as e:  # a template can raise anything (raise_exception on an unknown role)
            raise BadRequest(f"the chat template cannot render these messages ({type(e).__name__}: {e})") from None
        for t in reversed(rec.turns):
            if t.kind != "chat" or t.tools != tools or not _continues(t.conversation, messages):
                continue
            base = self.render(t.conversation, tools, False)
            if full.startswith(base):
                rest = self._after_reply(t.conversation[:-1], tools, t.ended_with_eos) + full[len(base):]
                return t.prompt_ids + t.ids + self.encode(rest), messages, tools, t.root_len
            break  # the template rewrote the conversation: a sample of its own
        ids = self.encode(full)
        return ids, messages, tools, len(ids)

    def completion(self, rec: Record, body: dict) -> tuple[list[int], object, int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = list(prompt)  # token ids: taken as they are
            if not all(0 <= i < len(self.tokenizer) for i in ids):
                raise BadRequest(f"prompt token ids must lie in [0, {len(self.tokenizer)})")
            return ids, None, len(ids)
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string (or a list of token ids)")
        for t in reversed(rec.turns):
            if t.kind == "completion" and t.conversation is not None:
                before = t.conversation[0] + t.conversation[1]
                if prompt.startswith(before):
                    return t.prompt_ids + t.ids + self.encode(prompt[len(before):]), prompt, t.root_len
        ids = self.encode(prompt)
        return ids, prompt, len(ids)

    def _after_reply(self, before: list[dict], tools, ended_with_eos: bool) -> str:
        """The template's text after an assistant reply's content (its end of turn), without the EOS token's text
        when the sampled reply ended with it (the EOS id is already in the sample)."""
        probe = self.render(before + [{"role": "assistant", "content": _SENTINEL}], tools, False)
        tail = probe[probe.rindex(_SENTINEL) + len(_SENTINEL):]
        if ended_with_eos:
            for eos in self.eos_ids:
                text = self.decode([eos])
                if tail.startswith(text):
                    return tail[len(text):]
        return tail


def _continues(conversation: list[dict], messages: list[dict]) -> bool:
    """Whether `messages` are `conversation` (ending with the endpoint's reply) followed by at least one more."""
    n = len(conversation)
    return (len(messages) > n and messages[:n - 1] == conversation[:n - 1]
            and same_reply(conversation[n - 1], messages[n - 1]))
