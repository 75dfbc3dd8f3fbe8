"""Multi-turn rollouts (rollout.env), in one process: tool calls, the built-in tools, containment of environment and
tool code, the chat-template check, how a trajectory's tokens are laid out, and the loss and per-token returns on
trajectories against naive loops. The runs on several processes, vLLM and resume: tests/test_multiturn_runs.py."""

from __future__ import annotations

import functools
import inspect
import json
import subprocess
import sys

import pytest
import torch

from e2e import ENV, evenrl_here, requests
from evenrl.agents.rollout import Agents
from evenrl.config import RunConfig
from evenrl.core.aggregation import Denominators
from evenrl.core.batch import Batch, Ragged
from evenrl.engines.base import Completion, row_seed
from evenrl.engines.hf import HFEngine
from evenrl.envs.session import EnvSession
from evenrl.envs.template import prefix_problem, tokenizer_render
from evenrl.envs.toolcalls import ToolCall, parse_tool_calls
from evenrl.envs.tools import calculator
from evenrl.errors import UsageError
from evenrl.isolation import pool
from evenrl.isolation.code import run_code
from evenrl.models.forward import response_logprobs
from evenrl.models.loading import load_policy
from evenrl.rollout.source import TrajectorySource
from evenrl.rollout.trajectories import Turns, trajectory_columns
from evenrl.testing import make_tiny_model
from evenrl.train.objectives import STAT_NAMES, rl_objective
from evenrl.train.step import add_token_returns
from evenrl.train.update import minibatch_update

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tools-model")), chat_template="tools", seed=3)


def config(model, **rollout) -> RunConfig:
    return RunConfig.model_validate({"model": {"path": model}, "rewards": {"timeout_s": 20.0},
                                    "rollout": {"env": "calculator", "samples_per_prompt": 2, "max_new_tokens": 96,
                                                "max_turns": 3, "max_trajectory_tokens": 256, **rollout}})


class Script:
    """An engine that answers from a script, reply(key, sample, turn) -> text, ended by EOS and cut at the call's
    max_new_tokens; it records the tokens each request was given."""

    name, needs_weights = "script", False

    def __init__(self, tokenizer, reply):
        self.tok, self.reply, self.seen = tokenizer, reply, {}

    def generate(self, requests, params):
        out = []
        for r in requests:
            out.append([])
            for s in r.samples:
                self.seen[(r.key, s, r.turn)] = list(r.prompt)
                ids = self.tok(self.reply(r.key, s, r.turn), add_special_tokens=False)["input_ids"]
                ids = (ids + [self.tok.eos_token_id])[:params.max_new_tokens]
                out[-1].append(Completion(r.key, s, ids, [-0.5] * len(ids), ids[-1] == self.tok.eos_token_id))
        return out


def run_turns(model, reply, rows, **rollout):
    cfg = config(model, **rollout)
    _, tok = load_policy(model)
    turns = Turns(cfg)
    path = model + "/rows.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    rows, tokens, openings, _ = turns.load(tok, path)
    engine = Script(tok, reply)
    from evenrl.engines.base import sampling_params

    out = turns.generate(engine, requests(tokens, list(range(len(rows))), 1, sample_ranges=[(0, 2)] * len(rows)),
                         sampling_params(cfg), rows=rows, openings=openings)
    return out, tokens, tok, engine


# ------------------------------------------------------------------------------------------ tools

def test_tool_calls_are_read_in_hermes_format():
    text = ('I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+2"}, None),
                                      ToolCall("f", {"x": 1}, None)]
    assert parse_tool_calls("no calls here") == []
    bad = parse_tool_calls('<tool_call>{"name": 1}</tool_call><tool_call>{oops</tool_call>'
                           '<tool_call>{"name": "f", "arguments": [1]}</tool_call><tool_call>{"name": "g"')
    assert [c.error is not None for c in bad] == [True, True, True, True]
    assert "without </tool_call>" in bad[-1].error and "not JSON" in bad[1].error


def test_calculator_is_exact_and_evaluates_no_python():
    assert calculator("(12 + 30) * 2") == "84"
    assert calculator("1234 + 5678") == "6912"
    assert calculator("7 / 2") == "3.5" and calculator("2 ** 10") == "1024" and calculator("-3 % 5") == "2"
    assert calculator("0.1 + 0.2") == "0.3"  # exact fractions, not binary floats
    for bad in ("__import__('os').system('id')", "x + 1", "abs(-1)", "(1).real", "[1, 2]", "2 ** 10 ** 9", "1 / 0",
                "9" * 300):
        assert calculator(bad).startswith("error"), bad


def test_python_tool_runs_code_in_a_contained_process():
    """Each of these ends quickly with a status the model is shown; none reaches the network or the trainer."""
    assert run_code("print(6 * 7)") [:2] == ("ok", "42\n")
    assert run_code("while True: pass", cpu_s=1, timeout_s=60).status == "cpu"  # CPU time, not wall time
    assert run_code("import time; time.sleep(60)", timeout_s=1).status == "timeout"
    assert run_code("x = bytearray(10 << 30)").status == "memory"
    printed = run_code("print('x' * (4 << 20))")
    assert printed.status == "output" and len(printed.output) == 16_384
    net = run_code("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)")
    assert net.status in ("error", "blocked")  # Landlock refuses TCP connect, else the namespace has no route
    assert any(said in net.output for said in ("Permission denied", "unreachable", "not allowed")), net
    assert net.sandbox == "namespaces"
    where = run_code("import os; print(os.getcwd()); open('f', 'w').write('hi')")
    assert where.status == "ok" and where.output == "/tmp\n"  # the sandbox's own /tmp (tests/test_sandbox.py)
    raised = run_code("raise ValueError('no')")
    assert raised.status == "error" and raised.output.strip().endswith("ValueError: no")


def test_misbehaving_tools_and_environments_are_contained(capfd):
    """A tool that raises or allocates 10 GiB becomes an error message to the model; one that prints 100 MiB is cut
    at the worker's output cap; one that hangs fails its step (the trajectory ends as a failure, rewards.on_failure
    decides its fate); an environment whose state does not pickle or whose step returns garbage fails its step."""
    pool._pool().close()  # fresh workers, so their output reaches this test's captured stderr
    session = EnvSession("toy_envs:Faulty", RunConfig.model_validate({"rewards": {"timeout_s": 3.0}}).rewards)
    row = {"prompt": "p", "answer": "a"}

    def call(name, args):
        return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(args)}}}</tool_call>'

    boom, hog, shout, hang = session.steps([(None, row, 0, call("boom", {"reason": "nope"})),
                                            (None, row, 0, call("hog", {"gib": 10})),
                                            (None, row, 0, call("shout", {"mib": 100})),
                                            (None, row, 0, call("hang", {"seconds": 60}))])
    assert boom[0] == "ok" and "error: boom raised RuntimeError: nope" in boom[1][1][0][0]["content"]
    assert hog[0] == "ok" and "MemoryError" in hog[1][1][0][0]["content"] and hog[1][1][4] == 1
    assert shout[0] == "ok" and shout[1][1][0][0]["content"] == "done"
    assert hang[0] == "timeout"
    err = capfd.readouterr().err
    assert "output of this call cut at 16,384 bytes" in err and len(err) < 100_000
    for spec, needle in (("toy_envs:Unpicklable", "cannot be pickled"),
                         ("toy_envs:Broken", "expected evenrl.envs.Step")):
        (kind, message), = EnvSession(spec, RunConfig().rewards).steps([(None, row, 0, "hi")])
        assert kind == "raised" and needle in message


# ------------------------------------------------------------------------------------------ trajectories

def test_a_trajectory_holds_the_sampled_tokens_and_the_rendered_environment_turns(tools_model):
    """Turn 0 calls the calculator, turn 1 answers: the trajectory is prompt + turn 0's sampled ids + the tool turn
    as the template appends it + turn 1's ids; loss_mask marks the sampled ids, the engine's log-probs are kept for
    them and 0 elsewhere, the engine saw exactly the trajectory's tokens at turn 1, the reward is the math reward."""
    rows = [{"prompt": "12+30=", "answer": "42"}]
    replies = {0: CALL % "12+30", 1: "42"}
    (trajs,), (prompt,), tok, engine = run_turns(tools_model, lambda k, s, t: replies[t], rows)
    for t in trajs:
        ids = [tok(CALL % "12+30", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
               tok("\n<tool_response>42</tool_response>\nassistant: ", add_special_tokens=False)["input_ids"],
               tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
        assert t.token_ids == ids[0] + ids[1] + ids[2]
        assert t.loss_mask == [True] * len(ids[0]) + [False] * len(ids[1]) + [True] * len(ids[2])
        assert t.logprobs == [-0.5] * len(ids[0]) + [0.0] * len(ids[1]) + [-0.5] * len(ids[2])
        assert (t.reward, t.turns, t.tool_calls, t.tool_errors, t.finished, t.error) == (1.0, 2, 1, 0, True, None)
        assert engine.seen[(0, t.sample_index, 1)] == prompt + ids[0] + ids[1]
    rendered = tok.decode(prompt + trajs[0].token_ids, skip_special_tokens=False)
    assert rendered.startswith("system: tools: calculator(expression)\nuser: 12+30=\nassistant: <tool_call>")
    cols = trajectory_columns(trajs)
    assert cols["sampled_len"].tolist() == [len(ids[0]) + len(ids[2])] * 2 and cols["turns"].tolist() == [2, 2]


def test_a_malformed_tool_call_reaches_the_model_as_an_error_turn(tools_model):
    replies = {0: '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', 1: "oops", 2: "1"}
    (trajs,), _, tok, _ = run_turns(tools_model, lambda k, s, t: replies[t], [{"prompt": "1+0=", "answer": "1"}])
    t = trajs[0]
    env_text = tok.decode([i for i, m in zip(t.token_ids, t.loss_mask) if not m])
    assert "<tool_response>error: malformed tool call: not JSON" in env_text
    assert (t.tool_calls, t.tool_errors, t.turns, t.reward) == (1, 1, 2, 0.0)  # "oops" is the (wrong) final answer


def test_caps_end_trajectories_unfinished(tools_model):
    """A tool turn that does not fit in max_trajectory_tokens ends the trajectory unfinished; a turn cut at
    max_new_tokens (no EOS) gets its environment step like any other and the conversation goes on (the template
    closes the reply: its EOS is then an environment token), the trajectory unfinished if its last turn was cut;
    max_turns ends a trajectory finished."""
    rows = [{"prompt": "1+1=", "answer": "2"}]
    calls = lambda k, s, t: CALL % "1+1"  # noqa: E731  the model never stops calling
    _, tok = load_policy(tools_model)
    first = len(tok(CALL % "1+1", add_special_tokens=False)["input_ids"]) + 1  # with EOS
    (trajs,), _, _, _ = run_turns(tools_model, calls, rows, max_trajectory_tokens=first + 5)
    assert [(t.turns, t.finished, len(t.token_ids)) for t in trajs] == [(1, False, first)] * 2
    (trajs,), _, tok, _ = run_turns(tools_model, calls, rows, max_new_tokens=10)
    assert [(t.turns, t.finished, sum(t.loss_mask), t.tool_errors) for t in trajs] == [(3, False, 30, 3)] * 2
    # every call cut at max_new_tokens before </tool_call>: counted (tools/cut_calls, warned once a run)
    assert [t.cut_calls for t in trajs] == [3, 3] and trajectory_columns(trajs)["cut_calls"].tolist() == [3, 3]
    env = [i for i, m in zip(trajs[0].token_ids, trajs[0].loss_mask) if not m]
    assert env[0] == tok.eos_token_id and "<tool_response>error: malformed tool call" in tok.decode(env)
    (trajs,), _, _, _ = run_turns(tools_model, calls, rows, max_turns=2)
    assert [(t.turns, t.finished, t.tool_calls, t.cut_calls) for t in trajs] == [(2, True, 2, 0)] * 2


def test_turn_streams_are_keyed_and_layout_free(tools_model):
    """Turn 0 is the single-turn stream; later turns have their own. Real sampling (the hf engine on the tiny
    model, feedback env): the same trajectories whether a prompt's samples are made together or one by one."""
    assert row_seed(3, 5, 7, 1) == row_seed(3, 5, 7, 1, 0) != row_seed(3, 5, 7, 1, 1)
    cfg = config(tools_model, env="feedback", max_new_tokens=6, samples_per_prompt=3)
    model, tok = load_policy(tools_model)
    turns = Turns(cfg)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "id": a} for a in range(2)]
    openings = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    tokens = [tok(tokenizer_render(tok)(o, None, True), add_special_tokens=False)["input_ids"] for o in openings]
    turns.tokenizer = tok
    engine = HFEngine(model, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id)
    from evenrl.engines.base import sampling_params

    params = sampling_params(cfg)
    whole = turns.generate(engine, requests(tokens, [0, 1], 2, sample_ranges=[(0, 3)] * 2), params, rows=rows,
                           openings=openings)
    split = [turns.generate(engine, requests([tokens[p]], [p], 2, sample_ranges=[(s, 1)]), params, rows=[rows[p]],
                            openings=[openings[p]])[0][0] for p in (1, 0) for s in (2, 0, 1)]
    flat = {(t.prompt_key, t.sample_index): t for ts in whole for t in ts}
    assert all(t.token_ids == flat[(t.prompt_key, t.sample_index)].token_ids for t in split)
    assert max(t.turns for t in flat.values()) == 3 and any(not m for t in flat.values() for m in t.loss_mask)


# ------------------------------------------------------------------------------------------ the template

STRIPPING = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last and '</think>' in m.content %}"
             "assistant: {{ m.content.split('</think>')[-1].lstrip() }}<|endoftext|>\n"
             "{% elif m.role == 'assistant' %}assistant: {{ m.content }}<|endoftext|>\n"
             "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")


def test_both_trajectory_loops_are_the_one_protocol():
    """rollout.env's Turns and rollout.agent's Agents are what the step, the reserved rollout ranks, evaluation and
    partial rollouts call through one TrajectorySource (evenrl.rollout.source): Agents sits below that package and
    matches it by shape only, so its methods' parameters are checked here, name and kind, in order."""
    for loop in (Turns, Agents):
        for name in ("load", "generate", "advance"):
            want = inspect.signature(getattr(TrajectorySource, name)).parameters.values()
            got = inspect.signature(getattr(loop, name)).parameters.values()
            assert [(p.name, p.kind) for p in got] == [(p.name, p.kind) for p in want], (loop.__name__, name)


def test_a_template_that_rewrites_history_is_refused_before_weights_load(tools_model, tmp_path, capsys):
    """A thinking-style template that strips earlier <think> blocks: `evenrl plan` reports it, `evenrl train`
    stops with one line at the plan, before any weights load (here: unreadable weights it never gets to)."""
    model = make_tiny_model(str(tmp_path / "m"), chat_template=True)
    (tmp_path / "m" / "chat_template.jinja").write_text(STRIPPING)
    _, tok = load_policy(model)
    assert "rewrites history" in prefix_problem(tokenizer_render(tok), None, ("user",))
    assert prefix_problem(tokenizer_render(load_policy(tools_model)[1]), None, ("user", "tool")) is None
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [f"model.path={model}", f"data.path={data}", "rollout.env=feedback", f"log.run_dir={tmp_path / 'r'}"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train: {steps: 1}\n")
    code, out, err = evenrl_here(capsys, "plan", cfg, *args)
    assert code == 1 and "ERROR   env-template" in out and "rewrites history" in " ".join(out.split())
    code, _, err = evenrl_here(capsys, "train", cfg, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "rewrites history" in err, err
    with pytest.raises(UsageError, match="rewrites history"):  # a user env: the trainer's own check
        Turns(RunConfig.model_validate({"model": {"path": model}, "rollout": {"env": "toy_envs:Counter"}}))


# ------------------------------------------------------------------------------------------ the loss

TURNS = [[(3, True), (2, False), (4, True)], [(2, True), (3, False), (1, True), (2, False), (2, True)],
         [(5, True), (1, False), (1, True)], [(1, True), (4, False), (3, True)]]  # (tokens, sampled) stretches


def trajectory_batch(seed=0):
    """Four trajectories of random tokens: a prompt, then sampled and environment stretches (TURNS)."""
    g = torch.Generator().manual_seed(seed)
    tokens, resp, masks = [], [], []
    for p, pieces in zip((5, 3, 6, 4), TURNS):
        mask = [m for n, m in pieces for _ in range(n)]
        tokens.append(torch.randint(3, 60, (p + len(mask),), generator=g))
        resp.append(len(mask))
        masks.append(torch.tensor(mask))
    return tokens, resp, masks


def test_loss_on_trajectories_is_zero_on_environment_tokens_and_matches_a_naive_loop(tools_model):
    """One optimizer step (SGD, lr 1) through rl_objective and minibatch_update on trajectories: the gradient of
    the loss with respect to the log-probs of environment tokens is exactly 0, and the parameters move as a naive
    loop over the sampled tokens alone moves them: per token -A x exp(logp - logp.detach()), token-mean over the
    sampled tokens of all rows."""
    model, _ = load_policy(tools_model)
    naive, _ = load_policy(tools_model)
    tokens, resp, masks = trajectory_batch()
    adv = torch.tensor([1.0, -0.5, -1.2, 0.8])
    batch = Batch({"tokens": Ragged.of(tokens, torch.long), "response_len": torch.tensor(resp), "advantage": adv,
                   "engine_logp": Ragged.of([torch.zeros(n) for n in resp], torch.float32),
                   "loss_mask": Ragged.of(masks, torch.bool), "version": torch.zeros(4, dtype=torch.long),
                   "reward_failed": torch.zeros(4, dtype=torch.bool), "finished": torch.ones(4, dtype=torch.bool)})
    cfg = RunConfig.model_validate({"model": {"path": tools_model}})
    sampled = float(sum(int(m.sum()) for m in masks))
    seen = []

    def loss_fn(outputs, targets, mask, mb):
        outputs.retain_grad()
        seen.append((outputs, mask))
        return rl_objective(cfg, 1, outputs, targets, mask, mb)

    minibatch_update(model, torch.optim.SGD(model.parameters(), lr=1.0), None, batch, [[0, 1], [2, 3]],
                     Denominators(tokens=sampled, seqs=4.0),
                     forward=functools.partial(response_logprobs, pad_token_id=0, entropy=True), loss_fn=loss_fn,
                     stat_names=STAT_NAMES, aggregation="token-mean", max_grad_norm=0.0, pad_token_id=0)
    for (outputs, mask), rows in zip(seen, ([0, 1], [2, 3])):
        width = mask.shape[1]
        for j, r in enumerate(rows):
            env = torch.zeros(width, dtype=torch.bool)
            env[width - resp[r]:] = ~masks[r]
            assert bool(env.any()) and float(outputs.grad[j][env].abs().max()) == 0.0
            assert float(outputs.grad[j][width - resp[r]:][masks[r]].abs().max()) > 0

    opt = torch.optim.SGD(naive.parameters(), lr=1.0)
    total = 0.0
    for r, n, m, a in zip(tokens, resp, masks, adv.tolist()):
        logp = torch.log_softmax(naive(r[None]).logits[0, :-1].float(), -1).gather(-1, r[1:, None])[:, 0][-n:]
        for t in range(n):
            if m[t]:
                total = total - a * torch.exp(logp[t] - logp[t].detach())
    (total / sampled).backward()
    opt.step()
    with torch.no_grad():
        start = load_policy(tools_model)[0].parameters()
        moved = max(float((a - b).abs().max()) for a, b in zip(naive.parameters(), start))
        diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), naive.parameters()))
    assert moved > 1e-3 and diff <= 1e-6 * moved, (moved, diff)


@pytest.mark.parametrize("advantage", ["reinforce_pp", "gae"])
def test_per_token_returns_step_over_sampled_tokens_only(advantage):
    """REINFORCE++ returns and GAE on trajectories: computed as if the sampled tokens were the whole response
    (environment tokens are no steps of the discounting), 0 on environment tokens."""
    _, resp, masks = trajectory_batch(seed=1)
    g = torch.Generator().manual_seed(2)
    values = [torch.randn(n, generator=g) for n in resp]
    local = Batch({"response_len": torch.tensor(resp), "reward": torch.tensor([1.0, 0.0, 0.5, 2.0]),
                   "loss_mask": Ragged.of(masks, torch.bool),
                   "sampled_len": torch.tensor([int(m.sum()) for m in masks]),
                   "old_values": Ragged.of(values, torch.float32)})
    cfg = RunConfig.model_validate({"algo": {"advantage": advantage, "gamma": 0.9, "lam": 0.8},
                                    "rollout": {"samples_per_prompt": 1}})
    add_token_returns(type("T", (), {"cfg": cfg})(), local)
    raw = torch.split(local["raw_advantage"].values, resp)
    for i, (m, v) in enumerate(zip(masks, values)):
        assert float(raw[i][~m].abs().max()) == 0.0
        vs = v[m].double().tolist()
        want, running, nxt, gae = [], 0.0, 0.0, 0.0
        for t in reversed(range(len(vs))):
            r = float(local["reward"][i]) if t == len(vs) - 1 else 0.0
            if advantage == "reinforce_pp":
                running = r + 0.9 * running
                want.append(running)
            else:
                gae = r + 0.9 * nxt - vs[t] + 0.9 * 0.8 * gae
                nxt = vs[t]
                want.append(gae)
        assert raw[i][m].double().tolist() == pytest.approx(want[::-1], rel=1e-6, abs=1e-6)


# ------------------------------------------------------------------------------------------ the plan

def test_the_plan_knows_turns_and_caps(tools_model, tmp_path):
    """Worst-case samples are prompt + the trajectory cap; a cap that cannot hold max_turns turns is a warning,
    environment turns that may fill most of the cap a note, reward functions an environment ignores a warning,
    an unknown environment an error; and the planner still never imports torch."""
    code = f"""
import sys, json
from evenrl.config import load_config
from evenrl.planner.layout import make_layout
from evenrl.planner.plan import make_plan
common = ["model.path={tools_model}", "rollout.env=calculator", "rollout.max_turns=4", "rollout.max_new_tokens=100"]
p = make_plan(load_config(None, common + ["rollout.max_trajectory_tokens=1000", "rewards.functions=[{{name: math}}]"]),
              make_layout(1, 2))
short = make_plan(load_config(None, common + ["rollout.max_trajectory_tokens=300"]), make_layout(1, 2))
bad = make_plan(load_config(None, ["rollout.env=nosuch.module:Env"]), make_layout(1, 2))
cut = [[f.message for f in make_plan(load_config(None, common[:3] + [f"rollout.{{k}}", "rollout.max_new_tokens=10"]),
                                     make_layout(1, 2)).findings if f.rule == "tool-call-cut"]
       for k in ("env=calculator", "env=feedback", "agent=toy_agents:two_tools")]
print(json.dumps([p.sample_tokens, sorted(f.rule for f in p.findings), sorted(f.rule for f in short.findings),
                  [f.rule for f in bad.findings if f.level == "error"], cut, "torch" in sys.modules]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    tokens, rules, short, errors, cut, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert tokens == 256 + 1000
    assert {"env-tokens", "rewards-unused"} <= set(rules) and not {"env-template", "trajectory-cap"} & set(rules)
    assert "trajectory-cap" in short and "env-tokens" not in short and "tool-call-cut" not in rules
    assert errors == ["env-name"] and not torch_loaded
    # max_new_tokens=10 cannot hold the shortest tool call (14 tokens with the tiny model's tokenizer): a warning
    # where the model may call tools (the calculator's, an agent's), none for an environment without tools
    calculator, feedback, agent = cut
    assert calculator == agent == ['rollout.max_new_tokens=10 cannot hold the shortest tool call '
                                   '(<tool_call>{"name":"f"}</tool_call>: 14 tokens with this tokenizer): any tool '
                                   'call the model writes is cut before it closes and never made'] and feedback == []



def test_an_environment_with_a_vision_language_model_is_refused_before_training(tmp_path):
    """The turn loop carries text only: rollout.env with a Qwen2-VL model is the plan's error (evenrl train runs the
    same plan before loading weights)."""
    from evenrl.config import load_config
    from evenrl.planner.layout import make_layout
    from evenrl.planner.plan import make_plan

    model = make_tiny_model(str(tmp_path / "vl"), arch="qwen2_vl", chat_template=True)
    plan = make_plan(load_config(None, [f"model.path={model}", "rollout.env=calculator"]), make_layout(1, 1))
    assert [f.rule for f in plan.findings if f.level == "error"] == ["env-vision"]
    text = make_plan(load_config(None, [f"model.path={model}"]), make_layout(1, 1))
    assert not [f for f in text.findings if f.level == "error"]

def test_tools_demo_warm_start_teaches_the_tokens_a_trajectory_holds(tools_model, tmp_path):
    """evenrl demo --task tools: the warm start's two rows per problem (the prompt -> the tool call; the conversation
    up to the tool's answer -> the answer) are, token for token, the trajectory the turn loop builds when the model
    follows them."""
    from evenrl.demo import write_tool_data
    from evenrl.envs.builtin import addition_rows

    _, tok = load_policy(tools_model)
    files = write_tool_data(tmp_path, tok, n_train=2, n_rl=1)
    sft = [json.loads(line) for line in files["sft"].read_text().splitlines()]
    rows = addition_rows(2, seed=1)
    script = {(k, t): (sft[2 * k]["answer"] if t == 0 else rows[k]["answer"]) for k in range(2) for t in range(2)}
    trajs, prompts, _, _ = run_turns(tools_model, lambda k, s, t: script[(k, t)], rows)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for k in range(2):
        t = trajs[k][0]
        assert t.reward == 1.0 and t.turns == 2
        assert prompts[k] == enc(sft[2 * k]["prompt"])
        answer = enc(sft[2 * k + 1]["answer"]) + [tok.eos_token_id]
        assert prompts[k] + t.token_ids == enc(sft[2 * k + 1]["prompt"]) + answer


def test_a_bad_environment_is_one_line_before_anything_runs(tools_model, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tools_model}}}\n")
    (tmp_path / "script_env.py").write_text("import sys\nsys.exit(0)\n")  # would end `evenrl train` with 0
    monkeypatch.syspath_prepend(str(tmp_path))
    for env, needle in (("nosuch.module:Env", "not importable"), ("calc", "neither a built-in"),
                        ("script_env:Env", "importing script_env called sys.exit(0)")):
        code, _, err = evenrl_here(capsys, "train", cfg, f"rollout.env={env}", f"log.run_dir={tmp_path / 'r'}")
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err
        assert not (tmp_path / "r").exists()
