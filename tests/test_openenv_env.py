"""rollout.agent 'openenv:module:EnvClass' (evenrl.agents.openenv_adapter): an OpenEnv MCPEnvironment
(examples/arith_env.py, as OpenEnv users write them) trained as it is written. Its tools reach the model as OpenAI
tools, each tool call is one CallToolAction step, the reward is the environment's; the plan reads the spec without
importing openenv or the environment; one `evenrl train` step of examples/openenv.yaml, on a tiny model taught to
call the tools (the random tiny model never does), trains the sampled tokens only, on the environment's rewards."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e import ENV, Job, final_params, max_diff, metrics
from evenrl.agents import openenv_adapter
from evenrl.agents.job import agent_problem
from evenrl.agents.openenv_adapter import episode_seed, reset_arguments, run_episode
from evenrl.envs.template import tokenizer_render
from evenrl.testing import make_tiny_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SPEC = "openenv:arith_env:ArithmeticEnv"
# The taught model computes 2+3 and submits 5 whatever it is asked: the environment pays only the first row.
ROWS = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "3+4=", "answer": "7"}]
CALLS = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>',
         '<tool_call>{"name": "submit_answer", "arguments": {"answer": "5"}}</tool_call>')


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """(The tiny tool-calling model taught (150 Adam steps, ~2 s) the two calls on the prompts the endpoint renders:
    the calculator, then, after its result, submit_answer; the token counts of its two replies and of the tool turn
    between them.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(str(tmp_path_factory.mktemp("openenv") / "model"), chat_template="tools", seed=0)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": n, "parameters": {"properties": {p: {}}}}}
             for n, p in (("calculator", "expression"), ("submit_answer", "answer"))]

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]
    first, second = (enc(c) + [tok.eos_token_id] for c in CALLS)
    middle = enc("\n<tool_response>5</tool_response>\nassistant: ")
    seqs = []
    for row in ROWS:
        prompt = enc(tokenizer_render(tok)([{"role": "user", "content": row["prompt"]}], tools, True))
        seqs.append((prompt + first + middle + second, [-100] * len(prompt) + first + [-100] * len(middle) + second))
    ids = torch.tensor([s for s, _ in seqs])  # the two rows' prompts have the same length
    labels = torch.tensor([y for _, y in seqs])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(150):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    model.save_pretrained(path)
    return path, len(first) + len(second), len(middle)


class Scripted:
    """An OpenEnv LLMClient that answers from a script and keeps what it was asked (the harness's side of the
    endpoint, without one)."""

    def __init__(self, *replies):
        from openenv.core.llm_client import LLMResponse, ToolCall

        self.replies = [LLMResponse("", [ToolCall(f"c{k}", *r)]) if r else LLMResponse("no tools", [])
                        for k, r in enumerate(replies)]
        self.asked = []

    async def complete_with_tools(self, messages, tools, **kwargs):
        self.asked.append((list(messages), tools))
        return self.replies[len(self.asked) - 1]


def test_tools_become_openai_tools_and_calls_become_steps_with_the_environments_reward(monkeypatch):
    """The harness's loop on the example: the model is offered the environment's two MCP tools; a calculator call
    is a CallToolAction whose text comes back as the tool message; submit_answer's reward is the environment's
    (right: 1, wrong: 0); a tool's error is text for the model to read; an episode the model ends without a scoring
    call earns no reward (None: rewards.functions score it); a tool the environment does not have fails it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from arith_env import ArithmeticEnv
    from openenv.core.llm_client import _mcp_tools_to_openai

    llm = Scripted(("calculator", {"expression": "(12 + 30) * 2"}), ("submit_answer", {"answer": "84"}))
    assert run_episode(ArithmeticEnv, {}, {"prompt": "(12+30)*2=", "answer": "84"}, llm) == 1.0
    (opening, tools), (then, _) = llm.asked
    assert opening == [{"role": "user", "content": "(12+30)*2="}]
    assert [t["function"]["name"] for t in _mcp_tools_to_openai(tools)] == ["calculator", "submit_answer"]
    assert then[-1] == {"role": "tool", "tool_call_id": "c0", "name": "calculator", "content": "84"}
    assert run_episode(ArithmeticEnv, {}, {"prompt": "?", "answer": "85"}, Scripted(("submit_answer", {"answer": "84"}))
                       ) == 0.0
    lost = Scripted(("calculator", {"expression": "1/0"}), ("calculator", {"expression": ""}), None)
    assert run_episode(ArithmeticEnv, {}, {"prompt": "?", "answer": "1"}, lost) is None
    assert [m[-1]["content"][:6] for m, _ in lost.asked[1:]] == ["error:"] * 2
    with pytest.raises(KeyError, match="Unknown tool: abacus"):  # OpenEnv's harness: the episode fails
        run_episode(ArithmeticEnv, {}, {"prompt": "?", "answer": "1"}, Scripted(("abacus", {})))


def test_the_agent_runs_the_episode_off_its_loop_and_closes_its_client(monkeypatch):
    """make_agent's function, as a worker awaits it: the episode in a thread of its own, the reward back on the
    loop, the endpoint's client closed on that loop (one closed by the garbage collector on a later step's loop
    prints a traceback); a name that is not an MCPEnvironment is refused when the worker loads it."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    closed = []

    class Closing(Scripted):
        async def aclose(self):
            closed.append(asyncio.get_running_loop())

    monkeypatch.setattr(openenv_adapter, "endpoint_client", lambda *_: Closing(("submit_answer", {"answer": "84"})))
    agent = openenv_adapter.make_agent("arith_env:ArithmeticEnv", {"max_steps": 2})

    async def main():
        endpoint = {"base_url": "http://127.0.0.1:9/t/x/v1", "model": "m", "api_key": "x"}
        return await asyncio.gather(agent({"prompt": "?", "answer": "84"}, **endpoint),
                                    agent({"prompt": "?", "answer": "8"}, **endpoint)), asyncio.get_running_loop()
    rewards, loop = asyncio.run(main())
    assert rewards == [1.0, 0.0] and closed == [loop, loop]
    with pytest.raises(TypeError, match="names _value, not a subclass of openenv's MCPEnvironment"):
        openenv_adapter.make_agent("arith_env:_value", {})


def test_the_row_resets_the_episode_with_a_seed_of_its_own():
    """reset gets the row's fields (all of them with **kwargs, else those it names) and a seed from the row alone:
    the same on every process and every sample; a row's own integer seed wins."""
    def named(seed=None, episode_id=None, answer=None):
        pass

    def every(seed=None, episode_id=None, **kwargs):
        pass
    row = {"prompt": "2+3=", "answer": "5", "level": 2}
    seed, episode_id, fields = reset_arguments(every, row)
    assert seed == episode_seed(dict(reversed(row.items()))) and episode_id == f"{seed:08x}"
    assert fields == row and seed != episode_seed({**row, "answer": "6"}) and 0 <= seed < 2 ** 32
    assert reset_arguments(named, {**row, "seed": 7, "episode_id": "e"}) == (7, "e", {"answer": "5"})


def test_the_plan_names_what_is_wrong_without_importing_openenv(tmp_path):
    """One line per bad spec, read from files: neither openenv nor the environment's module is imported."""
    (tmp_path / "typed_env.py").write_text(
        "from openenv.core.env_server.interfaces import Environment\nclass Echo(Environment):\n    pass\n"
        "class Louder(Echo):\n    def __init__(self, volume=1):\n        pass\n")
    code = """
import json, sys
from evenrl.agents.job import agent_problem
specs = [("openenv:arith_env:ArithmeticEnv", {"max_steps": 3}), ("openenv:arith_env:Nope", {}),
         ("openenv:no_such_env:Env", {}), ("openenv:arith_env", {}), ("openenv:typed_env:Louder", {}),
         ("openenv:arith_env:ArithmeticEnv", {"steps": 3}), ("openenv:arith_env:ArithmeticEnv", {"x": float("nan")})]
print(json.dumps([agent_problem(s, a) for s, a in specs] + [[m for m in ("openenv", "arith_env", "torch")
                                                             if m in sys.modules]]))
"""
    env = {**ENV, "PYTHONPATH": f"{EXAMPLES}:{tmp_path}:{ENV['PYTHONPATH']}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=EXAMPLES.parent)
    *lines, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert lines[0] is None and imported == []
    assert lines[1] == "examples/arith_env.py defines no class 'Nope' at top level"
    assert lines[2] == "names module 'no_such_env', which is not on the Python path here (PYTHONPATH?)"
    assert lines[3].startswith("is not 'openenv:package.module:EnvClass'")
    assert "Louder is an OpenEnv Environment with typed actions; only MCPEnvironment subclasses" in lines[4]
    assert lines[5] == "examples/arith_env.py: ArithmeticEnv.__init__ takes no argument 'steps' (rollout.agent_args)"
    assert lines[6].startswith("has rollout.agent_args that are not JSON values")


def test_without_openenv_the_plan_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(openenv_adapter, "findable", lambda module: module != "openenv")
    assert agent_problem(SPEC) == "needs openenv-core, which is not installed here: pip install -e '.[environments]'"


@pytest.mark.slow
def test_evenrl_trains_the_example_on_the_environments_rewards_and_only_the_sampled_tokens(caller, tmp_path):
    """examples/openenv.yaml, two steps on one process, the episodes' calls over real HTTP from the contained workers:
    every trajectory is the model's two calls chained into one sample (the harness sends the history back as the
    endpoint gave it), none fails, the trained tokens are the two replies and the tool turn between them is not
    trained, and the mean reward is the environment's verdict (5 is right for 2+3, wrong for 3+4), not the math
    reward's on the last reply (which the final tool call leaves empty: 0). The same run on 2 processes, beside it, gives
the same rewards and samples and weights within 1e-5: every sample of a row gets the same episode (reset's seed is
the row's), whichever rank plays it. At train.lr=1e-4, not the example's 1e-3: the taught model earns the same reward
on every sample of a row, so the only gradient is the entropy bonus's, small, and Adam's first step g / (|g| + eps)
turns the fp32 rounding of a near-zero gradient entry into lr-sized weight differences (at 1e-3: 1.3e-5 and 1.5e-5,
one entry of 4096 in a q_proj, every other within 1e-6)."""
    model, sampled, tool_turn = caller
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ["train", EXAMPLES / "openenv.yaml", f"model.path={model}", f"data.path={data}", "data.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=40", "rollout.temperature=0.5", "train.steps=2",
            "algo.entropy_coef=0.1", "train.lr=1e-4", "log.progress=false", "log.tensorboard=false"]
    env = {**ENV, "PYTHONPATH": f"{EXAMPLES}:{ENV['PYTHONPATH']}"}
    jobs = [Job(*args, f"log.run_dir={tmp_path / 'run'}", env=env),
            Job(*args, f"log.run_dir={tmp_path / 'two'}", "--nproc-per-node", 2, env=env)]
    try:
        run, _ = [job.wait() for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert "Traceback" not in run.stdout + run.stderr
    for x, y in zip(metrics(tmp_path / "run"), metrics(tmp_path / "two"), strict=True):
        for k in ("reward/mean", "reward/std", "samples", "response/sampled_length_mean", "agent/chained_calls"):
            assert x[k] == y[k], (x["step"], k)
    assert max_diff(final_params(tmp_path / "run"), final_params(tmp_path / "two")) < 1e-5
    taught = load_file(str(Path(model) / "model.safetensors"))
    assert max_diff(taught, final_params(tmp_path / "run")) > 5e-5  # the weights moved: the comparison means something
    m, after = metrics(tmp_path / "run")
    assert after["reward/failures"] == 0 and after["agent/history_breaks"] == 0
    assert m["reward/mean"] == 0.5 and m["reward/failures"] == 0 and m["samples"] == 4
    assert m["agent/calls_per_trajectory"] == 2 and m["agent/chained_calls"] == 4 and m["agent/history_breaks"] == 0
    assert m["response/sampled_length_mean"] == sampled and m["response/length_mean"] == sampled + tool_turn
