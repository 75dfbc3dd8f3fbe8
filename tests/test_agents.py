"""Agent rollouts (rollout.agent) in one process: the OpenAI formats, assembly by token prefix, and agents written
with the `openai` client (tests/toy_agents.py) run in the contained workers against the real endpoint over HTTP on
their own loopback, served by the hf engine on the tiny tool-calling model: the trained tokens are the engine's,
tool tokens get no gradient, log-probs match a direct forward, history rewrites split or are refused, hostile agents
cost their own trajectory. The runs on 1 and 3 processes: tests/test_agents_runs.py."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

import toy_agents
from e2e import ENV, requests
from evenrl.agents.calls import Call, assemble
from evenrl.agents.job import agent_problem
from evenrl.agents.openai_api import chat_chunks, reply_message, same_reply, sse, template_messages
from evenrl.agents.prompts import Prompts, Record
from evenrl.agents.rows import parts, trajectory
from evenrl.config import RunConfig
from evenrl.core.aggregation import Denominators
from evenrl.core.batch import Batch, Ragged
from evenrl.engines.base import sampling_params
from evenrl.engines.hf import HFEngine
from evenrl.envs.template import tokenizer_render
from evenrl.isolation import pool
from evenrl.models.forward import response_logprobs
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model
from evenrl.train.objectives import STAT_NAMES, rl_objective
from evenrl.rollout.trajectories import make_turns, trajectory_columns
from evenrl.train.update import minibatch_update

ROWS = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "7+1=", "answer": "8"}]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("agent-model")), chat_template="tools", seed=3)


def run_agent(model, spec, rows, samples=2, rewards_functions=None, extra_fields=(), **rollout):
    """Agents.generate on `rows` x `samples`, as a training rank's rollout runs it: (trajectories [row][sample],
    the Agents, the policy, its tokenizer). `extra_fields`: the rows' fields the agents get besides prompt and
    answer (data.extra_fields)."""
    rewards = {"functions": rewards_functions} if rewards_functions else {}
    data = {"max_prompt_tokens": 64, "extra_fields": list(extra_fields)}
    cfg = RunConfig.model_validate({"model": {"path": model}, "data": data, "rewards": rewards,
                                    "rollout": {"agent": spec, "samples_per_prompt": samples, "max_new_tokens": 8,
                                                "agent_timeout_s": 20.0, **rollout}})
    policy, tok = load_policy(model)
    agents = make_turns(cfg)
    path = model + f"/rows-{len(rows)}.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    rows, tokens, openings, _ = agents.load(tok, path)
    engine = HFEngine(policy, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id)
    out = agents.generate(engine, requests(tokens, list(range(len(rows))), 1, sample_ranges=[(0, samples)] * len(rows)),
                          sampling_params(cfg), rows=rows, openings=openings)
    return out, agents, policy, tok


# ------------------------------------------------------------------------------------------ formats and assembly

def test_replies_become_openai_tool_calls_and_come_back_as_template_messages():
    text = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = reply_message(text)
    assert content == "Let me add." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert reply_message("no call <tool_call>{bad</tool_call>") == ("no call <tool_call>{bad</tool_call>", [])
    back = template_messages([{"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "add", "arguments": '{"b": 2, "a": 1}'}}]}])[0]
    assert back["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    sent = template_messages([{"role": "assistant", "content": content, "tool_calls": calls}])[0]
    assert same_reply(sent, back) and not same_reply(sent, dict(back, content="edited"))
    body = {"id": "c", "created": 0, "model": "m", "choices": [{"message": {"role": "assistant", "content": None,
                                                                          "tool_calls": calls},
                                                              "finish_reason": "tool_calls"}]}
    events = sse(chat_chunks(body)).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and json.loads(events[-3][6:])["choices"][0]["finish_reason"] == \
        "tool_calls"


def test_responses_requests_are_chat_requests_and_replies_come_back_as_items_the_sdk_reads():
    """A Responses request becomes the chat request it means (instructions first, echoed function_call items the
    reply's tool calls, outputs tool messages, flat tools the chat form), its reply output items that, echoed, are
    the same reply; the body and every stream event validate as the openai SDK's types, and the SDK parses the
    body, the stream and `responses.stream`'s final response into the same output. What the endpoint cannot
    honour is refused, naming it."""
    import asyncio

    import httpx
    from openai import AsyncOpenAI
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from evenrl.agents.openai_api import BadRequest
    from evenrl.agents.openai_responses import (chat_request, input_messages, output_items, response_body,
                                              response_events, sse_events)

    text = 'Adding. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = reply_message(text)
    items = output_items("resp_abc", content, calls, True)
    assert [i["type"] for i in items] == ["message", "function_call"] and items[1]["call_id"] == calls[0]["id"]
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}]
    chat, history = chat_request({"instructions": "Be brief.", "tools": tools, "max_output_tokens": 5, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "1+2"}]}, *items,
        {"type": "function_call_output", "call_id": calls[0]["id"], "output": "3"}]}, {})
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"},
                                                               "strict": True}}] and chat["max_tokens"] == 5
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"] and history == \
        chat["messages"][1:]
    sent = template_messages([{"role": "assistant", "content": content, "tool_calls": calls}])[0]
    assert same_reply(sent, template_messages(chat["messages"])[2])
    assert chat_request({"input": "more", "previous_response_id": "resp_1"}, {"resp_1": history})[0]["messages"] == \
        history + [{"role": "user", "content": "more"}]
    assert input_messages([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]) == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]}]
    refused = {"tools[0] of type 'web_search' is not served": {"tools": [{"type": "web_search"}]},
               "n must be 1": {"n": 2}, "input item type 'reasoning' is not served": {"input": [{"type": "reasoning"}]},
               "content part 'input_image' is not served": {"input": [{"role": "user", "content": [
                   {"type": "input_image", "image_url": "x"}]}]},
               "tool_choice 'required' is not honoured": {"tool_choice": "required"},
               "previous_response_id 'resp_9' is not a response of this trajectory": {"previous_response_id": "resp_9"},
               "include": {"include": ["reasoning.encrypted_content"]}, "background": {"background": True},
               "text.format 'json_schema' is not honoured": {"text": {"format": {"type": "json_schema"}}},
               "max_output_tokens must be an integer": {"max_output_tokens": 0}}
    for words, more in refused.items():
        with pytest.raises(BadRequest, match=words.replace("[", r"\[").replace("(", r"\(")):
            chat_request({"input": "x"} | more, {})

    bodies = {cut: response_body("resp_abc", "m", {"tools": tools}, *(("Adding.", calls) if not cut else ("Add", [])),
                                 not cut, 7, 4) for cut in (False, True)}
    assert bodies[True]["status"] == "incomplete" and bodies[True]["incomplete_details"]["reason"] == \
        "max_output_tokens"
    events = TypeAdapter(ResponseStreamEvent)
    for body in bodies.values():
        Response.model_validate(body)
        stream = response_events(body)
        assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
        for e in stream:
            events.validate_python(e)

    async def parse(body):
        def answer(request):
            streamed = json.loads(request.content).get("stream")
            return httpx.Response(200, content=sse_events(response_events(body)) if streamed else json.dumps(body),
                                  headers={"content-type": "text/event-stream" if streamed else "application/json"})
        client = AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k",
                             http_client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))
        whole = await client.responses.create(model="m", input="x")
        kinds = [e.type async for e in await client.responses.create(model="m", input="x", stream=True)]
        async with client.responses.stream(model="m", input="x", tools=tools) as s:
            deltas = [e async for e in s]
            final = await s.get_final_response()
        return whole, kinds, deltas, final
    whole, kinds, deltas, final = asyncio.run(parse(bodies[False]))
    dump = [o.model_dump(exclude_none=True) for o in whole.output]
    assert [e.item.model_dump(exclude_none=True) for e in deltas if e.type == "response.output_item.done"] == dump
    assert [o.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for o in final.output] == dump
    streamed = [(e.snapshot, e.delta) for e in deltas if e.type.endswith(".delta")]  # the SDK's own accumulation
    assert streamed == [("Adding.", "Adding."), (whole.output[1].arguments, whole.output[1].arguments)]
    assert final.output_text == whole.output_text == "Adding."
    assert whole.output[1].arguments == '{"a": 1, "b": 2}' and final.output[1].call_id == "call_0"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and \
        "response.function_call_arguments.done" in kinds and len(deltas) == len(kinds)
    whole, _, _, final = asyncio.run(parse(bodies[True]))
    assert final.status == whole.status == "incomplete" and final.output_text == whole.output_text == "Add"


def test_calls_assemble_by_token_prefix_whatever_order_they_arrived_in():
    a = Call([1, 2, 3], [10, 11], [-0.1, -0.2], True, 1)
    b = Call([1, 2, 3, 10, 11, 7, 8], [12], [-0.3], True)        # extends a: one sample
    c = Call([1, 2, 3, 10, 11, 7, 8, 12, 9], [13, 14], [-0.4, -0.5], False)
    edited = Call([1, 2, 5], [15], [-0.6], True)                  # history rewritten: a sample of its own
    for order in ([a, b, c, edited], [edited, c, b, a]):
        first, second = assemble(order)
        assert first.prompt_ids == [1, 2, 3] and first.token_ids == [10, 11, 7, 8, 12, 9, 13, 14]
        assert first.loss_mask == [True, True, False, False, True, False, True, True]
        assert first.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
        assert (first.calls, first.tool_calls, first.finished) == (3, 1, False)
        assert second.prompt_ids == [1, 2, 5] and second.token_ids == [15] and second.loss_mask == [True]


def test_a_call_key_names_the_prompt_not_the_arrival_order():
    one, other = Record(4, 0, {}), Record(4, 0, {})
    keys = [one.call_key([1, 2]), one.call_key([3]), one.call_key([1, 2])]
    assert [other.call_key([3]), other.call_key([1, 2]), other.call_key([1, 2])] == [keys[1], keys[0], keys[2]]
    assert len(set(keys)) == 3 and Record(5, 0, {}).call_key([1, 2]) != keys[0]


def test_the_plan_finds_the_function_without_importing_it():
    assert agent_problem("toy_agents:two_tools") is None
    assert "async def" in agent_problem("toy_agents:not_async")
    assert "no function 'nothing'" in agent_problem("toy_agents:nothing")
    assert "not on the Python path" in agent_problem("no_such_module_here:fn")
    assert "package.module:function" in agent_problem("two_tools")
    assert "rollout.agent_args (split) are for an environment library" in agent_problem("toy_agents:two_tools",
                                                                                       {"split": "test"})


# ------------------------------------------------------------------------------------------ the endpoint, end to end

@pytest.mark.parametrize("spec", ["toy_agents:two_tools", "toy_agents:responses_two_tools"])
def test_an_agent_with_two_tool_calls_trains_exactly_the_engines_tokens(tools_model, spec):
    """Three chat calls over real HTTP (two answered with tool results, the last streamed), through chat completions
    or the Responses API (its second call by previous_response_id, its bad requests refused first): one sample each, the
    sampled stretches are what the engine samples for that exact prefix and key (never re-tokenised text), the tool
    turns are the template's text, the engine's log-probs are a direct forward's within 1e-6, and the loss gives
    the tool tokens exactly zero gradient."""
    out, agents, policy, tok = run_agent(tools_model, spec, ROWS)
    engine = HFEngine(policy, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id)
    cfg = agents.cfg
    trajectories = [t for ts in out for t in ts]
    for t in trajectories:
        assert not t.failed and not t.splits and t.turns == 3 and t.reward > 0, t.error
        stretches, start = [], 0
        for i in range(1, len(t.loss_mask) + 1):  # the runs of sampled tokens
            if i == len(t.loss_mask) or t.loss_mask[i] != t.loss_mask[start]:
                if t.loss_mask[start]:
                    stretches.append((start, i))
                start = i
        assert len(stretches) == 3
        key = Record(t.prompt_key, t.sample_index, {})
        for a, b in stretches:
            prefix = t.prompt_ids + t.token_ids[:a]
            again = engine.generate(requests([prefix], [key.call_key(prefix)], 1, sample_ranges=[(t.sample_index, 1)]),
                                    sampling_params(cfg))[0][0]
            assert again.token_ids[:b - a] == t.token_ids[a:b]
        tool_text = tok.decode([x for x, m in zip(t.token_ids, t.loss_mask) if not m])
        assert "<tool_response>40</tool_response>" in tool_text and "<tool_response>41</tool_response>" in tool_text
        with torch.no_grad():
            ids = torch.tensor([t.prompt_ids + t.token_ids])
            logp = torch.log_softmax(policy(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        logp = logp[-len(t.token_ids):]
        mask = torch.tensor(t.loss_mask)
        assert float((logp[mask] - torch.tensor(t.logprobs, dtype=torch.float64)[mask]).abs().max()) <= 1e-6

    cols = trajectory_columns(trajectories)
    batch = Batch({"tokens": Ragged.of([torch.tensor(t.prompt_ids + t.token_ids) for t in trajectories], torch.long),
                   "response_len": torch.tensor([len(t.token_ids) for t in trajectories]),
                   "advantage": torch.tensor([1.0, -1.0, 0.5, -0.5]), "loss_mask": cols["loss_mask"],
                   "engine_logp": Ragged.of([torch.tensor(t.logprobs) for t in trajectories], torch.float32),
                   "version": torch.zeros(4, dtype=torch.long), "reward_failed": torch.zeros(4, dtype=torch.bool),
                   "finished": torch.ones(4, dtype=torch.bool)})
    seen = []

    def loss_fn(outputs, targets, mask, mb):
        outputs.retain_grad()
        seen.append((outputs, mb))
        return rl_objective(cfg, 1, outputs, targets, mask, mb)
    minibatch_update(policy, torch.optim.SGD(policy.parameters(), lr=0.0), None, batch, [[0, 1, 2, 3]],
                     Denominators(tokens=float(cols["sampled_len"].sum()), seqs=4.0),
                     forward=functools.partial(response_logprobs, pad_token_id=tok.pad_token_id, entropy=True),
                     loss_fn=loss_fn, stat_names=STAT_NAMES, aggregation="token-mean", max_grad_norm=0.0,
                     pad_token_id=tok.pad_token_id)
    (outputs, _), = seen
    width = outputs.shape[1]
    for j, t in enumerate(trajectories):
        grad = outputs.grad[j][width - len(t.token_ids):, 0]  # the log-probs (column 1: entropies)
        mask = torch.tensor(t.loss_mask)
        assert float(grad[~mask].abs().max()) == 0.0 and float(grad[mask].abs().min()) > 0


def test_a_responses_agent_echoing_its_function_calls_chains_onto_them(tools_model):
    """The tiny model never writes a tool call, so a scripted engine does (a Hermes call, then EOS): the Responses
    reply is one function_call item (no message item), and the agent's next request, its input + that item + its
    output, continues the call: one sample, the tool output untrained, the call counted."""
    import concurrent.futures

    from evenrl.engines.base import Completion
    from evenrl.agents.server import Pending

    cfg = RunConfig.model_validate({"model": {"path": tools_model}, "rollout": {"agent": "toy_agents:two_tools"}})
    agents = make_turns(cfg)
    _, agents.tokenizer = load_policy(tools_model)
    tok = agents.tokenizer
    agents.prompts = Prompts(tok, tokenizer_render(tok), {tok.eos_token_id})
    said = agents.prompts.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    scripted = [said + [tok.eos_token_id], agents.prompts.encode("5") + [tok.eos_token_id]]

    class Scripted:
        def generate(self, requests, params):
            return [[Completion(0, 0, ids := scripted.pop(0), [-1.0] * len(ids), True)] for _ in requests]
    rec = Record(0, 0, {})

    def ask(body):
        p = Pending("t", "responses", body, concurrent.futures.Future())
        agents._serve([p], {"t": rec}, Scripted(), sampling_params(cfg), 1)
        return p.future.result().body
    tools = [{"type": "function", "name": "calculator", "parameters": {"type": "object", "properties": {
        "expression": {"type": "string"}}}}]
    first = ask({"input": "2+3=", "tools": tools})
    assert [(o["type"], o["name"], o["arguments"]) for o in first["output"]] == \
        [("function_call", "calculator", '{"expression": "2+3"}')]
    second = ask({"tools": tools, "input": [{"role": "user", "content": "2+3="}, *first["output"], {
        "type": "function_call_output", "call_id": first["output"][0]["call_id"], "output": "5"}]})
    assert second["status"] == "completed" and second["output"][0]["content"][0]["text"] == "5"
    (seg,) = assemble(rec.calls)
    assert (seg.calls, seg.tool_calls) == (2, 1)
    assert seg.token_ids[:len(scripted_first := said + [tok.eos_token_id])] == scripted_first
    between = [x for x, m in zip(seg.token_ids, seg.loss_mask) if not m]
    assert tok.decode(between).strip() == "<tool_response>5</tool_response>\nassistant:"


def test_a_tool_call_cut_at_max_new_tokens_is_counted_and_warned_once(tools_model, capsys):
    """A reply that reaches rollout.max_new_tokens inside a tool call (<tool_call> open, </tool_call> missing) makes
    no call: the agent gets plain text cut for length, and the call is counted in its sample (tools/cut_calls), which
    the run warns about once; a reply that closes its call, or ends with EOS, is not counted."""
    import concurrent.futures

    from evenrl.agents.server import Pending
    from evenrl.engines.base import Completion
    from evenrl.train.loop import warn_cut_calls
    from evenrl.train.metrics import trajectory_metrics

    cfg = RunConfig.model_validate({"model": {"path": tools_model}, "rollout": {"agent": "toy_agents:two_tools",
                                                                                "max_new_tokens": 12}})
    agents = make_turns(cfg)
    _, agents.tokenizer = load_policy(tools_model)
    tok = agents.tokenizer
    agents.prompts = Prompts(tok, tokenizer_render(tok), {tok.eos_token_id})
    said = agents.prompts.encode('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert len(said) > 12
    scripted = [said[:12], agents.prompts.encode("5") + [tok.eos_token_id]]

    class Scripted:
        def generate(self, requests, params):
            ids = scripted.pop(0)[:params.max_new_tokens]
            return [[Completion(0, 0, ids, [-1.0] * len(ids), ids[-1] == tok.eos_token_id)] for _ in requests]
    rec = Record(0, 0, {})
    answers = []
    for body in ({"messages": [{"role": "user", "content": "2+3="}], "tools": toy_agents.TOOLS},
                 {"messages": [{"role": "user", "content": "again"}]}):
        p = Pending("t", "chat", body, concurrent.futures.Future())
        agents._serve([p], {"t": rec}, Scripted(), sampling_params(cfg), 1)
        answers.append(p.future.result().body["choices"][0])
    assert answers[0]["finish_reason"] == "length" and "tool_calls" not in answers[0]["message"]
    assert [c.cut for c in rec.calls] == [True, False]
    t = parts(0, 0, [1], assemble(rec.calls), None, False, {tok.eos_token_id})
    assert sorted([t.cut_calls, *(x.cut_calls for x in t.splits)]) == [0, 1]  # two samples: the calls do not chain
    cols = trajectory_columns([t, *t.splits])
    everyone = Batch({k: cols[k] for k in ("turns", "sampled_len", "tool_calls", "tool_errors", "cut_calls")})
    metrics = {**trajectory_metrics(everyone), "samples": 2}
    assert metrics["tools/cut_calls"] == 1
    assert warn_cut_calls(cfg, 3, metrics) and not warn_cut_calls(cfg, 4, {"tools/cut_calls": 0})
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("evenrl: warning: step 3: 1 of 2 replies ended at their token limit inside a tool call")
    assert "raise rollout.max_new_tokens (12)" in line


def test_an_agent_that_cannot_load_stops_the_run_at_its_first_step(tools_model, tmp_path, capsys):
    """toy_agents:stale (as a verifiers environment written for an older verifiers) cannot be loaded in a worker
    process, so every trajectory fails alike: the run stops at step 1 with that one line, exit 3 (it trained every
    step to the end on zero rewards, exit 0, its closing note blaming the reward)."""
    from e2e import evenrl_here

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model: {{path: {tools_model}}}\ndata: {{path: {data}, prompts_per_step: 2}}\n"
                   "rollout: {samples_per_prompt: 2, max_new_tokens: 8, agent: 'toy_agents:stale'}\n"
                   f"train: {{steps: 3}}\nlog: {{progress: false, run_dir: {tmp_path / 'run'}}}\n")
    code, out, err = evenrl_here(capsys, "plan", cfg)
    assert code == 0, out  # reading the file cannot tell
    code, out, err = evenrl_here(capsys, "train", cfg)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 3 and len(lines) == 1 and "Traceback" not in err, err
    assert "stopped: step 1: rollout.agent toy_agents:stale: all 4 trajectories of the step failed the same way: " \
           "raised: cannot load the function in a worker process: TypeError:" in lines[0], lines[0]
    assert "last good checkpoint: none yet" in lines[0] and "done" not in out


def test_only_a_step_whose_trajectories_all_failed_alike_stops_the_run():
    """The rule the run above stops by (train.sampling.stop_if_all_failed_alike): every trajectory failed, with one
    error; not a timeout (the machine's load decides it), not rewards.functions failing on agents' replies (a
    reward's failures are warned about), not while one trajectory worked or the errors differ."""
    from types import SimpleNamespace

    from evenrl.agents.rows import REPLY_SCORE_FAILED
    from evenrl.errors import RunStopped
    from evenrl.train.sampling import stop_if_all_failed_alike

    def step(errors, spec="rollout.env=toy_envs:Broken"):
        trainer = SimpleNamespace(turns=object(), cfg=RunConfig.model_validate(
            {"rollout": dict([spec.removeprefix("rollout.").split("=")])}))
        rows = Batch({"reward_failed": torch.tensor([e is not None for e in errors]), "error": list(errors)})
        stop_if_all_failed_alike(trainer, rows, rows)

    with pytest.raises(RunStopped, match=r"^rollout.env toy_envs:Broken: all 3 trajectories of the step failed the "
                                         r"same way: raised: KeyError: 'x'$"):
        step(["raised: KeyError: 'x'"] * 3)
    for fine in (["raised: KeyError: 'x'", "raised: KeyError: 'x'", None], ["raised: A", "raised: B", "raised: A"],
                 ["timeout: took longer than 5 s"] * 3, [REPLY_SCORE_FAILED] * 3):
        step(fine, "rollout.agent=toy_agents:two_tools")


def test_steps_that_learned_nothing_because_every_sample_failed_do_not_blame_the_reward(capsys):
    """The run's closing note said "the reward does not tell this model's samples apart" of steps in which every
    sample had failed (an agent that could not load); it says they failed."""
    from evenrl.train.metrics import Idle

    idle = Idle()
    for step, failures in ((1, 4), (2, 4), (4, 0)):
        idle.see(step, {"samples": 4, "advantage/abs_mean": 0.0, "reward/failures": failures})
    idle.summary(4)
    first, again, note = capsys.readouterr().out.splitlines()
    assert first.endswith("all 4 samples have advantage 0 (every one had failed: see the failures above)"), first
    assert "check the reward" in again
    assert note == ("evenrl: note: 3 of 4 steps learned nothing (all advantages 0); in 2 of them every sample had "
                    "failed (reward/failures), not the reward's doing")


def test_completions_continue_on_their_text_and_a_none_reward_is_scored_by_the_reward_functions(tools_model):
    """/v1/completions twice, the second prompt the first + its text + more (streamed): one sample whose prompt is the
    first call's and whose middle is the added text alone; the agent returns None, so rewards.functions score the
    last reply (a reward that is the reply's length, so the score is seen to come from it)."""
    out, _, _, tok = run_agent(tools_model, "toy_agents:completions", ROWS[:1],
                               rewards_functions=[{"name": "toy_agents:reply_length"}])
    for t in out[0]:
        assert not t.failed and not t.splits and t.turns == 2, t.error
        assert tok.decode(t.prompt_ids) == "user: 2+3=\nassistant: "
        first = t.loss_mask.index(False)
        middle = t.token_ids[first:first + t.loss_mask[first:].index(True)]
        assert tok.decode(middle) == "\nuser: more\nassistant: "
        last = [x for x, m in zip(t.token_ids[first + len(middle):], t.loss_mask[first + len(middle):]) if m]
        assert t.reward == len(tok.decode([x for x in last if x != tok.eos_token_id]))


def test_a_streamed_call_past_the_trajectory_cap_is_still_a_stream(tools_model):
    """Once rollout.max_trajectory_tokens is spent, a call is an empty reply cut for length, recorded as no call;
    asked for with stream=true it comes as server-sent events like any streamed reply (the client parses it)."""
    out, _, _, _ = run_agent(tools_model, "toy_agents:streams_past_the_cap", ROWS[:1], samples=1,
                             max_trajectory_tokens=12)
    (t,) = out[0]
    assert not t.failed and t.reward == 1.0, t.error
    assert sum(t.loss_mask) <= 12


def test_history_rewrites_split_into_samples_or_are_refused(tools_model, monkeypatch):
    """An agent that drops its first reply: its second call is a sample of its own (its own prompt, the
    trajectory's reward, counted), the same whether the agents share a worker or not; with
    agent_history=refuse the trajectory fails."""
    out, agents, _, tok = run_agent(tools_model, "toy_agents:rewrites_history", ROWS[:1])
    monkeypatch.setattr(pool, "workers", lambda: 1)
    again, _, _, _ = run_agent(tools_model, "toy_agents:rewrites_history", ROWS[:1])
    for t, u in zip(out[0], again[0]):
        assert (t.token_ids, t.splits[0].token_ids) == (u.token_ids, u.splits[0].token_ids)
        assert not t.failed and t.reward == 1.0 and t.history_breaks == 1 and len(t.splits) == 1
        (s,) = t.splits
        assert s.segment == 1 and s.reward == 1.0 and tok.decode(s.prompt_ids).startswith("user: earlier: ")
        assert all(s.loss_mask) and all(t.loss_mask)
    cols = trajectory_columns([p for t in out[0] for p in (t, *t.splits)])
    assert cols["segment"].tolist() == [0, 1, 0, 1] and cols["history_breaks"].tolist() == [1, 0, 1, 0]

    agents.cfg = agents.cfg.model_copy(update={"rollout": agents.cfg.rollout.model_copy(
        update={"agent_history": "refuse"})})
    rec = Record(0, 0, {})
    rec.calls = [Call([1, 2], [3], [-1.0], True), Call([1, 4], [5], [-1.0], True)]
    refused = trajectory(agents.cfg, [1], rec, ("ok", 1.0), {tok.eos_token_id})
    assert refused.failed and "agent_history=refuse" in refused.error and refused.reward == 0.0


def test_hostile_agents_cost_their_own_trajectory(tools_model, monkeypatch, capfd, tmp_path):
    """Agents in two workers, each on one event loop: hanging, allocating 10 GB, printing 100 MB, sending 300 requests 100
    at a time, connecting elsewhere (an address, another process's Unix socket file), never calling; each is one
    logged failure and the well-behaved ones are not (one of them sends malformed requests first, each answered 400
    without disturbing the rollout; one leaves a task calling after it returned: that call is refused, not recorded).
    (An agent that blocks its event loop fails the agents sharing its worker: the worker's own time limit; the
    pool's tests cover that limit.)"""
    import socket

    kinds = ["hang_async", "hog", "shout", "flood", "elsewhere", "silent", "malformed", "polite", "lingers",
             "unix_elsewhere"]
    monkeypatch.setattr(pool, "workers", lambda: 2)  # agents k::2 share a worker: the flood (3) not with "malformed" (6);
    # "lingers" (8) with "hang_async" (0), so its worker runs on after it returned
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(tmp_path / "other.sock"))
    listening.listen()
    out, _, _, _ = run_agent(tools_model, "toy_agents:by_row", [{"prompt": k, "answer": "", "rounds": 3,
                                                                  "path": str(tmp_path / "other.sock")}
                                                                 for k in kinds], samples=1, agent_timeout_s=6.0,
                             extra_fields=["rounds", "path"])
    listening.close()
    got = {k: ts[0] for k, ts in zip(kinds, out)}
    assert not got["polite"].failed and got["polite"].reward == 1.0
    assert not got["malformed"].failed and got["malformed"].reward == 1.0  # nine bad requests answered 400
    assert not got["lingers"].failed and got["lingers"].reward == 1.0
    assert got["lingers"].turns == 1 and not got["lingers"].splits  # the call after it returned is not in it
    expected = {"hang_async": "took longer than 6 s", "hog": "out of memory", "shout": "no call",
                "flood": "more than 16 calls", "elsewhere": "Network is unreachable", "silent": "no call",
                "unix_elsewhere": "Permission denied"}
    for kind, words in expected.items():
        assert got[kind].failed and got[kind].reward == 0.0 and words in got[kind].error, (kind, got[kind].error)
    printed = capfd.readouterr()
    assert len(printed.out) + len(printed.err) < 1 << 20  # 100 MB printed, a few KiB shown
    assert printed.out.count("rollout.agent: trajectory") == len(expected)


def test_the_plan_refuses_what_the_endpoint_cannot_serve_without_importing_the_agent(tools_model):
    """Worst-case samples are prompt + the trajectory cap; a sharded model without rollout ranks, rollout.env as
    well, reward models, the sandbox for everything and a plain function are errors (vLLM is not); a cap short of
    agent_max_calls calls is a note; the agent's module (which imports openai) is never imported, nor torch."""
    code = f"""
import sys, json
from evenrl.config import load_config
from evenrl.planner.layout import make_layout
from evenrl.planner.plan import make_plan
common = ["model.path={tools_model}", "rollout.agent=toy_agents:two_tools", "rollout.max_new_tokens=100",
          "rollout.max_trajectory_tokens=1000", "rollout.agent_max_calls=16"]
p = make_plan(load_config(None, common), make_layout(1, 2))
bad = make_plan(load_config(None, common + ["rollout.engine=vllm", "parallel.sharding=fsdp", "rollout.env=feedback",
                                            "rewards.functions=[{{model: /m}}]", "rewards.sandbox=all",
                                            "rollout.agent=toy_agents:not_async"]), make_layout(1, 2))
print(json.dumps([p.sample_tokens, [(f.level, f.rule) for f in p.findings if f.rule.startswith("agent")],
                  sorted(f.rule for f in bad.findings if f.level == "error" and f.rule.startswith("agent")),
                  [m for m in ("torch", "openai", "toy_agents") if m in sys.modules]]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    tokens, findings, errors, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert tokens == 256 + 1000 and findings == [["note", "agent-cap"]] and imported == []
    assert errors == ["agent-env", "agent-name", "agent-reward-models", "agent-sandbox", "agent-sharding"]


def test_an_agent_gone_while_sending_is_no_error(caplog):
    import logging
    """An agent killed at its time limit half-way through a request body: the endpoint drops the request quietly
    (no 'Exception in ASGI application' traceback in the run's output) and keeps serving."""
    import socket
    import time

    from evenrl.agents.server import AgentServer

    server = AgentServer("tiny")
    server.live.add("x")  # a running agent's key
    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's own handlers: it does not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING"):
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(server.socket_path)
            conn.sendall(b"POST /t/x/v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000\r\n\r\n{\"messages\": [")
            time.sleep(0.2)
            conn.close()
            time.sleep(0.5)
            probe = socket.socket(socket.AF_UNIX)
            probe.connect(server.socket_path)
            probe.sendall(b"GET /t/x/v1/models HTTP/1.1\r\nhost: e\r\n\r\n")
            probe.settimeout(10)
            reply = b""
            while b"}" not in reply and (chunk := probe.recv(4096)):
                reply += chunk
            probe.close()
        assert reply.startswith(b"HTTP/1.1 200") and b'"tiny"' in reply
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
        assert server.requests.empty()
    finally:
        uvicorn_log.removeHandler(caplog.handler)
        server.stop()


def _post(server, head: bytes, body_parts, timeout_s: float = 30.0) -> bytes:
    """A raw HTTP POST over the endpoint's socket: `head` (request line and headers), then the body's parts sent
    from a thread (a server that stops reading must not block the test), the reply read until it is whole or the
    connection ends."""
    import socket
    import threading

    conn = socket.socket(socket.AF_UNIX)
    conn.connect(server.socket_path)
    conn.settimeout(timeout_s)

    def send():
        try:
            conn.sendall(head)
            for part in body_parts:
                conn.sendall(part)
        except OSError:  # the server answered and closed while we sent
            pass
    threading.Thread(target=send, daemon=True).start()
    reply = b""
    try:
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    except TimeoutError:
        pass
    conn.close()
    return reply


def test_hostile_request_bodies_are_refused_in_one_line_and_read_no_further_than_the_cap(caplog):
    """A body nested 100,000 levels deep is a 400 (not a RecursionError traceback and a 500); a chunked body (no
    Content-Length) over the size cap is a 413 as soon as the cap is passed, read no further (here the body never
    ends: the answer comes anyway)."""
    import logging

    from evenrl.agents.server import MAX_BODY_BYTES, AgentServer

    server = AgentServer("tiny")
    server.live.add("x")  # a running agent's key
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING"):
            deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            reply = _post(server, b"POST /t/x/v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-type: "
                          b"application/json\r\ncontent-length: %d\r\n\r\n" % len(deep), [deep])
            assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
            assert b"too deeply" in reply and reply.count(b"\n") < 20

            mib = b"x" * (1 << 20)
            chunk = b"%x\r\n" % len(mib) + mib + b"\r\n"
            parts = [b'1\r\n{\r\n'] + [chunk] * (MAX_BODY_BYTES // len(mib) + 2)  # no last chunk: it never ends
            reply = _post(server, b"POST /t/x/v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-type: "
                          b"application/json\r\ntransfer-encoding: chunked\r\n\r\n", parts, timeout_s=20)
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
        assert server.requests.empty()
    finally:
        uvicorn_log.removeHandler(caplog.handler)
        server.stop()
