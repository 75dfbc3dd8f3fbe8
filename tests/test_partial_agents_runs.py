"""Partial rollouts of agents end to end (rollout.partial with rollout.agent=toy_agents:mixed; CPU, gloo, real
processes, the openai client over HTTP). Even rows make 3 calls of up to 6 sampled tokens (two tool results between),
odd rows 2 calls whose second drops the first reply (two samples); a budget of 7 sampled tokens a step cuts them
inside calls and between them, so a trajectory spans 2-3 steps and its tokens 2-3 policy versions.

What is exact: each step starts every carried trajectory's agent again, answers its recorded calls from its
transcript and samples its cut call on from where it stopped (evenrl.agents.replay); what a call samples and where
it is cut follows from step numbers, budgets and the agents' requests, and the endpoint serves requests in rounds
(every running agent's next call), so
  * 1 process, 2 processes and a reserved rollout rank (the transcripts sent to the trainer) give the same rewards,
    calls and trajectories in flight each step, the model within the rounding of summing over other ranks;
  * a run resumed from a checkpoint holding trajectories cut inside a call is bit-identical to the uninterrupted
    one;
  * an agent that asks differently when replayed stops the run in one line naming the trajectory and the call.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from e2e import close_weights, copy_checkpoint, evenrl, evenrl_many, final_params, max_diff, metrics
from evenrl.demo import write_addition_data
from evenrl.testing import make_tiny_model
from evenrl.rollout.carry import unpack

SHAPE = ["rollout.partial=true", "rollout.tokens_per_round=7", "checkpoint.every_steps=2"]
SAME = ["samples", "reward/mean", "reward/std", "response/length_mean", "response/sampled_length_mean",
        "agent/calls_per_trajectory", "agent/chained_calls", "agent/history_breaks", "agent/split_samples",
        "reward/failures", "partial/trained_groups", "partial/in_flight", "partial/waiting", "partial/oldest_age",
        "partial/waited", "rollout/versions_per_sample", "rollout/tokens_per_version"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 and 2 processes side by side, a reserved rollout rank, then 2 processes resumed from the 2-process run's
    checkpoint of step 2 (trajectories in flight, some cut inside a call)."""
    root = tmp_path_factory.mktemp("partial-agents")
    write_addition_data(root / "addition.jsonl")
    cfg = root / "cfg.yaml"
    model = make_tiny_model(str(root / "model"), chat_template="tools", seed=0)
    cfg.write_text(f"model: {{path: {model}}}\n"
                   f"data: {{path: {root / 'addition.jsonl'}, prompts_per_step: 4, max_prompt_tokens: 48}}\n"
                   "rollout: {samples_per_prompt: 3, max_new_tokens: 6, agent: 'toy_agents:mixed', "
                   "max_trajectory_tokens: 128, agent_timeout_s: 60}\n"
                   "algo: {advantage: grpo, entropy_coef: 0.1}\n"
                   "train: {steps: 4, lr: 1.0e-3, token_cap_per_micro_batch: 512}\n"
                   "log: {progress: false, tensorboard: false}\n")
    run = lambda name, *more: ["train", cfg, *SHAPE, f"log.run_dir={root / name}", *more]  # noqa: E731
    evenrl_many({"two": run("two", "--nproc-per-node", 2), "one": run("one")})
    evenrl(*run("reserved", "--nproc-per-node", 2, "--rollout-devices", 1))
    copy_checkpoint(root / "two", 2, root / "resumed")
    evenrl(*run("resumed", "--nproc-per-node", 2, "--resume"))
    state = torch.load(root / "two" / "checkpoints" / "step-000002" / "trainer.pt", weights_only=True)
    return root, cfg, unpack(state["carry"]["live"])


@pytest.mark.slow
def test_the_same_agent_trajectories_on_one_two_and_reserved_processes(runs):
    root, _, _ = runs
    one = metrics(root / "one")
    assert [r["step"] for r in one] == [1, 2, 3, 4]
    for name in ("two", "reserved"):
        for x, y in zip(one, metrics(root / name), strict=True):
            for k in SAME:
                assert x[k] == y[k], (name, x["step"], k, x[k], y[k])
        # Adam's amplification of rounding (e2e.close_weights); measured 1.7e-6 on 2 processes, 0 reserved
        assert not (far := close_weights(final_params(root / "one"), final_params(root / name))), (name, far)
    assert one[0]["samples"] == 0 and one[0]["partial/in_flight"] == 12  # 7 tokens: no trajectory done in step 1
    trained = [r for r in one if r["samples"]]
    assert sum(r["samples"] for r in trained) >= 24 and all(r["reward/failures"] == 0 for r in trained)
    assert any(r["agent/chained_calls"] > 0 for r in trained) and any(r["agent/split_samples"] for r in trained)
    assert sum(r["rollout/versions_per_sample"][1] + r["rollout/versions_per_sample"][2] for r in trained) > 0
    assert any(abs(r["policy/is_weight"] - 1) > 1e-3 for r in trained)  # tokens of older policies corrected
    start = load_file(str(root / "model" / "model.safetensors"))
    assert max_diff(start, final_params(root / "one")) > 1e-4  # the weights moved: the comparison means something


@pytest.mark.slow
def test_resumed_from_trajectories_cut_inside_a_call_is_the_uninterrupted_run(runs):
    """The checkpoint holds each in-flight trajectory's transcript: its calls' prompts as the endpoint rendered them,
    their tokens, log-probs and versions, the cut call's tokens so far; resumed, the agents are started again and
    answered from it, and every step's metrics and the model are bit-identical."""
    root, _, live = runs
    assert len(live) == metrics(root / "two")[1]["partial/in_flight"] > 0
    assert any(not r.talk["calls"][-1][4] and r.talk["calls"][-1][2] > 0 for r in live)  # cut inside a call
    for r in live:
        assert len(r.tokens) == len(r.logprobs) == len(r.versions) == sum(c[2] for c in r.talk["calls"])
        assert set(r.versions.tolist()) <= {0, 1}
    whole, resumed = metrics(root / "two"), metrics(root / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for x, y in zip(whole, resumed):
        for k in SAME + ["policy/loss", "policy/is_weight", "entropy"]:
            assert x.get(k) == y.get(k), (x["step"], k)
    assert max_diff(final_params(root / "two"), final_params(root / "resumed")) == 0.0


@pytest.mark.slow
def test_an_agent_that_asks_differently_when_replayed_stops_the_run_in_one_line(runs):
    root, cfg, _ = runs
    proc = evenrl("train", cfg, *SHAPE, "rollout.agent=toy_agents:forgetful", "train.steps=2",
                  f"log.run_dir={root / 'forgetful'}", check=False)
    err = [line for line in proc.stderr.splitlines() if line.startswith("evenrl")]
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(err) == 1 and "toy_agents:forgetful" in err[0] and "the trajectory of step 1, prompt " in err[0], err
    assert "agent is not deterministic: call 2's request differs from the recorded one;" in err[0], err
