"""Partial rollouts end to end (rollout.partial; CPU, gloo, real processes): the assets' model with a budget of 3 new
tokens a step for samples of up to 8, so a sample that does not end early is generated over 3 steps (carried twice)
and trained on tokens of 3 policy versions.

What is exact: which samples continue, and under which version, follows from the step numbers and the budget, so
  * the run on 1 and on 3 processes has the same rewards and the same samples in flight, waiting and trained at
    every step, and its model within the float rounding of summing gradients over another number of ranks;
  * a run killed mid-run and resumed from its checkpoint (in-flight samples and their tokens are in it) is
    bit-identical to the uninterrupted one, colocated and with a reserved rollout rank generating a step ahead.
What is traded: the tokens of a carried sample come from older policies, corrected per token
(tests/test_offpolicy.py); a sample's tokens are its stream's draws position by position (tests/test_partial.py).
"""

from __future__ import annotations

import pytest
import torch

from e2e import (BITWISE, assert_same_run, copy_checkpoint, evenrl, evenrl_many, fault_env, final_params, max_diff,
                 metrics)
from evenrl.rollout.carry import unpack

SHAPE = ["rollout.partial=true", "rollout.max_new_tokens=8", "rollout.tokens_per_round=3", "train.steps=6",
         "rewards.isolate=false", "checkpoint.every_steps=3"]
SAME = ["samples", "reward/mean", "reward/std", "response/length_mean", "response/finished_fraction",
        "partial/trained_groups", "partial/in_flight", "partial/waiting", "partial/oldest_age", "partial/waited",
        "rollout/versions_per_sample", "rollout/tokens_per_version", "rollout/staleness_hist"]
RESERVED = ["rollout.max_staleness=1", "--nproc-per-node", 2, "--rollout-devices", 1]


def args(assets, run_dir, *more) -> list:
    return ["train", assets["cfg"], *SHAPE, f"log.run_dir={run_dir}", *more]


@pytest.fixture(scope="module")
def partial_runs(assets, tmp_path_factory):
    """The uninterrupted runs, two at a time, longest first: colocated on 3 processes and on 1 (under rounding and
    under bitwise), and with 1 reserved rollout rank generating a step ahead of 1 trainer (max_staleness 1)."""
    root = tmp_path_factory.mktemp("partial")
    evenrl_many({"three": args(assets, root / "three", "--nproc-per-node", 3),
                 "bitwise_three": args(assets, root / "bitwise_three", BITWISE, "--nproc-per-node", 3),
                 "reserved": args(assets, root / "reserved", *RESERVED),
                 "one": args(assets, root / "one"), "bitwise_one": args(assets, root / "bitwise_one", BITWISE)})
    return root


@pytest.mark.slow
def test_the_same_run_on_one_and_three_processes(partial_runs):
    """Same samples in flight, waiting and trained at every step, same rewards, samples trained on tokens of up to
    3 versions with their importance weights in use; the models within 1e-5."""
    one, three = metrics(partial_runs / "one"), metrics(partial_runs / "three")
    assert [r["step"] for r in one] == [r["step"] for r in three] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(one, three):
        for k in SAME:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])
    assert all(r["partial/in_flight"] > 0 for r in one)  # every step carries samples to the next
    assert one[0]["samples"] == 0 and sum(r["samples"] for r in one) >= 3 * 21  # step 1 finishes no whole group
    assert sum(r["rollout/versions_per_sample"][2] for r in one) > 0  # samples of 3 versions: carried twice
    assert any(abs(r["policy/is_weight"] - 1) > 1e-3 for r in one if r["samples"])  # corrected per token
    assert max_diff(final_params(partial_runs / "one"), final_params(partial_runs / "three")) < 1e-5


@pytest.mark.slow
def test_under_bitwise_the_same_bits_on_one_and_three_processes(partial_runs):
    """train.reproducibility=bitwise: each step's engine calls are the canonical batches of its new prompts and
    one call per carried group (evenrl.rollout.carry.canonical_calls), so which samples share a forward pass does not
    depend on the layout: weights and every metric the same bits, samples carried over steps as under rounding.
    Negative control: the rounding runs differ."""
    assert_same_run(partial_runs / "bitwise_one", partial_runs / "bitwise_three")
    rows = metrics(partial_runs / "bitwise_one")
    assert all(r["partial/in_flight"] > 0 for r in rows) and sum(r["samples"] for r in rows) >= 3 * 21
    assert max_diff(final_params(partial_runs / "one"), final_params(partial_runs / "three")) > 0.0


@pytest.mark.slow
def test_killed_mid_run_and_resumed_is_the_uninterrupted_run(assets, partial_runs, tmp_path):
    """3 processes, killed at the start of step 5 (checkpoint 3 written, step 4 lost), resumed: every metric of
    steps 4-6 and the model are bit-identical to the uninterrupted run; checkpoint 3 holds the samples that were in
    flight, with their tokens, log-probs and versions."""
    run = tmp_path / "run"
    crashed = evenrl(*args(assets, run, "--nproc-per-node", 3), env=fault_env(crash_at_step=5), check=False)
    assert crashed.returncode != 0
    state = torch.load(run / "checkpoints" / "step-000003" / "trainer.pt", weights_only=True)
    live = unpack(state["carry"]["live"])
    assert len(live) == metrics(partial_runs / "three")[2]["partial/in_flight"]
    assert all(len(r.tokens) == len(r.logprobs) == len(r.versions) > 0 for r in live)
    evenrl(*args(assets, run, "--nproc-per-node", 3, "--resume"))
    whole, resumed = metrics(partial_runs / "three"), metrics(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(whole, resumed):
        for k in SAME + ["policy/loss", "policy/is_weight", "rollout/logprob_mismatch"]:
            assert x.get(k) == y.get(k), (x["step"], k)
    assert max_diff(final_params(partial_runs / "three"), final_params(run)) == 0.0


@pytest.mark.slow
def test_a_reserved_rollout_rank_running_ahead_resumes_exactly(assets, partial_runs, tmp_path):
    """With a reserved rollout rank generating one step ahead (max_staleness 1), the trainers keep a copy of its
    in-flight samples for their checkpoints: resumed from checkpoint 3 (its step 4 regenerated from them), the run
    is bit-identical; no token is the trained policy's own (every one a step or more old) and they span up to 4
    versions' ages (max_staleness + max_carry_steps)."""
    whole = metrics(partial_runs / "reserved")
    assert all(r["rollout/tokens_per_version"][0] == 0 for r in whole)
    assert any(r["rollout/tokens_per_version"][3] > 0 for r in whole)
    run = copy_checkpoint(partial_runs / "reserved", 3, tmp_path / "run")
    evenrl(*args(assets, run, *RESERVED, "--resume"))
    for x, y in zip(whole, metrics(run)):
        for k in SAME + ["policy/loss", "policy/is_weight"]:
            assert x.get(k) == y.get(k), (x["step"], k)
    assert max_diff(final_params(partial_runs / "reserved"), final_params(run)) == 0.0


def test_refused_combinations_are_one_line(assets, tmp_path, capsys):
    """What partial rollouts do not run with stops `evenrl train` before anything loads: one line, exit 2."""
    from e2e import evenrl_here

    code, _, err = evenrl_here(capsys, "train", assets["cfg"], "rollout.partial=true", "algo.filter_groups=true",
                               f"log.run_dir={tmp_path}/r")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "partial-rounds" in err, err
    assert not (tmp_path / "r").exists()


def _lengths_off_by_3(carry):
    carry["live"]["lengths"][0] += 3


def _nan_logprobs(carry):
    for part in carry.values():
        part["logprobs"][:] = float("nan")


def _no_such_row(carry):
    carry["live"]["meta"][0, 3] = 10**6


@pytest.mark.slow
@pytest.mark.parametrize("damage, needle", [(_lengths_off_by_3, "carry.live: the lengths add up to"),
                                            (_nan_logprobs, "log-probs are not finite"),
                                            (_no_such_row, "its prompt is row 1000000 of the dataset")],
                         ids=["lengths", "nan", "row"])
def test_a_damaged_carry_is_refused_before_the_run_directory_changes(assets, partial_runs, tmp_path, capsys,
                                                                     damage, needle):
    """Checkpoint 3 of the 1-process run with its carried samples damaged (tests/test_partial_checkpoint.py has
    every damage): --resume stops in one line naming trainer.pt, exit 2, before config.yaml, plan.* or metrics.jsonl
    are rewritten (were: a split_with_sizes traceback; a step that trained on NaN log-probs, then stopped naming this
    checkpoint as the last good one; an IndexError after the directory was rewritten)."""
    from e2e import evenrl_here
    from test_bad_input import tree

    run = copy_checkpoint(partial_runs / "one", 3, tmp_path / "run")
    for name in ("config.yaml", "plan.txt", "plan.json"):
        (run / name).write_bytes((partial_runs / "one" / name).read_bytes())
    pt = run / "checkpoints" / "step-000003" / "trainer.pt"
    state = torch.load(pt, weights_only=True)
    damage(state["carry"])
    torch.save(state, pt)
    before = tree(run)
    code, _, err = evenrl_here(capsys, *args(assets, run, "--resume"))
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(pt) in lines[0] and needle in lines[0] and "resume from an earlier one" in lines[0], lines[0]
    assert tree(run) == before
