"""Agents for the rollout.agent tests (rollout.agent=toy_agents:name, with tests/ on PYTHONPATH): the openai client
against evenrl's endpoint, as users write them."""

from __future__ import annotations

import asyncio
import random
import socket
import time

from openai import AsyncOpenAI

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


async def two_tools(row, *, base_url, model, api_key):
    """Three calls: the model's reply, two tool results (the tiny model never calls the tool itself, so the agent
    answers as if it had), then the final answer scored by length. One call streams."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for k in range(2):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=6)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": str(k + 40)})
    stream = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    return len(text) / 10


async def rewrites_history(row, *, base_url, model, api_key):
    """Two calls, the second after dropping the first reply (a summarising agent): two samples."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])
    summary = f"earlier: {len(first.choices[0].message.content or '')}"
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": summary}])
    return 1.0


async def completions(row, *, base_url, model, api_key):
    """The completions endpoint, continued on its own text (the second call streamed): one sample; reward None
    (rewards.functions score the last reply)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = f"user: {row['prompt']}\nassistant: "
    first = await client.completions.create(model=model, prompt=prompt, max_tokens=4)
    stream = await client.completions.create(model=model, prompt=prompt + first.choices[0].text + "\nuser: more\n"
                                             "assistant: ", max_tokens=4, stream=True)
    assert "".join([c.choices[0].text async for c in stream])
    return None


async def hang(row, **_):
    time.sleep(3600)  # blocks the event loop: only the worker's own time limit can stop it


async def hog(row, **_):
    return len(bytearray(10 << 30))


async def shout(row, **_):
    print("x" * (100 << 20))
    return 0.0


async def flood(row, *, base_url, model, api_key):
    """100 requests at a time, errors ignored, row["rounds"] times (100: 10,000 requests)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    for _ in range(int(row.get("rounds", 100))):
        await asyncio.gather(*(client.completions.create(model=model, prompt="hi", max_tokens=1) for _ in range(100)),
                             return_exceptions=True)
    return 1.0


async def elsewhere(row, **_):
    socket.create_connection(("1.1.1.1", 443), timeout=2)


async def silent(row, **_):
    return 1.0


def not_async(row, **_):
    return 1.0


# An agent written for an API this one is not (as a verifiers environment of an older verifiers release): what the
# name holds is only known once it is loaded, in a worker, where every trajectory then fails the same way ("cannot
# load the function in a worker process"); reading the file cannot tell (evenrl plan says runnable).
stale = not_async



async def mixed(row, **endpoint):
    """two_tools on even rows, rewrites_history on odd ones: one run has chained calls and split samples."""
    return await (two_tools if row["id"] % 2 == 0 else rewrites_history)(row, **endpoint)


async def mixed_or_silent(row, **endpoint):
    """mixed, but every third row makes no call at all (its trajectory fails: one untrained token after the prompt)."""
    return await (silent if row["id"] % 3 == 2 else mixed)(row, **endpoint)


async def forgetful(row, *, base_url, model, api_key):
    """Not deterministic: its second call carries a random number, so when rollout.partial starts it again at the
    next step (or on --resume) and replays its calls, the second request is not the recorded one."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": f"{random.random():.9f}"}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    return 1.0


async def hang_async(row, **_):
    await asyncio.sleep(3600)


async def polite(row, *, base_url, model, api_key):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0


async def by_row(row, **endpoint):
    """The agent its row's prompt names (the hostile tests: one row per behaviour)."""
    return await globals()[row["prompt"]](row, **endpoint)


def reply_length(completion: str, sample: dict) -> float:
    """A reward function (rewards.functions) for agents that return None: the last reply's length."""
    return float(len(completion))


async def malformed(row, *, base_url, model, api_key):
    """Requests the endpoint must answer 400, not raise on: bad max_tokens, bad messages, unknown tools shape, a
    template that cannot render; then one good call."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}) as http:
        codes = [(await http.post(path, json=body)).status_code for path, body in [
            ("/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}),
            ("/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            ("/completions", {"model": model, "prompt": "x", "max_tokens": 0}),
            ("/chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
            ("/chat/completions", {"model": model, "messages": "hi"}),
            ("/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}], "tools": [7]}),
            ("/completions", {"model": model, "prompt": [10 ** 9]}),
            ("/completions", {"model": model, "prompt": {"a": 1}, "n": 2}),
        ]]
        content = await http.post("/chat/completions", content=b"not json", headers={"content-type": "application/json"})
    assert codes == [400] * 8 and content.status_code == 400, codes
    await polite(row, base_url=base_url, model=model, api_key=api_key)
    return 1.0


RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}]


async def responses_two_tools(row, *, base_url, model, api_key):
    """two_tools through the Responses API, as the OpenAI Agents SDK drives it: instructions, flat function tools,
    the output items echoed back with function_call_output items. The second call continues the first by
    previous_response_id, the third sends the whole input again and streams (client.responses.stream). Requests
    the endpoint cannot honour are refused first, each a 400 the agent reads."""
    import openai

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    bad = [{"tools": [{"type": "web_search"}]}, {"extra_body": {"n": 2}},
           {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}]
    for more in bad:
        try:
            await client.responses.create(**({"model": model, "input": row["prompt"]} | more))
        except openai.BadRequestError as e:
            assert "not served" in e.message or "n must be 1" in e.message, e.message
        else:
            raise AssertionError(f"{more} was answered")
    items = [{"role": "user", "content": row["prompt"]}]
    common = {"model": model, "instructions": "Add.", "tools": RESPONSES_TOOLS, "max_output_tokens": 6}
    first = await client.responses.create(input=items, **common)
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": "call_0", "output": "40"})
    second = await client.responses.create(input=items[-1:], previous_response_id=first.id, **common)
    items += [o.model_dump(exclude_none=True) for o in second.output]
    items.append({"type": "function_call_output", "call_id": "call_1", "output": "41"})
    del common["max_output_tokens"]
    async with client.responses.stream(input=items, **common) as stream:
        deltas = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        final = await stream.get_final_response()
    assert final.output_text == deltas and final.status in ("completed", "incomplete")
    return len(final.output_text) / 10


async def streams_past_the_cap(row, *, base_url, model, api_key):
    """Chat calls until rollout.max_trajectory_tokens is spent, then one more, streamed: it must come back as
    server-sent events (an empty reply cut for length), which the client parses; reward 1.0 when it does."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(8):
        reply = (await client.chat.completions.create(model=model, messages=messages)).choices[0]
        if not reply.message.content and reply.finish_reason == "length":
            break  # the cap: nothing more is sampled
        messages += [{"role": "assistant", "content": reply.message.content}, {"role": "user", "content": "more"}]
    stream = await client.chat.completions.create(model=model, messages=messages, stream=True)
    chunks = [c async for c in stream]
    assert chunks and chunks[-1].choices[0].finish_reason == "length", chunks
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    return 1.0


async def lingers(row, *, base_url, model, api_key):
    """One call, then a task left running that calls again after the agent returned: that call must be refused
    (the trajectory is one call), not recorded into the finished trajectory."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}])

    async def later():
        await asyncio.sleep(0.5)
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "after"}])
    _LEFT.append(asyncio.get_running_loop().create_task(later()))
    return 1.0


_LEFT: list = []


async def unix_elsewhere(row, **_):
    """A Unix socket of another process on the shared file system (row["path"]): out of reach like the network."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(row["path"])
    return 1.0
