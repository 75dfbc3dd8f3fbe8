"""Tool calls in the model's own format, and tools as Python functions.

The format is Hermes / Qwen2.5 / Qwen3's: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
of them in one reply. A tool is a Python function with type hints and a Google-style docstring; its JSON schema
(what the chat template's tools= renders into the system prompt) comes from transformers' get_json_schema, the same
conversion transformers applies to `apply_chat_template(tools=[fn])`. A call that cannot be read or run becomes an
error message to the model, never an exception in the trainer.
"""

from __future__ import annotations

import inspect
import json
from typing import Callable, NamedTuple

from evenrl.errors import UsageError, describe_error, one_line

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolCall(NamedTuple):
    name: str | None
    arguments: dict | None
    error: str | None  # why the call could not be read; None for a well-formed call


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call> block of a reply, in order; malformed ones carry their error."""
    calls, at = [], 0
    while (start := text.find(OPEN, at)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            calls.append(ToolCall(None, None, f"{OPEN} without {CLOSE}"))
            break
        calls.append(_read_call(text[start + len(OPEN):end].strip()))
        at = end + len(CLOSE)
    return calls


def ends_inside_call(text: str) -> bool:
    """Whether a reply ends inside a tool call: a <tool_call> opened after the last </tool_call>. Cut there by its
    token limit, the call was never made (parse_tool_calls reads it as malformed; an agent's reply has none)."""
    return text.rfind(OPEN) > text.rfind(CLOSE)


def _read_call(body: str) -> ToolCall:
    try:
        doc = json.loads(body)
    except ValueError as e:
        return ToolCall(None, None, f"not JSON ({one_line(str(e), 80)})")
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        return ToolCall(None, None, 'expected {"name": "...", "arguments": {...}}')
    args = doc.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolCall(doc["name"], None, f'"arguments" of {doc["name"]} is not an object')
    return ToolCall(doc["name"], args, None)


def call_tool(call: ToolCall, tools: dict[str, Callable], max_chars: int) -> tuple[str, bool]:
    """(the tool message's text, whether the call ran): the tool's result as text (cut to max_chars), or an error
    the model can read: a malformed call, an unknown tool, arguments that do not fit its signature, or what it
    raised."""
    if call.error is not None:
        return f"error: malformed tool call: {call.error}", False
    fn = tools.get(call.name)
    if fn is None:
        known = ", ".join(tools) or "none"
        return f"error: unknown tool {call.name!r} (tools: {known})", False
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return f"error: {call.name}: {one_line(str(e), 160)}", False
    try:
        result = fn(**call.arguments)
    except Exception as e:
        return f"error: {call.name} raised {describe_error(e)}", False
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [cut at {max_chars} characters]"
    return text, True


def tool_schemas(tools: list[Callable]) -> list[dict] | None:
    """The tools' JSON schemas for the chat template's tools=; None for no tools. A function whose schema cannot be
    derived (no type hints, no docstring with an Args section) is a UsageError naming it."""
    if not tools:
        return None
    from transformers.utils.chat_template_utils import get_json_schema

    out = []
    for fn in tools:
        try:
            out.append(get_json_schema(fn))
        except Exception as e:
            name = getattr(fn, "__qualname__", repr(fn))
            raise UsageError(f"rollout.env: tool {name}: no JSON schema ({describe_error(e)}); give it type hints and "
                             "a docstring with an Args: section describing every argument") from None
    return out
