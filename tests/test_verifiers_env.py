"""rollout.agent "verifiers:ENV_ID" (evenrl.agents.verifiers_adapter): a verifiers taskset (examples/vf_arith.py) trained
as it is on a tiny model, one process, one step. The rewards are the environment's own rubric on the replies the
endpoint sampled (with the reward weight rollout.agent_args gave it), the trained tokens are the endpoint's, and the
plan names a bad ENV_ID or a runtime the workers cannot run in one line each. The same step on 2 processes (run beside
the 1-process one) gives the same rewards and samples and weights within 1e-5: the episodes' calls depend on their row
and the replies alone (measured 2.6e-6 for 1 vs 3 processes over 2 steps)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from e2e import ENV, Job, evenrl_here, final_params, max_diff, metrics
from evenrl.agents import verifiers_adapter
from evenrl.testing import make_tiny_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SPECIAL = ("<bos>", "<|endoftext|>", "<pad>", "<unk>")  # make_tiny_model's; the endpoint's replies decode without


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("verifiers")
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {make_tiny_model(str(root / 'model'), chat_template=True, seed=0)}}}
data: {{path: {EXAMPLES / 'vf_arith.jsonl'}, extra_fields: [task], prompts_per_step: 2, max_prompt_tokens: 64}}
rollout: {{samples_per_prompt: 2, max_new_tokens: 12, max_trajectory_tokens: 12, agent_max_calls: 1,
          agent: "verifiers:vf_arith", agent_timeout_s: 120,
          agent_args: {{taskset: {{task: {{rewards: {{digits: {{weight: 0.5}}}}}}}}}}}}
algo: {{advantage: grpo, entropy_coef: 0.1}}
train: {{steps: 1, lr: 1.0e-3, token_cap_per_micro_batch: 512}}
log: {{progress: false, tensorboard: false, samples_every_steps: 1, run_dir: {root / 'run'}}}
""")
    return cfg


def test_a_verifiers_environment_trains_with_its_own_rubric(config, tmp_path, monkeypatch):
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), ENV["PYTHONPATH"]])}
    run, two = config.parent / "run", config.parent / "two"
    jobs = [Job("train", config, env=env), Job("train", config, f"log.run_dir={two}", "--nproc-per-node", 2, env=env)]
    try:
        for job in jobs:
            job.wait()
    finally:
        for job in jobs:
            job.kill()
    (m,) = metrics(run)
    (m2,) = metrics(two)
    for k in ("reward/mean", "reward/std", "samples", "response/sampled_length_mean", "reward/failures"):
        assert m[k] == m2[k], k
    assert max_diff(final_params(run), final_params(two)) < 1e-5
    start = load_file(str(config.parent / "model" / "model.safetensors"))
    assert max_diff(start, final_params(run)) > 1e-4  # the weights moved: the comparison means something
    assert m["reward/failures"] == 0 and m["agent/calls_per_trajectory"] == 1 and m["agent/history_breaks"] == 0
    assert m["response/sampled_length_mean"] > 0
    assert 0 <= m["rollout/logprob_mismatch"] < 1e-5 and m["rollout/mismatch_fraction"] == 0  # the endpoint's tokens

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import vf_arith  # the environment's own reward functions, and its taskset: the committed rows are its export

    verifiers_adapter.export_tasks("vf_arith", str(tmp_path / "tasks.jsonl"))
    assert (tmp_path / "tasks.jsonl").read_text() == (EXAMPLES / "vf_arith.jsonl").read_text()
    rows = [json.loads(x) for x in (EXAMPLES / "vf_arith.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for s in samples:
        reply, answer = s["completion"], rows[s["row_id"]]["task"]["answer"]
        for token in SPECIAL:
            reply = reply.replace(token, "")
        want = float(vf_arith.last_number(reply.strip()) == answer) + 0.5 * vf_arith.digit_share(reply, answer)
        assert s["reward"] == pytest.approx(want, abs=1e-6), s
    assert any(s["reward"] > 0 for s in samples)  # the rubric scored something: the 0.5 weight is agent_args'


LONG_ID = "primeintellect/" + "no-such-env-" * 20 + "@0.1.0"


@pytest.mark.parametrize("override", [
    f"rollout.agent=verifiers:{LONG_ID}",
    "rollout.agent=verifiers:primeintellect/does-not-exist-env@0.1.0",
    "rollout.agent=verifiers:a b",
    f"rollout.agent_args={{taskset: {{id: {'x' * 300}}}}}",
    f"rollout.agent_args={{agent: {{runtime: {{type: {'p' * 300}}}}}}}",
    f"rollout.agent_args={{agent: {{harness: {{id: {'h' * 300}}}}}}}",
])
def test_a_bad_environment_is_one_short_line(config, monkeypatch, override):
    """`evenrl train`'s refusal of a bad ENV_ID or agent_args, by its plan and by the agents' own check: one line
    of at most 250 characters naming the field, its value cut short and what is allowed (a 49-character ENV_ID made
    a line of 407, a long one of 1,106)."""
    from evenrl.config import load_config
    from evenrl.errors import UsageError
    from evenrl.planner.layout import make_layout
    from evenrl.train.preflight import preflight
    from evenrl.rollout.trajectories import make_turns

    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = load_config(str(config), [override])
    for refuse in (lambda: preflight(cfg, make_layout(1, 1)), lambda: make_turns(cfg)):
        with pytest.raises(UsageError) as e:
            refuse()
        line = str(e.value)
        assert "\n" not in line and len(line) <= 250 and "rollout.agent" in line, (len(line), line)


@pytest.mark.parametrize("override, says", [
    ("rollout.agent=verifiers:no_such_env", "no module 'no_such_env' on the Python path"),
    ("rollout.agent_args={agent: {runtime: {type: prime}}}", "agent.runtime.type 'prime'"),
])
def test_the_plan_names_what_cannot_run(config, capsys, monkeypatch, override, says):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    code, out, err = evenrl_here(capsys, "plan", config, override)
    assert code == 1, (out, err)
    assert out.count("ERROR") == 1 and "ERROR   agent-name: rollout.agent" in out, out
    assert says in " ".join(out.split()), out  # the finding's line, as the plan wraps it


def test_an_environment_for_an_older_verifiers_is_named_by_the_plan(tmp_path, monkeypatch):
    """An environment written for verifiers before 0.4 (load_environment(), no __all__ exporting a Taskset) fails
    to load in every worker: the plan reads it (never imports it) and says so; a 0.4 taskset passes."""
    (tmp_path / "old_env.py").write_text("import verifiers as vf\n\n\ndef load_environment(**kwargs):\n"
                                         "    return vf.SingleTurnEnv(dataset=None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    why = verifiers_adapter.problem("old_env", {})
    assert why == ("names module 'old_env' (old_env.py), which exports no Taskset subclass through __all__ (what "
                   "verifiers 0.4 loads); its load_environment() is an older verifiers API's"), why
    assert verifiers_adapter.problem("vf_arith", {}) is None


def test_without_verifiers_the_plan_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # find_spec of a module set to None raises ValueError
    assert "pip install -e '.[environments]'" in verifiers_adapter.problem("vf_arith", {})


def test_a_row_without_its_task_fails_its_trajectory_saying_how_to_write_one():
    with pytest.raises(ValueError, match=r"no 'task' object .*export_tasks .*extra_fields: \[task\]"):
        asyncio.run(verifiers_adapter._episode(None, {"prompt": "1+1", "id": 0}, "http://127.0.0.1:9/v1", "m"))


def test_the_plan_imports_neither_verifiers_nor_the_environment():
    code = """
import sys
from evenrl.config import load_config
from evenrl.planner.layout import make_layout
from evenrl.planner.plan import make_plan
p = make_plan(load_config(None, ["rollout.agent=verifiers:vf_arith", "rollout.agent_args={taskset: {num_tasks: 4}}"]),
              make_layout(1, 1))
print([f.rule for f in p.findings if f.level == "error"], [m for m in ("torch", "verifiers", "vf_arith") if m in sys.modules])
"""
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), ENV["PYTHONPATH"]])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[] []", out.stdout
