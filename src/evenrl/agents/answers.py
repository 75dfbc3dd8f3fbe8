"""The endpoint's answer to one sampled call of rollout.agent, in the API the agent called: a chat completion, a
text completion or a Responses object (the OpenAI formats of evenrl.agents.openai_api and
evenrl.agents.openai_responses), whole or, where the request asked to stream, as server-sent events. What was
sampled is decided by evenrl.agents.rollout; this module only words it.
"""

from __future__ import annotations

import secrets

from evenrl.agents.openai_api import (chat_body, chat_chunks, completion_body, completion_chunks, finish_reason,
                                      reply_message, sse)
from evenrl.agents.openai_responses import reply_chat_message, response_body, response_events, sse_events
from evenrl.agents.prompts import Record
from evenrl.agents.server import Answer, Pending

MODEL_NAME = "evenrl-policy"


def answer(p: Pending, rec: Record, text: str, sampled: int, eos: bool, prompt_len: int,
           history: list[dict] | None = None) -> Answer:
    """The reply `text` (`sampled` tokens; `eos`: it ended by the model's EOS) to `p`, streamed if it asked. A
    Responses reply with tokens is kept in the record under its id, for a later call's previous_response_id
    (`history`: the conversation it answered)."""
    rid = f"{p.kind}-{secrets.token_hex(8)}"
    if p.kind == "responses":
        content, calls = reply_message(text)
        rid = f"resp_{secrets.token_hex(12)}"
        if sampled:  # a recorded call: kept for a later previous_response_id (as many as the calls cap allows)
            rec.responses[rid] = history + [reply_chat_message(content, calls)]
        whole = Answer(200, response_body(rid, MODEL_NAME, p.body, content, calls, eos, prompt_len, sampled))
    elif p.kind == "chat":
        content, calls = reply_message(text)
        whole = Answer(200, chat_body(rid, MODEL_NAME, content, calls, finish_reason(eos, calls), prompt_len,
                                      sampled))
    else:
        whole = Answer(200, completion_body(rid, MODEL_NAME, text, finish_reason(eos, []), prompt_len, sampled))
    return stream(p, whole)


def stream(p: Pending, whole: Answer) -> Answer:
    """`whole` as server-sent events where `p` asked to stream, else itself."""
    if not p.body.get("stream"):
        return whole
    if p.kind == "responses":
        return Answer(200, stream=sse_events(response_events(whole.body)))
    chunks = chat_chunks(whole.body) if p.kind == "chat" else completion_chunks(whole.body)
    return Answer(200, stream=sse(chunks))
