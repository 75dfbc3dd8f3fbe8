"""Generation overlapped with training (rollout.max_staleness = k on reserved rollout ranks).

What is exact, and what is traded:
  * k = 0 is the synchronous step: tests/test_reserved.py and every layout test stay as they were.
  * k >= 1: step t samples from the policy after step t-1-k instead of t-1. That is the trade (samples up to k steps
    off-policy, corrected by truncated importance weights); nothing else changes. The version of each step is
    fixed by the step number, so the overlapped run is still the same on any layout (below: 1 trainer against 2,
    within the float rounding of summing gradients over a different number of trainers, as for k = 0), and a run
    killed with steps in flight and resumed is bit-identical to the uninterrupted one.
  * The importance-weighted update of one mini-batch is checked against a naive token-by-token computation.
"""

from __future__ import annotations

import functools
import math
import random


import pytest
import torch

from e2e import ENV, evenrl, evenrl_many, final_params, max_diff, metrics, fault_env
from evenrl.config import RunConfig
from evenrl.core.aggregation import Denominators
from evenrl.core.batch import Batch, Ragged
from evenrl.core.staleness import policy_version, push_steps, pushes_at, versions_needed
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model
from evenrl.models.forward import response_logprobs
from evenrl.train.objectives import STAT_NAMES, IS_STAT_NAMES, rl_objective
from evenrl.train.update import minibatch_update


# ----------------------------------------------------------------------------------------- the version schedule

def test_policy_version_by_step():
    assert [policy_version(t, 0) for t in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [policy_version(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [policy_version(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("seed", range(40))
def test_pushes_deliver_each_version_once_in_time(seed):
    """Simulate the protocol for random (start, steps, k): every step the rollout ranks generate finds its version
    loaded; each push is made when the trainers hold that version (their current weights at the start of the step,
    or one the checkpoint they resumed from kept), and nothing is pushed twice or after the last step."""
    rnd = random.Random(seed)
    k, start = rnd.randint(0, 4), rnd.randint(0, 6)
    steps = start + rnd.randint(1, 8)
    sent = []
    for step in range(start + 1, steps + 1):
        for u in pushes_at(step, start, steps, k):
            v = policy_version(u, k)
            assert v == step - 1 or (step == start + 1 and v in versions_needed(start, k)), (step, u, v)
            assert start < u <= steps
            sent.append(u)
    assert sent == push_steps(start, steps, k)  # in order, each once
    loaded = None
    for u in range(start + 1, steps + 1):  # the rollout side
        if u in sent:
            loaded = policy_version(u, k)
        assert loaded == policy_version(u, k)
        # the trainers push u's version at the start of step u - k at the latest: the rollout side can run k ahead
        assert u not in sent or min(s for s in range(start + 1, steps + 1) if u in pushes_at(s, start, steps, k)) \
            <= max(start + 1, u - k)


def test_versions_a_checkpoint_keeps():
    assert versions_needed(5, 0) == []
    assert versions_needed(5, 1) == [4]
    assert versions_needed(5, 3) == [2, 3, 4]
    assert versions_needed(1, 2) == [0]
    assert versions_needed(0, 2) == []


# ----------------------------------------------------------------------------------------- the weighted update

@pytest.mark.parametrize("per_token", [False, True], ids=["sample_versions", "token_versions"])
@pytest.mark.parametrize("cap", [1.0, 3.0])
def test_importance_weighted_update_matches_naive_computation(tmp_path, cap, per_token):
    """One optimizer step on a mini-batch where some samples came from an older policy (version < step - 1), or
    with per_token, some tokens (rollout.partial: a sample carried across steps, token_version):
    evenrl's update (rl_objective through minibatch_update) against a naive one: per sample a plain forward of the
    whole sequence, per token w = min(exp(old - engine), cap) for stale tokens and 1 for fresh ones, the clipped
    surrogate w x max(-A r, -A clip(r)), summed and divided by the token count, then the same optimizer step (SGD
    with lr 1, so the weights move by exactly the gradient: AdamW's first step, g / (|g| + eps), would blow float32
    rounding of near-zero gradients up to lr)."""
    path = make_tiny_model(str(tmp_path / "m"), arch="qwen2", seed=4)
    model, _ = load_policy(path)
    naive, _ = load_policy(path)
    g = torch.Generator().manual_seed(5)
    rows, resp, prompts = [], [], [5, 3, 6, 4]
    for p in prompts:
        n = int(torch.randint(2, 6, (), generator=g))
        rows.append(torch.randint(3, 60, (p + n,), generator=g))
        resp.append(n)
    resp_t = torch.tensor(resp)
    with torch.no_grad():
        current = [torch.log_softmax(model(r[None]).logits[0, :-1].float(), -1).gather(-1, r[1:, None])[:, 0][-n:]
                   for r, n in zip(rows, resp)]
    old = [c + 0.3 * torch.randn(c.shape, generator=g) for c in current]       # the ratio's denominator
    engine = [o + 0.7 * torch.randn(o.shape, generator=g) for o in old]        # the policy that sampled
    version = torch.tensor([0, 2, 1, 2])  # step 3: the policy after step 2 is trained; rows 0 and 2 are stale
    adv = torch.tensor([1.0, -0.5, -1.2, 0.8])
    batch = Batch({"tokens": Ragged.of(rows, torch.long), "response_len": resp_t, "advantage": adv,
                   "old_logp": Ragged.of(old, torch.float32), "engine_logp": Ragged.of(engine, torch.float32),
                   "version": version, "reward_failed": torch.zeros(4, dtype=torch.bool),
                   "finished": torch.ones(4, dtype=torch.bool)})
    # per token: each row's tokens from its version up to 2, one more each token (1, 2 or 3 versions per row)
    token_version = [[min(int(v) + t, 2) for t in range(n)] for v, n in zip(version, resp)]
    if per_token:
        batch["token_version"] = Ragged.of([torch.tensor(v) for v in token_version], torch.long)
    cfg = RunConfig.model_validate({"model": {"path": path}, "rollout": {"max_staleness": 2},
                                    "algo": {"importance_cap": cap, "clip_low": 0.2, "clip_high": 0.28}})
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    denom = Denominators(tokens=float(resp_t.sum()), seqs=4.0)
    stats = minibatch_update(model, opt, None, batch, [[0, 1], [2, 3]], denom,
                             forward=functools.partial(response_logprobs, pad_token_id=0, entropy=True),
                             loss_fn=functools.partial(rl_objective, cfg, 3),
                             stat_names=STAT_NAMES + IS_STAT_NAMES,
                             aggregation="token-mean", max_grad_norm=0.0, pad_token_id=0)

    naive_opt = torch.optim.SGD(naive.parameters(), lr=1.0)
    total, weights, cut = 0.0, [], 0
    for i, (r, n) in enumerate(zip(rows, resp)):
        logp = torch.log_softmax(naive(r[None]).logits[0, :-1].float(), -1).gather(-1, r[1:, None])[:, 0][-n:]
        for t in range(n):
            raw = math.exp(float(old[i][t]) - float(engine[i][t]))
            stale = (token_version[i][t] if per_token else int(version[i])) < 2
            w = min(raw, cap) if stale else 1.0
            weights.append(w)
            cut += int(stale and raw > cap)
            ratio = torch.exp(logp[t] - old[i][t])
            a = float(adv[i])
            total = total + w * torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28))
    (total / float(resp_t.sum())).backward()
    naive_opt.step()
    assert stats["policy/is_weight"] == pytest.approx(sum(weights) / len(weights), rel=1e-6)
    assert stats["policy/is_clipped_fraction"] == pytest.approx(cut / len(weights), rel=1e-9)
    if cap == 1.0:
        assert 0 < cut  # the cap changed the update
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), naive.parameters()))
        moved = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), load_policy(path)[0].parameters()))
    print(f"cap {cap}: moved {moved:.3g}, evenrl - naive {diff:.3g}")
    assert moved > 1e-3 and diff < 1e-5 * moved, (moved, diff)  # measured 2e-7 and 4e-7 x moved


# ----------------------------------------------------------------------------------------- end to end

SHAPE = ["rollout.samples_per_prompt=3", "data.prompts_per_step=7", "train.steps=5", "rewards.isolate=false",
         "checkpoint.every_steps=1", "checkpoint.keep=2"]


@pytest.fixture(scope="module")
def overlapped(assets, tmp_path_factory):
    """The uninterrupted overlapped runs, two at a time, longest first: k = 1 with 1 rollout rank on 2 trainers
    ("two") and on 1 ("k1"), and k = 2 on 1 trainer ("k2"). The tests below compare against them: k1 serves both
    the layout test and the resume of k = 1 (the same command)."""
    root = tmp_path_factory.mktemp("overlap")
    evenrl_many({"two": [*overlap_args(assets, 1), f"log.run_dir={root / 'two'}", "--nproc-per-node", 3],
                 **{f"k{k}": [*overlap_args(assets, k), f"log.run_dir={root / f'k{k}'}", "--nproc-per-node", 2]
                    for k in (1, 2)}})
    return root


def overlap_args(assets, k: int) -> list:
    return ["train", assets["cfg"], *SHAPE, f"rollout.max_staleness={k}", "--rollout-devices", 1]


@pytest.mark.slow
def test_overlapped_run_is_the_same_on_any_layout(overlapped, capsys):
    """k = 1 with 1 rollout rank, on 1 and on 2 trainers: the same samples (rewards, lengths), staleness 0 for step
    1 and 1 after it, importance weights in use, and the same model within the rounding of a different number of
    trainers (the bound of the synchronous reserved test)."""
    one, two = metrics(overlapped / "k1"), metrics(overlapped / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4, 5]
    for x, y in zip(one, two):
        for k in ("reward/mean", "reward/std", "response/length_mean", "samples"):
            assert x[k] == y[k], (x["step"], k, x[k], y[k])
        assert x["rollout/staleness_hist"] == ([21, 0] if x["step"] == 1 else [0, 21])
        assert x["policy/is_weight"] == pytest.approx(y["policy/is_weight"], abs=1e-5)
    # step 1 sampled from the trained policy itself (weights exactly 1); later steps from the one before
    assert one[0]["policy/is_weight"] == pytest.approx(1.0, abs=1e-6) and one[0]["rollout/logprob_mismatch"] < 1e-5
    assert any(abs(r["policy/is_weight"] - 1.0) > 1e-4 for r in one[1:])
    assert min(r["rollout/logprob_mismatch"] for r in one[1:]) > 1e-4  # the policy moved between sampling and training
    assert max_diff(final_params(overlapped / "k1"), final_params(overlapped / "two")) < 1e-5
    from e2e import evenrl_here

    assert evenrl_here(capsys, "report", overlapped / "k1")[0] == 0
    assert (overlapped / "k1" / "plots" / "off_policy.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_resume_regenerates_in_flight_steps(assets, overlapped, tmp_path, k):
    """Killed at the start of step 3 (checkpoint 2 written, up to k steps generated ahead and lost), then resumed:
    the steps that were in flight are regenerated with the versions they were meant to use (kept by checkpoint 2),
    so the resumed run is bit-identical to the uninterrupted one (overlapped / f"k{k}")."""
    args = [*overlap_args(assets, k), "--nproc-per-node", 2]
    crashed = evenrl(*args, f"log.run_dir={tmp_path / 'run'}", env=fault_env(crash_at_step=3),
                     check=False)
    assert crashed.returncode != 0
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step-000002" / "versions").iterdir())
    assert kept == [f"v{v}" for v in versions_needed(2, k)]
    evenrl(*args, f"log.run_dir={tmp_path / 'run'}", "--resume")
    whole, run = metrics(overlapped / f"k{k}"), metrics(tmp_path / "run")
    assert [r["step"] for r in run] == [1, 2, 3, 4, 5]
    for x, y in zip(whole, run):
        for name in ("reward/mean", "response/length_mean", "policy/is_weight", "policy/loss", "rollout/staleness_hist"):
            assert x[name] == y[name], (x["step"], name)
    assert max_diff(final_params(overlapped / f"k{k}"), final_params(tmp_path / "run")) == 0.0


def test_staleness_needs_reserved_rollout_devices(assets, tmp_path, capsys):
    from e2e import evenrl_here

    code, out, err = evenrl_here(capsys, "train", assets["cfg"], "rollout.max_staleness=1",
                                 f"log.run_dir={tmp_path}/r")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "rollout_devices" in err, err
