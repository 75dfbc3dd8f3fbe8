"""The OpenAI chat and completions formats as evenrl's agent endpoint speaks them (evenrl.agents.server):
request messages as the chat template takes them, a sampled reply as an assistant message with `tool_calls` (the
template's Hermes format read by evenrl.envs.toolcalls), and the response bodies and stream chunks the `openai`
client reads. Torch-free and stateless: text and dicts in, text and dicts out.
"""

from __future__ import annotations

import json
import time

from evenrl.envs.toolcalls import CLOSE, OPEN, parse_tool_calls


class BadRequest(ValueError):
    """A request the endpoint answers with 400 and this message."""


def _text(content) -> str:
    """A message's content as text: a string, None, or a list of text parts (images are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise BadRequest("message content parts other than text are not served")
            parts.append(p["text"])
        return "".join(parts)
    raise BadRequest(f"message content must be a string or a list of text parts, not {type(content).__name__}")


def _arguments(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        doc = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise BadRequest("tool_calls[].function.arguments must be a JSON object")
    return doc


def template_messages(messages) -> list[dict]:
    """OpenAI messages as the chat template renders them: content as text, an assistant's tool_calls with their
    arguments as objects (what Hermes-style templates expect), a tool message's content as text."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest("every message needs a role: system, developer, user, assistant or tool")
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"))}
        calls = m.get("tool_calls") or []
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise BadRequest("tool_calls belong to assistant messages, as a list")
            msg["tool_calls"] = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                    raise BadRequest("tool_calls[] needs function.name")
                msg["tool_calls"].append({"type": "function", "function": {"name": fn["name"],
                                                                           "arguments": _arguments(fn.get("arguments",
                                                                                                          "{}"))}})
        out.append(msg)
    return out


def template_tools(tools) -> list[dict] | None:
    """The request's tools as the template's tools= takes them (OpenAI's function schemas are the same shape)."""
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              for t in tools):
        raise BadRequest("tools must be a list of {type: function, function: {name, parameters}}")
    return tools


def reply_message(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a sampled reply: every well-formed Hermes <tool_call> as an OpenAI tool call, the
    text outside them as the content (None when only tool calls were made). A malformed call stays in the content,
    as the model wrote it."""
    calls, content, at = [], [], 0
    for call in parse_tool_calls(text):
        start = text.find(OPEN, at)
        end = text.find(CLOSE, start + len(OPEN))
        if call.error is not None or end < 0:
            break
        content.append(text[at:start])
        calls.append({"id": f"call_{len(calls)}", "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(call.arguments)}})
        at = end + len(CLOSE)
    if not calls:
        return text, []
    content.append(text[at:])
    return "".join(content).strip() or None, calls


def same_reply(sent: dict, back: dict) -> bool:
    """Whether an assistant message the agent sent back is the reply the endpoint gave (content and tool calls; ids
    and formatting of the arguments aside)."""
    def calls(m):
        return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return sent["role"] == back["role"] == "assistant" and sent["content"] == back["content"] and calls(sent) == calls(back)


def finish_reason(finished: bool, tool_calls: list) -> str:
    return ("tool_calls" if tool_calls else "stop") if finished else "length"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_body(rid: str, model: str, content, tool_calls, reason: str, prompt: int, completion: int) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "usage": usage(prompt, completion)}


def completion_body(rid: str, model: str, text: str, reason: str, prompt: int, completion: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}],
            "usage": usage(prompt, completion)}


def chat_chunks(body: dict) -> list[dict]:
    """A chat completion as stream chunks: the role, the content, the tool calls, then the finish reason."""
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    message, reason = body["choices"][0]["message"], body["choices"][0]["finish_reason"]

    def chunk(delta, finish=None):
        return head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    out = [chunk({"role": "assistant", "content": ""})]
    if message["content"]:
        out.append(chunk({"content": message["content"]}))
    if message.get("tool_calls"):
        out.append(chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(message["tool_calls"])]}))
    out.append(chunk({}, reason))
    return out


def completion_chunks(body: dict) -> list[dict]:
    choice = body["choices"][0]
    return [body | {"choices": [dict(choice, finish_reason=None)]},
            body | {"choices": [dict(choice, text="")]}]


def sse(chunks: list[dict]) -> bytes:
    """Server-sent events as the openai client reads a stream: one `data:` line per chunk, then [DONE]."""
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
