"""Per-token off-policy correction (evenrl.core.offpolicy): samples whose tokens were sampled by 1, 2 or 3 policy
versions (a sample carried across steps), through the loss, against a naive token-by-token computation."""

from __future__ import annotations

import math

import pytest
import torch

from evenrl.core.losses import LossInputs, LossSettings, rl_loss
from evenrl.core.offpolicy import behavior_logprobs, tokens_by_age, version_runs

TRAINED = 4  # step 5 trains the policy after step 4
# per sample, the version of each response token: 1, 2 and 3 versions, fresh, stale and mixed
VERSIONS = [[4, 4, 4, 4, 4],        # one version, the trained policy's own
            [3, 3, 3, 3],           # one version, one step old
            [3, 3, 4, 4, 4, 4],     # two versions: carried once
            [2, 2, 3, 3, 4],        # three versions: carried twice
            [1, 2, 2, 3, 3, 3]]     # three versions, all older than the trained policy


def _naive_weights(old, engine, versions, correction, level, mode, floor, cap):
    """Per token, the importance weight, one token at a time."""
    out = []
    for o_row, e_row, v_row in zip(old, engine, versions):
        fix = [correction == "all" or (correction == "stale" and v < TRAINED) for v in v_row]
        logw = [(o - e) if f else 0.0 for o, e, f in zip(o_row, e_row, fix)]
        if level == "token":
            raw = [math.exp(max(-20.0, min(20.0, x))) for x in logw]
        else:
            total = sum(logw) if level == "sequence" else sum(logw) / len(logw)
            raw = [math.exp(max(-20.0, min(20.0, total)))] * len(logw)
        if mode == "truncate":
            out.append([min(max(w, floor), cap) for w in raw])
        elif mode == "mask":
            out.append([w if floor <= w <= cap else 0.0 for w in raw])
        else:
            out.append([1.0] * len(raw))
    return out


def _right_aligned(rows, width, dtype=torch.float64):
    x = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        x[i, width - len(r):] = torch.tensor(r, dtype=dtype)
    return x


@pytest.mark.parametrize("correction", ["stale", "all", "none"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "none"])
def test_per_token_correction_matches_naive_loop(correction, level, mode):
    """The loss of samples whose tokens span 1, 2 and 3 policy versions, through behavior_logprobs and rl_loss
    (decoupled PPO: each token's PPO-clip of exp(logp - old) times the weight of its corrected tokens'
    exp(old - engine), at the level and mode), against a token-by-token loop; the gradient too, by central
    differences."""
    gen = torch.Generator().manual_seed(7)
    width = max(len(v) for v in VERSIONS)
    lens = [len(v) for v in VERSIONS]
    mask = _right_aligned([[1] * n for n in lens], width, torch.bool)
    logp = (torch.randn(len(VERSIONS), width, generator=gen, dtype=torch.float64) * 0.4 - 2) * mask
    old = (logp + torch.randn(logp.shape, generator=gen, dtype=torch.float64) * 0.2) * mask
    engine = (old + torch.randn(logp.shape, generator=gen, dtype=torch.float64) * 0.5) * mask
    adv = torch.tensor([0.9, -1.1, 0.6, -0.4, 1.3], dtype=torch.float64)
    version = _right_aligned(VERSIONS, width, torch.long)
    floor, cap, clip = 0.5, 1.6, (0.2, 0.28)
    settings = LossSettings(clip_low=clip[0], clip_high=clip[1], importance_cap=cap, importance_floor=floor,
                            importance_level=level, importance_mode=mode)

    def loss_of(lp):
        behavior = behavior_logprobs(old, engine, version, TRAINED, correction)
        per_token, stats = rl_loss(LossInputs(logp=lp, old_logp=old, advantages=adv, mask=mask,
                                              entropy=torch.zeros_like(lp), behavior_logp=behavior), settings)
        return per_token * mask, stats

    got, stats = loss_of(logp.clone().requires_grad_())
    rows = lambda x: [x[i, width - n:].tolist() for i, n in enumerate(lens)]  # noqa: E731
    o, e, lp = rows(old), rows(engine), rows(logp)
    weights = _naive_weights(o, e, VERSIONS, correction, level, mode, floor, cap)
    want = []
    for i in range(len(VERSIONS)):
        row = []
        for t in range(lens[i]):
            r, a = math.exp(lp[i][t] - o[i][t]), float(adv[i])
            row.append(weights[i][t] * max(-a * r, -a * min(max(r, 1 - clip[0]), 1 + clip[1])))
        want.append(row)
    for i, n in enumerate(lens):
        assert got[i, width - n:].tolist() == pytest.approx(want[i], rel=1e-12, abs=1e-12), (i, VERSIONS[i])
    n = int(mask.sum())
    assert float(stats["policy/is_weight"][0]) / n == pytest.approx(sum(map(sum, weights)) / n, rel=1e-12)
    if correction != "none" and mode != "none":
        assert any(w != 1.0 for row in weights for w in row)  # the correction changed something
    lp_t = logp.clone().requires_grad_()
    loss_of(lp_t)[0].sum().backward()
    eps = 1e-6
    for i, n in enumerate(lens):
        for t in range(width - n, width):
            hi, lo = logp.clone(), logp.clone()
            hi[i, t] += eps
            lo[i, t] -= eps
            numeric = (float(loss_of(hi)[0].sum()) - float(loss_of(lo)[0].sum())) / (2 * eps)
            assert float(lp_t.grad[i, t]) == pytest.approx(numeric, abs=1e-6), (i, t)


def test_fresh_tokens_of_a_carried_sample_are_not_corrected():
    """With 'stale', the tokens of a sample that the trained policy sampled itself get weight exactly 1 while its
    older tokens are corrected: the decision is per token, not per sample."""
    version = torch.tensor([[3, 3, 4, 4]])
    old, engine = torch.full((1, 4), -1.0), torch.full((1, 4), -1.5)
    assert behavior_logprobs(old, engine, version, TRAINED, "stale").tolist() == [[-1.5, -1.5, -1.0, -1.0]]
    assert behavior_logprobs(old, engine, version, TRAINED, "all").tolist() == [[-1.5] * 4]
    assert behavior_logprobs(old, engine, version, TRAINED, "none").tolist() == [[-1.0] * 4]


def test_version_counts():
    assert [version_runs(v) for v in VERSIONS] == [1, 1, 2, 3, 3]
    assert tokens_by_age(VERSIONS, TRAINED, 3) == [5 + 4 + 1, 4 + 2 + 2 + 3, 2 + 2, 1]
