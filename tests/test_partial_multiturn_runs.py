"""Partial rollouts of multi-turn trajectories end to end (rollout.partial with rollout.env=feedback; CPU, gloo, real
processes). The tiny random model's replies are noise, so most trajectories run all 3 turns of up to 4 sampled tokens
(12 sampled, with two environment turns between); a budget of 5 sampled tokens a step cuts them inside replies and
between turns, so a trajectory spans 3 steps and its tokens 3 policy versions.

What is exact: which trajectories continue, where they were cut and under which version follows from the step
numbers and the budget, and each reply draws from its (birth step, position, sample, turn) stream from its position
in the reply on, so
  * the run on 1 process, on 3, and with a reserved rollout rank (its trajectories' turn-loop state sent to the
    trainer) has the same rewards, turns, tokens and trajectories in flight at every step, and its model within
    the float rounding of summing gradients over another number of ranks;
  * under train.reproducibility=bitwise the runs on 1 and 3 processes are the same bits (each step's turn loops
    run per canonical batch of new prompts and per carried group), where those under rounding differ;
  * a run killed mid-run and resumed from its checkpoint, which holds the in-flight trajectories' turn-loop state
    (messages, rendering, the environment's pickle, the reply they were cut in), is bit-identical to the
    uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from e2e import BITWISE, assert_same_run, evenrl, evenrl_many, fault_env, final_params, max_diff, metrics
from evenrl.demo import write_addition_data
from evenrl.testing import make_tiny_model
from evenrl.rollout.carry import unpack

SHAPE = ["rollout.partial=true", "rollout.tokens_per_round=5", "rewards.isolate=false", "checkpoint.every_steps=2"]
SAME = ["samples", "reward/mean", "reward/std", "rollout/turns_mean", "response/length_mean",
        "response/sampled_length_mean", "partial/trained_groups", "partial/in_flight", "partial/waiting",
        "partial/oldest_age", "partial/waited", "rollout/versions_per_sample", "rollout/tokens_per_version"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted runs, two at a time, longest first, then the one killed at the start of step 4
    (checkpoint 2 written, step 3 lost) and resumed."""
    root = tmp_path_factory.mktemp("partial-multiturn")
    write_addition_data(root / "addition.jsonl")
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {make_tiny_model(str(root / 'model'), chat_template='tools', seed=0)}}}
data: {{path: {root / 'addition.jsonl'}, prompts_per_step: 4, max_prompt_tokens: 32}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4, env: feedback, max_turns: 3, max_trajectory_tokens: 128}}
algo: {{advantage: grpo, entropy_coef: 0.1}}
train: {{steps: 5, lr: 1.0e-3, token_cap_per_micro_batch: 512}}
log: {{progress: false, tensorboard: false}}
""")
    run = lambda name, *more: ["train", cfg, *SHAPE, f"log.run_dir={root / name}", *more]  # noqa: E731
    evenrl_many({"three": run("three", "--nproc-per-node", 3),
                 "bitwise_three": run("bitwise_three", BITWISE, "--nproc-per-node", 3),
                 "reserved": run("reserved", "--nproc-per-node", 2, "--rollout-devices", 1),
                 "one": run("one"), "bitwise_one": run("bitwise_one", BITWISE)})
    cut = evenrl(*run("cut", "--nproc-per-node", 3), env=fault_env(crash_at_step=4), check=False)
    assert cut.returncode != 0
    state = torch.load(root / "cut" / "checkpoints" / "step-000002" / "trainer.pt", weights_only=True)
    evenrl(*run("cut", "--nproc-per-node", 3, "--resume"))
    return root, unpack(state["carry"]["live"])


@pytest.mark.slow
def test_the_same_trajectories_on_one_three_and_reserved_processes(runs):
    root, _ = runs
    one = metrics(root / "one")
    assert [r["step"] for r in one] == [1, 2, 3, 4, 5]
    for name in ("three", "reserved"):
        for x, y in zip(one, metrics(root / name), strict=True):
            for k in SAME:
                assert x[k] == y[k], (name, x["step"], k, x[k], y[k])
        assert max_diff(final_params(root / "one"), final_params(root / name)) < 1e-5, name
    assert one[0]["samples"] == one[1]["samples"] == 0  # 12 sampled tokens at 5 a step: no group done before step 3
    trained = [r for r in one if r["samples"]]
    assert all(r["rollout/turns_mean"] > 2 for r in trained)  # the turns of a trajectory span steps
    assert sum(r["rollout/versions_per_sample"][2] for r in trained) > 0  # tokens of 3 policy versions
    assert any(abs(r["policy/is_weight"] - 1) > 1e-3 for r in trained)  # corrected per token
    start = load_file(str(root / "model" / "model.safetensors"))
    assert max_diff(start, final_params(root / "one")) > 1e-4  # the weights moved: the comparison means something


@pytest.mark.slow
def test_killed_mid_run_and_resumed_is_the_uninterrupted_run(runs):
    """The checkpoint holds trajectories in flight, some cut inside a reply, each with its turn loop's state
    (messages, the environment's pickle); resumed, every step's metrics and the model are bit-identical to the
    uninterrupted run."""
    root, live = runs
    assert len(live) == metrics(root / "three")[1]["partial/in_flight"] > 0
    assert any(r.talk["reply"] > 0 for r in live)  # cut inside a reply, continued there
    for r in live:
        assert len(r.tokens) == len(r.logprobs) == len(r.versions) == len(r.talk["mask"])
        assert r.talk["turns"] >= 1 and r.talk["state"] is not None and len(r.talk["messages"]) >= 3
    whole, resumed = metrics(root / "three"), metrics(root / "cut")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for x, y in zip(whole, resumed):
        for k in SAME + ["policy/loss", "policy/is_weight", "entropy"]:
            assert x.get(k) == y.get(k), (x["step"], k)
    assert max_diff(final_params(root / "three"), final_params(root / "cut")) == 0.0


@pytest.mark.slow
def test_under_bitwise_the_same_bits_on_one_and_three_processes(runs):
    root, _ = runs
    assert_same_run(root / "bitwise_one", root / "bitwise_three")
    assert any(r["partial/in_flight"] > 0 for r in metrics(root / "bitwise_one"))
    assert max_diff(final_params(root / "one"), final_params(root / "three")) > 0.0
