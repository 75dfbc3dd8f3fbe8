"""A calculator agent written against the OpenAI API, trained by evenrl as it stands (docs/agents.md):
rollout.agent=calc_agent:solve with examples/ on PYTHONPATH."""

import json

from openai import AsyncOpenAI

from evenrl.envs.tools import calculator

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


async def solve(row, *, base_url, model, api_key):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = (await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return None  # the final answer: rewards.functions score it
        for call in reply.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # the model's arguments: its mistake, its next turn reads it
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
