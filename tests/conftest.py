"""Fixtures shared by the end-to-end tests: a tiny model and data, and the uninterrupted runs of one shared config
that several tests compare against (each run once per session); the demo, run once; one thread for the sampler
tests. Also the order test files start in (heaviest first), for `make test`'s two pytest-xdist workers."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


# The test files that take longest (wall seconds of each alone, measured 2026-11-28 on 2 cores): `make test` runs
# the files on two pytest-xdist workers, a file on one worker (its module fixtures made once), each worker taking
# the next file as it finishes one. Started first, the long ones run beside many short ones; started last, one of
# them would run alone at the end while the other core idles. Only the order; a file not listed starts after these.
LONGEST_FIRST = ["test_bitwise_runs", "test_engines", "test_tensor_parallel", "test_multiturn_runs", "test_sharding",
                 "test_agents_runs", "test_ppo_family", "test_partial_agents_runs", "test_vision",
                 "test_expert_parallel", "test_overlap", "test_faults", "test_dist", "test_partial_runs",
                 "test_reserved", "test_openenv_env", "test_partial_multiturn_runs", "test_verifiers_env",
                 "test_lora", "test_expert_lora", "test_moe", "test_qwen3_vl", "test_trackers"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each file's own order is kept


def once(tmp_path_factory, name: str, make: Callable[[Path], dict]) -> dict:
    """make(DIR) -> a JSON-able dict, made once for the whole test session. Under pytest-xdist every worker is a
    session of its own: the first worker that asks makes it in a directory all workers see, and the others wait
    for it and read what it returned (the 4 shared runs made twice would cost ~100 s of CPU)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # one per session, holding each worker's own directory
    made = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not made.exists():  # a worker whose make failed left nothing: the next one tries again, failing alike
            made.write_text(json.dumps(make(Path(tempfile.mkdtemp(prefix=name, dir=shared)))))
        return json.loads(made.read_text())


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    made = once(tmp_path_factory, "assets", _make_assets)
    return {k: v if k == "model" else Path(v) for k, v in made.items()}  # the model's path a str, as make_tiny_model's


def _make_assets(root: Path) -> dict:
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
    return {"model": str(model), "data": str(data), "cfg": str(cfg), "root": str(root)}


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

    args = shared_args(assets)
    extra = {"three": ["--nproc-per-node", "3"], "one": [], "grad_ckpt": ["model.gradient_checkpointing=true"],
             "no_skip": ["train.skip_zero_gradient_samples=false", "rollout.decoder=static"]}  # longest first

    def make(root: Path) -> dict:
        done = evenrl_many({name: ["train", *args, f"log.run_dir={root / name}", *more]
                            for name, more in extra.items()})
        return {"stdout": {name: p.stdout for name, p in done.items()}, **{name: str(root / name) for name in extra}}

    made = once(tmp_path_factory, "shared", make)
    return SharedRuns(args=args, stdout=made["stdout"], **{name: Path(made[name]) for name in extra})


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """`evenrl demo` as tests/test_demo.py checks it (150 SFT steps, then 60 GRPO steps on 1 process), run once:
    (its --out directory, the finished process). Its SFT warm start (OUT/sft/final) and data (OUT/data) also serve
    tests/test_ppo_family.py's runs on the demo task."""
    from e2e import evenrl

    def make(root: Path) -> dict:
        proc = evenrl("demo", "--out", root / "demo", "sft.steps=150", "train.steps=60", "log.progress=false",
                      check=False)
        return {"out": str(root / "demo"), "args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout,
                "stderr": proc.stderr}

    made = once(tmp_path_factory, "demo_run", make)
    return Path(made.pop("out")), subprocess.CompletedProcess(**made)
