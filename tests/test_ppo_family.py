"""End to end: REINFORCE++ (one sample per prompt), PPO with a critic (GAE) and DAPO's dynamic sampling through
`evenrl train` on the tiny model of the assets fixture (tests/conftest.py) and on the demo task.

  * the same parameters, critic included, and the same whitening statistics on 1 and 3 processes, and with policy
    and critic sharded by FSDP2 on 2; PPO's rewards from a rule, a reward model and an LLM judge;
  * under train.reproducibility=bitwise the same bits on 1, 2 and 3 processes, critic included, where the same runs
    under rounding differ;
  * a run with a critic killed at step 3 and resumed ends exactly where the uninterrupted one does;
  * dynamic sampling keeps every step full when most groups are all-correct, the same on any layout, and says so
    when its rounds run out;
  * on the demo task (SFT warm start, then RL) both new estimators raise the reward, one sample per prompt."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e import BITWISE, ENV, assert_same_run, evenrl, evenrl_many, final_params, max_diff, metrics, fault_env
from evenrl.testing import make_tiny_reward_model


PPO = ["algo.advantage=gae", "algo.gamma=0.9", "algo.lam=0.95", "algo.kl_coef=0.05", "algo.kl_in=reward",
       "critic.lr=1e-3", "rewards.isolate=false"]
RPP = ["algo.advantage=reinforce_pp", "rollout.samples_per_prompt=1", "data.prompts_per_step=11",
       "rewards.isolate=false"]
STEPS = ["train.steps=3", "checkpoint.every_steps=2"]


def ppo(judges: Path) -> list[str]:
    """PPO's settings, its reward the rule's, a reward model's and an LLM judge's (the policy's own model, keyed
    samples at temperature 1): every role of a run that has one."""
    return [*PPO, f"rewards.functions=[{{name: exact_match}}, {{model: {judges}, weight: 0.5}}, "
                  "{judge: {template: 'Q {question} A {completion} score:', max_new_tokens: 3}, weight: 0.3}]"]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    return Path(make_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "rm"), seed=3))
WHITENING = ("advantage/raw_token_mean", "advantage/raw_token_std")


def critic_params(run: Path, step: int = 3) -> dict:
    """The critic's weights in a run's checkpoint (DCP state, under critic_model), read with DCP's own tools."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run / f"critic-{step}.pt"
    dcp_to_torch_save(str(run / "checkpoints" / f"step-{step:06d}" / "state"), str(out))
    return torch.load(out, weights_only=True)["critic_model"]


@pytest.fixture(scope="module")
def layout_runs(assets, reward_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_family")
    cfg = assets["cfg"]
    p = ppo(reward_model)
    runs = {"ppo3": [*p, "--nproc-per-node", "3"], "bitwise3": [*p, BITWISE, "--nproc-per-node", "3"],
            "rpp3": [*RPP, "--nproc-per-node", "3"], "ppo_fsdp2": [*p, "parallel.sharding=fsdp", "--nproc-per-node", "2"],
            "bitwise2": [*p, BITWISE, "--nproc-per-node", "2"], "ppo1": p,
            "bitwise1": [*p, BITWISE], "rpp1": RPP}
    evenrl_many({name: ["train", cfg, *STEPS, *more, f"log.run_dir={root / name}"] for name, more in runs.items()})
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ppo", "rpp"])
def test_one_and_three_processes_give_the_same_models_and_statistics(layout_runs, assets, name):
    one, three = layout_runs / f"{name}1", layout_runs / f"{name}3"
    assert max_diff(final_params(one), final_params(three)) <= 1e-5
    start = load_file(str(Path(assets["model"]) / "model.safetensors"))
    assert max_diff(final_params(one), start) > 1e-5, "training did not move the policy: weak test"
    m1, m3 = [r for r in metrics(one) if r["step"] > 0], [r for r in metrics(three) if r["step"] > 0]
    # step 1 starts from the same weights: each sample's moments are its own, pooled in sample order on every rank
    assert all(m1[0][k] == pytest.approx(m3[0][k], rel=1e-12, abs=1e-15) for k in WHITENING)
    for a, b in zip(m1, m3):  # later steps: weights equal to fp32 rounding
        assert all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in WHITENING)
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-6)
        assert a["advantage/raw_token_std"] > 0
    if name == "ppo":
        assert max_diff(critic_params(one), critic_params(three)) <= 1e-5
        sharded = layout_runs / "ppo_fsdp2"  # policy and critic sharded by FSDP2 over 2 ranks: the same update
        assert max_diff(final_params(one), final_params(sharded)) <= 1e-5
        assert max_diff(critic_params(one), critic_params(sharded)) <= 1e-5
        assert max_diff(critic_params(one, 2), critic_params(one, 3)) > 1e-5, "the critic did not learn: weak test"
        assert all(r["critic/loss"] > 0 and "critic/grad_norm" in r for r in m1)
        assert all(k in m1[0] for k in ("reward/failures/model:rm", "reward/failures/judge:model"))
    else:
        assert all(r["samples"] == 11 for r in m1)  # one sample per prompt
        state = torch.load(one / "checkpoints" / "step-000003" / "trainer.pt", weights_only=True)
        assert "param_groups" in state and "critic_param_groups" not in state  # no critic without gae


@pytest.mark.slow
def test_ppo_with_a_critic_a_reward_model_and_a_judge_is_the_same_bits_on_one_two_and_three(layout_runs):
    """train.reproducibility=bitwise with every role: the policy, the critic (its own fixed-point sums and AdamW),
    a reward model and a judge sampling on each rank. Negative control: the same runs under rounding differ."""
    one = layout_runs / "bitwise1"
    for other in ("bitwise3", "bitwise2"):
        assert_same_run(one, layout_runs / other)
        assert max_diff(critic_params(one), critic_params(layout_runs / other)) == 0.0
    assert max_diff(final_params(layout_runs / "ppo1"), final_params(layout_runs / "ppo3")) > 0.0
    assert max_diff(critic_params(layout_runs / "ppo1"), critic_params(layout_runs / "ppo3")) > 0.0


@pytest.mark.slow
def test_resume_with_a_critic_gives_the_same_models(layout_runs, assets, reward_model, tmp_path):
    crashed = tmp_path / "crashed"
    args = ["train", assets["cfg"], *STEPS, *ppo(reward_model), f"log.run_dir={crashed}"]
    assert evenrl(*args, env=fault_env(crash_at_step=3), check=False).returncode != 0
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "step-000002"
    evenrl(*args, "--resume")
    assert max_diff(final_params(layout_runs / "ppo1"), final_params(crashed)) == 0.0
    assert max_diff(critic_params(layout_runs / "ppo1"), critic_params(crashed)) == 0.0


@pytest.mark.slow
def test_dynamic_sampling_keeps_the_step_full(assets, tmp_path):
    """With mostly_solved ~70% of groups are all-correct: without filtering most of a step has no advantage; with
    it every step still trains on 7 informative groups, on 1 and on 3 processes alike (with the soft overlong
    penalty on: it is part of the reward the groups are filtered by)."""
    common = ["train", assets["cfg"], "train.steps=3", "rewards.functions=[{name: 'toy_rewards:mostly_solved'}]",
              "rewards.isolate=false", "algo.filter_groups=true", "algo.max_generation_rounds=10",
              "rewards.overlong_buffer=2"]
    done = evenrl_many({"three": [*common, f"log.run_dir={tmp_path / 'three'}", "--nproc-per-node", "3"],
                        "one": [*common, f"log.run_dir={tmp_path / 'one'}"],
                        "short": [*common, "algo.max_generation_rounds=1", f"log.run_dir={tmp_path / 'short'}"]})
    rows = [r for r in metrics(tmp_path / "one") if r["step"] > 0]
    assert all(r["samples"] == 21 and r["sampling/groups_short"] == 0 for r in rows)  # 7 prompts x 3 samples
    assert all(r["sampling/rounds"] >= 2 and r["sampling/kept_fraction"] < 0.8 for r in rows), rows
    assert all(r["advantage/abs_mean"] > 0.3 for r in rows)  # no all-equal group left: most samples have advantage
    assert all(-1.0 <= r["reward/overlong_penalty_mean"] < 0 for r in rows)  # 4 of 4 tokens: in the buffer
    assert max_diff(final_params(tmp_path / "one"), final_params(tmp_path / "three")) <= 1e-5
    assert [r["sampling/groups_drawn"] for r in metrics(tmp_path / "three") if r["step"] > 0] == \
        [r["sampling/groups_drawn"] for r in rows]
    short = [r for r in metrics(tmp_path / "short") if r["step"] > 0]
    assert all(r["sampling/rounds"] == 1 and r["sampling/groups_short"] > 0 and r["samples"] < 21 for r in short)
    assert "dynamic sampling kept" in done["short"].stdout and "trains on those" in done["short"].stdout


@pytest.fixture(scope="module")
def demo_warm_start(demo_run):
    """The demo's model, data and a short SFT warm start (greedy answers mostly right, samples often wrong): those of
    tests/conftest.py's demo_run (150 SFT steps), which tests/test_demo.py checks."""
    out, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_ppo_and_reinforce_pp_with_one_sample_per_prompt_raise_the_demo_reward(demo_warm_start):
    """60 steps of 64 prompts x 1 sample each; the mean reward of the last 10 steps beats the first 10 by > 0.03
    (measured: REINFORCE++ 0.636 -> 0.725, PPO+GAE 0.638 -> 0.722)."""
    root = Path(demo_warm_start)
    common = ["train", Path(__file__).resolve().parents[1] / "examples" / "demo.yaml",
              f"data.path={root / 'data' / 'addition.jsonl'}", "eval.path=''", f"model.path={root / 'sft' / 'final'}",
              "train.steps=60", "rollout.samples_per_prompt=1", "data.prompts_per_step=64", "log.progress=false",
              "log.tensorboard=false"]
    t0 = time.monotonic()
    evenrl_many({"ppo": [*common, "algo.advantage=gae", "critic.lr=1e-3", f"log.run_dir={root / 'ppo'}"],
                 "rpp": [*common, "algo.advantage=reinforce_pp", f"log.run_dir={root / 'rpp'}"]})
    for name in ("ppo", "rpp"):
        rewards = [r["reward/mean"] for r in metrics(root / name) if "reward/mean" in r]
        assert len(rewards) == 60
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        assert last > first + 0.03, (name, first, last)
    print(f"demo PPO+GAE and REINFORCE++ runs: {time.monotonic() - t0:.0f} s side by side")
    rows = [json.loads(x) for x in (root / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["critic/loss"] < rows[0]["critic/loss"], "the critic's loss did not fall"
