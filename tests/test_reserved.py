"""Reserved placement (`evenrl train --rollout-devices R`): the last R processes only generate, the others only
train, and the weights are pushed to the rollout ranks before every rollout. Samples are keyed, so the run equals
the colocated one: same samples and rewards, and the same model up to the float rounding of summing gradients over
a different number of trainers."""

from __future__ import annotations

import time

import pytest

from e2e import ENV, close_weights, evenrl, final_params, metrics, fault_env

# 8 samples per prompt (TRL refuses num_generations=8 on 3 training GPUs; evenrl splits prompts over ranks instead)
SHAPE = ["rollout.samples_per_prompt=8", "data.prompts_per_step=5", "train.steps=2", "rewards.isolate=false"]


def same_run(a, b) -> None:
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2]
    for x, y in zip(ra, rb):
        # the same samples: identical rewards and lengths; the engine log-probs match the trainers' here too
        for k in ("reward/mean", "reward/std", "response/length_mean", "samples"):
            assert x[k] == y[k], (k, x[k], y[k])
        assert x["rollout/logprob_mismatch"] < 1e-5 and x["rollout/mismatch_fraction"] == 0
    # measured 2e-6 (2 trainers vs 1); 3 trainers vs 1: 1.24e-5 at one entry (CI, 2026-11-27), Adam's amplification
    # of rounding where a gradient nearly cancels, which close_weights bounds
    gap = close_weights(final_params(a), final_params(b))
    assert not gap, gap


@pytest.fixture(scope="module")
def colocated(assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("colocated") / "run"
    evenrl("train", assets["cfg"], *SHAPE, f"log.run_dir={run}")
    return run


@pytest.mark.slow
def test_one_rollout_rank_and_two_trainers_equal_one_process(assets, tmp_path, colocated):
    proc = evenrl("train", assets["cfg"], *SHAPE, f"log.run_dir={tmp_path / 'run'}", "--nproc-per-node", 3,
                  "--rollout-devices", 1)
    same_run(tmp_path / "run", colocated)
    assert "rollout-reserved" in proc.stdout and "WARNING" not in proc.stdout  # the reserved rank generates
    assert "time/weights" in metrics(tmp_path / "run")[0]


@pytest.mark.large_world
def test_open_r1_shape_four_processes_one_reserved(assets, tmp_path, colocated):
    """Open-R1's report: 4 GPUs, one serves generation, three train, 8 samples per prompt (5 prompts: 40 samples do
    not split evenly over 3 trainers; evenrl's schedule does not need them to)."""
    evenrl("train", assets["cfg"], *SHAPE, f"log.run_dir={tmp_path / 'run'}", "--nproc-per-node", 4,
           "--rollout-devices", 1)
    same_run(tmp_path / "run", colocated)


@pytest.mark.slow
def test_a_stalled_rollout_rank_ends_the_job_naming_it(assets, tmp_path):
    """The rollout rank hangs before generating step 2 (after loading its weights): the trainers wait
    --collective-timeout-s in the weight push or the gather, then stop with one line naming the rollout rank and
    where it was, instead of hanging."""
    seconds = 8
    t0 = time.monotonic()
    proc = evenrl("train", assets["cfg"], *SHAPE, f"log.run_dir={tmp_path / 'run'}", "--nproc-per-node", 2,
                  "--rollout-devices", 1, "--collective-timeout-s", seconds,
                  env=fault_env(rollout_stalls_at_step=2), check=False)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("evenrl train: rank 0 failed: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "step 2" in lines[0] and "rank 1 was last in step 2 weights (rollout rank)" in lines[0], lines[0]
    assert took < 60 + seconds, f"the job took {took:.0f} s to end"  # the hung rank dies on the agent's SIGTERM


def test_rollout_devices_must_leave_a_trainer(assets, tmp_path, capsys):
    from e2e import evenrl_here

    code, out, err = evenrl_here(capsys, "train", assets["cfg"], "--rollout-devices", 1, f"log.run_dir={tmp_path}/r")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no-training-ranks" in err, err


def test_reserved_ranks_refuse_dynamic_sampling(assets, tmp_path, capsys):
    """Rounds of dynamic sampling are decided from rewards the rollout ranks never see: the plan refuses it (and
    `evenrl train` stops on the plan's errors before loading the model)."""
    from e2e import evenrl_here

    code, out, err = evenrl_here(capsys, "plan", assets["cfg"], "--nproc-per-node", 2, "--rollout-devices", 1,
                                 "algo.filter_groups=true")
    assert code == 1 and "reserved-filter-groups" in out and "algo.filter_groups" in out, out
