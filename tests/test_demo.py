"""The demo task learns: a short SFT warm start, then GRPO raises the exact-match reward (fixed seeds)."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_reward_rises(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "evenrl.cli", "demo", "--out", str(out), "sft.steps=150",
                           "train.steps=60", "log.progress=false"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [json.loads(line)["reward/mean"] for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 60
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.02, (first, last)
    assert "mean reward first 10 steps" in proc.stdout
    for name in ("reward.png", "rank_load.png"):
        assert (out / "grpo" / "plots" / name).stat().st_size > 1000
