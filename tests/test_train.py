"""End-to-end `evenrl train` / `evenrl sft` on a tiny random Qwen2 model made on the spot.

The uninterrupted runs the tests below compare against are the `shared_runs` fixture's (tests/conftest.py: which
run serves which test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from e2e import ENV, Job, evenrl, evenrl_here, final_params, max_diff, metrics, fault_env


def test_one_process_run_writes_everything(shared_runs, assets, capsys):
    """Served by shared_runs.one: 4 steps on 1 process, eval of 11 prompts, a checkpoint every 2 steps."""
    run, out = shared_runs.one, shared_runs.stdout["one"]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["eval/prompts"] == 11 and "eval/reward" in rows[4]
    assert all("eval/reward" not in r for r in rows[1:4])
    rows = rows[1:]
    assert "phase breakdown over 4 steps" in out and all(r["time/step"] > 0 for r in rows)
    assert all(r["samples"] == 21 for r in rows)
    assert (run / "config.yaml").exists() and (run / "samples.jsonl").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000004"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True)
    start = AutoModelForCausalLM.from_pretrained(assets["model"], local_files_only=True)
    moved = max(float((a - b).abs().max().detach()) for a, b in zip(model.parameters(), start.parameters()))
    assert moved > 1e-5, "training did not change the model"
    code, stdout, _ = evenrl_here(capsys, "report", run)
    assert code == 0
    assert {p.name for p in (run / "plots").glob("*.png")} >= {"reward.png", "rank_load.png", "phases.png"}
    assert str(run / "plots" / "reward.png") in stdout
    assert evenrl_here(capsys, "report", run / "nope")[0] == 2


@pytest.mark.slow
def test_same_model_on_one_and_three_processes(shared_runs):
    """Layout invariance: 7 prompts x 3 samples, 2 mini-batches, on 1 and on 3 ranks -> the same parameters; and
    the same with activation checkpointing on. Served by shared_runs.one, .three and .grad_ckpt (4 steps)."""
    one, three = shared_runs.one, shared_runs.three
    diff = max_diff(final_params(one), final_params(three))
    assert diff <= 1e-5, diff
    m1, m3 = metrics(one), metrics(three)
    assert [r.get("reward/mean") for r in m1] == [r.get("reward/mean") for r in m3]
    assert [r.get("eval/reward") for r in m1] == [r.get("eval/reward") for r in m3]
    assert len(m3[-1]["load/rank_tokens"]) == 3
    # activation checkpointing runs the model's own (recomputing) forward on rows packed into one: same model
    assert max_diff(final_params(one), final_params(shared_runs.grad_ckpt)) <= 1e-5


@pytest.mark.slow
def test_resume_after_a_crash_gives_the_same_model(shared_runs, tmp_path):
    """A run of the shared config killed at the start of step 3, then resumed from its step-2 checkpoint, ends with
    exactly the parameters of the uninterrupted shared_runs.one."""
    crashed = tmp_path / "crashed"
    proc = evenrl("train", *shared_runs.args, f"log.run_dir={crashed}",
                  env=fault_env(crash_at_step=3), check=False)
    assert proc.returncode != 0
    assert not (crashed / "final").exists()
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "step-000002"
    evenrl("train", *shared_runs.args, f"log.run_dir={crashed}", "--resume")
    assert max_diff(final_params(shared_runs.one), final_params(crashed)) == 0.0
    steps = [r["step"] for r in metrics(crashed)]
    assert steps == [0, 1, 2, 3, 4]  # the eval before step 1 (row 0) once, every step once


@pytest.mark.slow
def test_skipping_zero_gradient_samples_changes_nothing(shared_runs, assets):
    """Samples with advantage 0 are not run but still count in the denominators: same model as running them,
    on one layout (shared_runs.one skips vs .no_skip runs everything, 1 process each) and across layouts
    (.three skips on 3 processes vs .no_skip). .no_skip samples with the static decoder: the same samples, so the
    same rewards, as .one's lean decoder."""
    ran, skipped = shared_runs.no_skip, shared_runs.three
    assert [r.get("reward/mean") for r in metrics(ran)] == [r.get("reward/mean") for r in metrics(shared_runs.one)]
    rows = [r for r in metrics(skipped) if r["step"] > 0]  # row 0 is the eval before the first step
    assert sum(r["load/skipped_samples"] for r in rows) > 0
    assert all(r["load/skipped_samples"] < r["samples"] for r in rows), "nothing left to learn from: weak test"
    assert all(r["load/skipped_samples"] == 0 for r in metrics(ran) if r["step"] > 0)
    assert max_diff(final_params(ran), final_params(skipped)) <= 1e-5
    assert max_diff(final_params(ran), final_params(shared_runs.one)) <= 1e-5
    start = load_file(str(Path(assets["model"]) / "model.safetensors"))
    assert max_diff(final_params(ran), start) > 1e-5, "training did not move the model: weak test"


def test_sft_then_kl_and_multi_epoch_paths(assets, tmp_path):
    run2 = tmp_path / "klr"  # independent of the SFT: runs beside it
    klr = Job("train", assets["cfg"], f"log.run_dir={run2}", "train.steps=1", "algo.kl_coef=0.1",
              "algo.kl_in=reward", "rewards.isolate=false")
    try:
        sft_dir = tmp_path / "sft"
        evenrl("sft", assets["cfg"], f"log.run_dir={sft_dir}", "sft.steps=3", "sft.rows_per_step=8")
        assert (sft_dir / "final" / "model.safetensors").exists()
        run = tmp_path / "kl"
        evenrl("train", assets["cfg"], f"model.path={sft_dir / 'final'}", f"log.run_dir={run}", "train.steps=1",
               "algo.kl_coef=0.1", "algo.epochs_per_step=2", "algo.entropy_coef=0.01", "algo.advantage=rloo")
        row = metrics(run)[0]
        assert row["kl"] >= 0.0
        klr.wait()
        assert (run2 / "final").exists()
    finally:
        klr.kill()


BAD_INPUT = [
    ("model.path=/nonexistent/model", "/nonexistent/model"),
    ("data.path=/nonexistent/data.jsonl", "/nonexistent/data.jsonl"),
    ("rollout.samples_per_prompt=0", "rollout.samples_per_prompt"),
    ("algo.advantage=ppo2", "algo.advantage"),
]


def _lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.strip()]


@pytest.mark.parametrize("override, needle", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(assets, tmp_path, capsys, override, needle):
    code, _, err = evenrl_here(capsys, "train", assets["cfg"], f"log.run_dir={tmp_path / 'bad'}", override)
    assert code == 2, err
    assert "Traceback" not in err
    lines = _lines(err)
    assert len(lines) == 1 and needle in lines[0], err


def test_bad_input_from_the_real_entry_point(assets, tmp_path):
    """The in-process cases above, proven once through `python -m evenrl.cli` in a fresh process."""
    override, needle = BAD_INPUT[0]
    proc = evenrl("train", assets["cfg"], f"log.run_dir={tmp_path / 'bad'}", override, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = _lines(proc.stderr)
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_missing_config_file_exit_2(tmp_path, capsys):
    code, _, err = evenrl_here(capsys, "train", tmp_path / "nope.yaml")
    assert code == 2 and "nope.yaml" in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["--bogus"], ["--nproc-per-node", "0"], ["--nnodes", "2", "--node-rank", "5"]])
def test_bad_flags_are_one_line_and_exit_2(assets, capsys, args):
    code, _, err = evenrl_here(capsys, "train", assets["cfg"], *args)
    lines = _lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err


def test_phase_table_sums_phases_and_names_the_rest():
    from evenrl.train.metrics import phase_table

    text = phase_table({"rollout": 3.0, "update": 1.0, "reward": 0.5, "step": 5.0}, steps=4)
    lines = text.splitlines()
    assert lines[0] == "phase breakdown over 4 steps (rank 0):"
    rows = {ln.split()[0]: (float(ln.split()[1]), float(ln.split()[2])) for ln in lines[2:]}
    assert list(rows) == ["rollout", "reward", "update", "other", "total"]  # the step's order, then the rest
    assert rows["rollout"] == (3.0, 60.0) and rows["other"] == (0.5, 10.0) and rows["total"] == (5.0, 100.0)


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.integers(1, 300), min_size=1, max_size=12), n=st.integers(1, 9), world=st.integers(1, 7),
       weighted=st.booleans(), data=st.data())
def test_rollout_shares_cover_every_sample_once_and_balance(costs, n, world, weighted, data):
    from evenrl.core.schedule import rollout_shares

    w = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=world, max_size=world)) if weighted else None
    shares = rollout_shares(costs, n, world, w)
    flat = [(p, first + j) for share in shares for p, first, count in share for j in range(count)]
    assert flat == [(p, s) for p in range(len(costs)) for s in range(n)]  # each sample once, in order, ranks in order
    assert sum(len(share) for share in shares) <= len(costs) + world - 1  # a cut splits at most one prompt
    weights = w or [1.0] * world
    for share, wr in zip(shares, weights):
        load = sum(costs[p] * count for p, _, count in share)
        assert abs(load - sum(costs) * n * wr / sum(weights)) <= max(costs) + 1e-6  # within one sample of its share


def test_report_loads_neither_torch_nor_the_trainer():
    """`evenrl report` draws PNGs from metrics.jsonl: it must not pay for torch or the trainer's modules."""
    code = ("import sys, evenrl.report\n"
            "loaded = [m for m in ('torch', 'evenrl.train.step', 'evenrl.train.trainer') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
