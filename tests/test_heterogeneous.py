"""Mixed devices, simulated on 3 CPU processes: rank 2's device reports less memory and rank 1 computes 5x slower
(both injected from tests/faults, evenrl's code has no test hooks). The plan gives rank 2 a smaller token cap,
parallel.capacity_weights=auto moves work off rank 1, and the model equals the 1-process run's."""

from __future__ import annotations

import json

import pytest
import torch

from e2e import ENV, Job, fault_env, final_params, max_diff, metrics
from evenrl.config import load_config
from evenrl.planner.layout import make_layout
from evenrl.planner.dims import read_model_dims
from evenrl.planner.memory import estimate_memory

pytestmark = pytest.mark.slow

STEPS = 6
ARGS = [f"train.steps={STEPS}", "train.token_cap_per_micro_batch=80", "parallel.capacity_weights=auto",
        "log.samples_every_steps=0"]


def small_budget(assets) -> float:
    """Device memory between the estimates at 2 and 3 samples (40 and 60 tokens) per micro-batch: the plan must cap
    that rank at 40 tokens where the others run 80."""
    cfg = load_config(assets["cfg"], ARGS)
    dims, lay = read_model_dims(str(assets["model"])), make_layout(1, 3, device="cpu", device_memory_gib=1.0)
    at = {cap: estimate_memory(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"token_cap_per_micro_batch": cap})}), lay, dims, (2,)).total_gib for cap in (40, 60)}
    assert at[40] < at[60]
    return (at[40] + at[60]) / 2


def test_small_and_slow_ranks_plan_balance_and_stay_exact(assets, tmp_path):
    args = ["train", assets["cfg"], *ARGS]
    mixed = Job(*args, f"log.run_dir={tmp_path / 'mixed'}", "--nproc-per-node", "3",
                env=fault_env(small_rank=(2, small_budget(assets)), slow_rank=(1, 5.0)))
    one = Job(*args, f"log.run_dir={tmp_path / 'one'}", env=ENV)
    mixed.wait(), one.wait()

    plan = (tmp_path / "mixed" / "plan.txt").read_text()
    assert "devices    ranks 0-1 cpu-" in plan and "token cap 80; rank 2 cpu-0.3 (1 thread), token cap 40" in plan
    assert "token-cap-lowered: 1xcpu-0.3 (rank 2)" in plan
    rows = metrics(tmp_path / "mixed")
    groups = rows[0]["devices"]
    assert [(g["ranks"], g["token_cap"], g["role"]) for g in groups] == [([0, 1], 80, "train"), ([2], 40, "train")]
    assert all("devices" not in r for r in rows[1:])

    # auto: step 1 balances equally, then by the measured speeds; the slow rank ends with the smallest weight
    weights = [[r[f"load/capacity_weight/{k}"] for k in range(3)] for r in rows]
    assert weights[0] == [1.0, 1.0, 1.0]
    assert weights[-1][1] < min(weights[-1][0], weights[-1][2]), weights
    assert all(r["load/busy_s/1"] >= 0 and "load/rollout_weight/1" in r for r in rows)
    late = [r["load/rank_tokens"] for r in rows[STEPS // 2:]]
    assert sum(t[1] for t in late) < min(sum(t[0] for t in late), sum(t[2] for t in late)), late
    saved = torch.load(tmp_path / "mixed" / "checkpoints" / f"step-{STEPS:06d}" / "trainer.pt", weights_only=True)
    assert saved["balance"]["update"][1] == min(saved["balance"]["update"])  # what a resumed run starts from

    # where rows ran never changes the update: the 1-process model (auto there too: one rank, weight 1)
    assert max_diff(final_params(tmp_path / "mixed"), final_params(tmp_path / "one")) <= 1e-5
    assert json.loads((tmp_path / "one" / "plan.json").read_text())["ranks"]["device_groups"][0]["token_cap"] == 80
