"""OpenAI's Responses API (`POST /v1/responses`) as evenrl's agent endpoint speaks it: a request becomes the chat
request it means (its `instructions` a system message first, its input items messages, an agent's echoed
`function_call` items an assistant message's tool calls, `function_call_output` items tool messages, its flat
function tools the chat form), so it is rendered, spliced and recorded exactly as a chat request is
(evenrl.agents.prompts); a sampled reply becomes a `response` object whose output is a `message` item with
an `output_text` part and a `function_call` item per tool call, whole or as the Responses stream events. What the
endpoint cannot honour (built-in tools, forced tool choices, structured output, background mode, stored
conversations of OpenAI's own) is refused with a BadRequest naming it. The shapes follow the `openai` SDK's
`openai.types.responses` models (tests/test_agents.py validates every body and event against them).
Torch-free and stateless.
"""

from __future__ import annotations

import json
import time

from evenrl.agents.openai_api import BadRequest

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _refused(body: dict) -> str | None:
    """The first setting of the request the endpoint cannot honour, as the line its 400 says."""
    if body.get("n", 1) not in (1, None):
        return "n must be 1: each call is one sample (call again for another)"
    if body.get("background"):
        return "background is not served: every response is answered when it is sampled (leave background out)"
    if body.get("conversation") is not None:
        return ("conversation is not served: the endpoint keeps no conversations; send the whole input, or "
                "previous_response_id of a response of this trajectory")
    if body.get("prompt") is not None:
        return "prompt (a stored prompt template) is not served: send the input and instructions themselves"
    if body.get("include"):
        return (f"include {body['include']!r} is not served: no reasoning, log-probs or tool outputs are returned "
                "(leave include out or empty)")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        return (f"text.format {fmt.get('type')!r} is not honoured: sampling is not constrained to a schema "
                "(the model's text comes back as it is; leave text.format out or 'text')")
    if body.get("truncation") not in (None, "disabled"):
        return "truncation 'auto' is not served: a prompt too long is refused, never cut (leave truncation out)"
    if body.get("max_tool_calls") is not None:
        return "max_tool_calls is not honoured: the model calls as many tools as it samples (leave it out)"
    if body.get("parallel_tool_calls") is False:
        return ("parallel_tool_calls false is not honoured: every tool call the model writes is returned "
                "(leave it out or true)")
    if body.get("tool_choice") not in (None, "auto"):
        return (f"tool_choice {body['tool_choice']!r} is not honoured: the model calls tools as it samples "
                "(leave tool_choice out or 'auto')")
    return None


def _text(content, where: str) -> str:
    """An item's content as text: a string or a list of input_text/output_text parts (images, files and refusals
    are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise BadRequest(f"{where} content part {kind!r} is not served: only input_text and output_text")
            out.append(p["text"])
        return "".join(out)
    raise BadRequest(f"{where} content must be a string or a list of input_text/output_text parts")


def input_messages(items) -> list[dict]:
    """A Responses `input` as chat messages: a string is one user message; message items keep their role; the
    `function_call` items an agent echoes back join the assistant message before them (or make one) as its
    tool_calls, as one reply of the endpoint held its text and its calls; `function_call_output` items are tool
    messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items")
    out: list[dict] = []
    for k, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        where = f"input[{k}]"
        if kind == "message":
            if item.get("role") not in _MESSAGE_ROLES:
                raise BadRequest(f"{where}: a message's role must be one of {', '.join(_MESSAGE_ROLES)}")
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(f), str) for f in ("call_id", "name", "arguments")):
                raise BadRequest(f"{where}: a function_call item needs call_id, name and arguments (strings)")
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}: a function_call_output item needs its call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), where)})
        else:
            raise BadRequest(f"{where}: input item type {kind!r} is not served (message, function_call and "
                             "function_call_output are; the endpoint returns no reasoning items to echo)")
    return out


def chat_tools(tools) -> list[dict] | None:
    """Responses' flat function tools ({type, name, description, parameters, strict}) in the chat form the
    template renders; any other tool type (web_search, file_search, code_interpreter, mcp, ...) is refused."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of function tools")
    out = []
    for k, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise BadRequest(f"tools[{k}] of type {kind!r} is not served: built-in tools run on OpenAI's side; only "
                             "function tools (type function, name, parameters), which the agent runs itself")
        if not isinstance(t.get("name"), str):
            raise BadRequest(f"tools[{k}] needs a name")
        out.append({"type": "function", "function": {f: v for f, v in t.items() if f != "type"}})
    return out


def chat_request(body: dict, earlier: dict[str, list[dict]]) -> tuple[dict, list[dict]]:
    """(the chat request a Responses request means, its conversation without the instructions). `earlier` maps
    the trajectory's response ids to their conversations (input and reply): with `previous_response_id` the new
    input follows that conversation (its instructions are not carried over, as OpenAI's are not)."""
    problem = _refused(body)
    if problem:
        raise BadRequest(problem)
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if previous not in earlier:
            raise BadRequest(f"previous_response_id {previous!r} is not a response of this trajectory (the "
                             "endpoint keeps a trajectory's responses while its agent runs)")
        history = list(earlier[previous])
    history += input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string")
    chat = {"messages": ([{"role": "system", "content": instructions}] if instructions else []) + history,
            "tools": chat_tools(body.get("tools"))}
    asked = body.get("max_output_tokens")
    if asked is not None:
        if not (isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1):
            raise BadRequest("max_output_tokens must be an integer >= 1")
        chat["max_tokens"] = asked
    return chat, history


def reply_chat_message(content: str | None, tool_calls: list[dict]) -> dict:
    """A reply as the chat message it is in a conversation a later previous_response_id continues."""
    return {"role": "assistant", "content": content} | ({"tool_calls": tool_calls} if tool_calls else {})


def output_items(rid: str, content: str | None, tool_calls: list[dict], finished: bool) -> list[dict]:
    """A reply as Responses output items: a message with its text (always, when there is no tool call, so the
    agent echoes an assistant turn back), then a function_call per tool call, its call_id the chat id."""
    items = []
    if content or not tool_calls:
        items.append({"id": f"msg_{rid[5:]}", "type": "message", "role": "assistant",
                      "status": "completed" if finished else "incomplete",
                      "content": [{"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}]})
    for k, c in enumerate(tool_calls):
        items.append({"id": f"fc_{rid[5:]}_{k}", "type": "function_call", "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    return items


def response_body(rid: str, model: str, request: dict, content: str | None, tool_calls: list[dict],
                  finished: bool, prompt: int, completion: int) -> dict:
    """The `response` object: status completed, or incomplete (max_output_tokens) when cut before EOS; the
    request's own settings echoed (tools as sent)."""
    now = int(time.time())
    return {"id": rid, "object": "response", "created_at": now, "completed_at": now, "model": model,
            "status": "completed" if finished else "incomplete",
            "incomplete_details": None if finished else {"reason": "max_output_tokens"}, "error": None,
            "output": output_items(rid, content, tool_calls, finished),
            "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
            "previous_response_id": request.get("previous_response_id"), "metadata": request.get("metadata"),
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": list(request.get("tools") or []),
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "background": False,
            "store": bool(request.get("store", True)),
            "usage": {
                "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}}


def response_events(body: dict) -> list[dict]:
    """A response as the stream of events the openai SDK reads (its `responses.stream` helper accumulates them):
    created, in_progress, each item added, its text or arguments as one delta and done, the item done, and
    response.completed carrying the whole response (its status incomplete when cut, as vLLM sends it)."""
    events: list[dict] = []

    def emit(kind: str, **fields):
        events.append({"type": kind, "sequence_number": len(events), **fields})
    opening = body | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None,
                      "completed_at": None}
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for i, item in enumerate(body["output"]):
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            part = item["content"][0]
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "content": []})
            emit("response.content_part.added", **at, content_index=0, part=part | {"text": ""})
            if part["text"]:
                emit("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
            emit("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            emit("response.content_part.done", **at, content_index=0, part=part)
        else:
            emit("response.output_item.added", output_index=i, item=item | {"status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=i, item=item)
    emit("response.completed", response=body)
    return events


def sse_events(events: list[dict]) -> bytes:
    """Server-sent events as OpenAI sends a Responses stream: each with its `event:` name, no [DONE]."""
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
