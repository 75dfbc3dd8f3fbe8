"""Fixtures shared by the end-to-end tests: a tiny model and data, and the uninterrupted runs of one shared config
that several tests compare against (each run once per session); the demo, run once; one thread for the sampler
tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from evenrl.demo import write_addition_data
from evenrl.testing import make_tiny_model


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core box run ~10x faster single-threaded (no OpenMP barrier waits)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    model = make_tiny_model(str(root / "model"), arch="qwen2", seed=0)
    data = root / "addition.jsonl"
    write_addition_data(data)
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {model}}}
data: {{path: {data}, prompts_per_step: 7, max_prompt_tokens: 16}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4, temperature: 1.0}}
rewards: {{functions: [{{name: exact_match}}, {{name: 'toy_rewards:digit_fraction', weight: 0.5}}]}}
algo: {{advantage: grpo, minibatches_per_step: 2}}
train: {{steps: 2, lr: 1.0e-3, token_cap_per_micro_batch: 24}}
log: {{progress: false, tensorboard: false, samples_every_steps: 1}}
""")
    return {"model": model, "data": data, "cfg": cfg, "root": root}


@dataclass(frozen=True)
class SharedRuns:
    """Uninterrupted runs of the shared config, and that config: `evenrl train *args log.run_dir=...`."""

    args: list
    one: Path          # 1 process
    three: Path        # 3 processes
    grad_ckpt: Path    # 1 process, model.gradient_checkpointing=true
    no_skip: Path      # 1 process, train.skip_zero_gradient_samples=false
    stdout: dict       # run name ("one", ...) -> what it printed


@pytest.fixture(scope="session")
def shared_runs(assets, tmp_path_factory) -> SharedRuns:
    """The shared config is the assets' config for 4 steps (7 prompts x 3 samples, 2 mini-batches), a checkpoint
    every 2 steps, a greedy eval of 11 prompts before the first and after the last step. Every test below compares
    runs of exactly this config, so a difference comes from the layout, the crash or the flag under test alone.

    Which run serves which test:
      one        tests/test_train.py  test_one_process_run_writes_everything      (its files, metrics, report)
                                      test_same_model_on_one_and_three_processes  (vs three, vs grad_ckpt)
                                      test_resume_after_a_crash_gives_the_same_model (vs crashed + resumed: == 0)
                                      test_skipping_zero_gradient_samples_changes_nothing (vs no_skip)
                 tests/test_launch.py test_two_nodes_on_loopback_give_the_one_process_model (vs 2 nodes x 1)
                                      test_elastic_restart_resumes_and_matches    (vs 2 processes, restarted)
                 tests/test_sharding.py test_resume_sharded_3_then_2_then_4_ranks (large_world: vs sharded 3, 2, 4)
      three      tests/test_train.py  test_same_model_on_one_and_three_processes  (layout invariance)
                                      test_skipping_zero_gradient_samples_changes_nothing (skipping on 3 processes)
      grad_ckpt  tests/test_train.py  test_same_model_on_one_and_three_processes  (activation checkpointing)
      no_skip    tests/test_train.py  test_skipping_zero_gradient_samples_changes_nothing (running every sample;
                                      sampled by rollout.decoder=static, which must give one's samples)

    The four runs go two at a time (a 1-process run leaves a core of a 2-core machine idle); the fixture returns
    when all have finished, so nothing runs behind the other tests' backs.
    """
    from e2e import evenrl_many, shared_args

    root = tmp_path_factory.mktemp("shared")
    args = shared_args(assets)
    extra = {"three": ["--nproc-per-node", "3"], "one": [], "grad_ckpt": ["model.gradient_checkpointing=true"],
             "no_skip": ["train.skip_zero_gradient_samples=false", "rollout.decoder=static"]}  # longest first
    done = evenrl_many({name: ["train", *args, f"log.run_dir={root / name}", *more] for name, more in extra.items()})
    return SharedRuns(args=args, stdout={name: p.stdout for name, p in done.items()},
                      **{name: root / name for name in extra})


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """`evenrl demo` as tests/test_demo.py checks it (150 SFT steps, then 60 GRPO steps on 1 process), run once:
    (its --out directory, the finished process). Its SFT warm start (OUT/sft/final) and data (OUT/data) also serve
    tests/test_ppo_family.py's runs on the demo task."""
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("demo_run") / "demo"
    proc = subprocess.run([sys.executable, "-m", "evenrl.cli", "demo", "--out", str(out), "sft.steps=150",
                           "train.steps=60", "log.progress=false"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    return out, proc
