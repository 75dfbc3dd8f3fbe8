"""The demo task learns: a short SFT warm start, then GRPO raises the exact-match reward (fixed seeds)."""

import json

import pytest


@pytest.mark.slow
def test_demo_reward_rises(demo_run):
    """tests/conftest.py's demo_run: `evenrl demo --out OUT sft.steps=150 train.steps=60 log.progress=false`."""
    out, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 60
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.02, (first, last)
    assert "mean reward first 10 steps" in proc.stdout
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    assert len(evals) >= 2 and evals[-1] >= evals[0], evals  # greedy accuracy before vs after GRPO
    for name in ("reward.png", "rank_load.png"):
        assert (out / "grpo" / "plots" / name).stat().st_size > 1000
