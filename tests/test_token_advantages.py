"""Per-token estimators (REINFORCE++, GAE), their whitening, the critic's value loss, the overlong penalty and the
dynamic-sampling helpers, each against a plain Python loop over one row's tokens at a time."""

import math
import random

import pytest
import torch

from evenrl.core.advantages import (discounted_returns, gae_advantages, pooled_moments, reinforce_pp_advantages,
                                    token_moments, token_rewards, whiten, whiten_tokens)
from evenrl.core.batch import Batch, Ragged
from evenrl.core.losses import LossInputs, LossSettings, rl_loss, value_loss
from evenrl.rewards.overlong import overlong_penalty
from evenrl.train.sampling import renumber_groups
from evenrl.train.step import capped_runs, right_aligned_mask, to_ragged


# ----------------------------------------------------------------------------------------------- naive references
# Rows are plain lists of each response's tokens; the functions under test take them right-aligned in [B, R].


def rows_of(seed, n_rows=6, longest=7):
    rnd = random.Random(seed)
    lengths = [rnd.randint(0, longest) for _ in range(n_rows)]
    lengths[0] = longest  # the widest row sets R
    return rnd, lengths


def aligned(rows, width):
    """[B, R] float64 right-aligned rows and their mask."""
    x = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        if r:
            x[i, width - len(r):] = torch.tensor(r, dtype=torch.float64)
    return x, right_aligned_mask(torch.tensor([len(r) for r in rows]))


def unaligned(x, lengths):
    return [x[i, x.shape[1] - n:].tolist() if n else [] for i, n in enumerate(lengths)]


def naive_token_rewards(score, kl_row, kl_coef):
    r = [-kl_coef * k for k in kl_row]
    if r:
        r[-1] += score
    return r


def naive_returns(rewards, gamma):
    out, g = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        g = rewards[t] + gamma * g
        out[t] = g
    return out


def naive_gae(rewards, values, gamma, lam):
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        nxt = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * nxt - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


def naive_whiten(rows, eps=1e-8):
    flat = [v for r in rows for v in r]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    return [[(v - mean) / math.sqrt(var + eps) for v in r] for r in rows]


# ----------------------------------------------------------------------------------------------- estimators


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, kl_coef", [(1.0, 0.0), (0.9, 0.1), (0.5, 0.0)])
def test_reinforce_pp_matches_naive_loop(seed, gamma, kl_coef):
    rnd, lengths = rows_of(seed)
    scores = [rnd.choice([0.0, 1.0, 0.5]) for _ in lengths]
    kl = [[rnd.uniform(0, 0.3) for _ in range(n)] for n in lengths]
    width = max(lengths)
    kl_t, mask = aligned(kl, width)
    s = torch.tensor(scores, dtype=torch.float64)

    rewards = token_rewards(s, mask, kl_t, kl_coef)
    want_rewards = [naive_token_rewards(sc, k, kl_coef) for sc, k in zip(scores, kl)]
    for got, want in zip(unaligned(rewards, lengths), want_rewards):
        assert got == pytest.approx(want, abs=1e-12)
    assert not rewards[~mask].any()

    returns = discounted_returns(rewards, mask, gamma)
    want_returns = [naive_returns(r, gamma) for r in want_rewards]
    for got, want in zip(unaligned(returns, lengths), want_returns):
        assert got == pytest.approx(want, abs=1e-12)

    adv = reinforce_pp_advantages(s, mask, gamma, kl_t, kl_coef)
    for got, want in zip(unaligned(adv, lengths), naive_whiten(want_returns)):
        assert got == pytest.approx(want, abs=1e-9)
    assert not adv[~mask].any()


def test_reinforce_pp_one_sample_per_prompt_ranks_by_reward():
    """No group: with gamma 1 every token of a response carries its score, whitened over the batch's tokens, so a
    right answer's tokens are pushed up and a wrong one's down even when each prompt has a single sample."""
    mask = right_aligned_mask(torch.tensor([3, 2, 4]))
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), mask)
    assert (adv[0][mask[0]] > 0).all() and (adv[1][mask[1]] < 0).all() and (adv[2][mask[2]] < 0).all()
    assert float(adv[mask].mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(adv[mask].std()) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0)])
def test_gae_matches_naive_loop(seed, gamma, lam):
    rnd, lengths = rows_of(seed)
    rewards = [[rnd.uniform(-1, 1) for _ in range(n)] for n in lengths]
    values = [[rnd.uniform(-1, 1) for _ in range(n)] for n in lengths]
    width = max(lengths)
    r, mask = aligned(rewards, width)
    v, _ = aligned(values, width)
    v[~mask] = 123.0  # values at padding must not leak into any response token
    adv, ret = gae_advantages(r, v, mask, gamma, lam)
    for i, n in enumerate(lengths):
        want_adv, want_ret = naive_gae(rewards[i], values[i], gamma, lam)
        assert unaligned(adv, lengths)[i] == pytest.approx(want_adv, abs=1e-12)
        assert unaligned(ret, lengths)[i] == pytest.approx(want_ret, abs=1e-12)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return():
    rnd, lengths = rows_of(9)
    rewards = [[rnd.uniform(-1, 1) for _ in range(n)] for n in lengths]
    r, mask = aligned(rewards, max(lengths))
    adv, _ = gae_advantages(r, torch.zeros_like(r), mask, 0.9, 1.0)
    assert torch.allclose(adv, discounted_returns(r, mask, 0.9), atol=1e-12)


# ----------------------------------------------------------------------------------------------- whitening


@pytest.mark.parametrize("seed", range(5))
def test_whitening_pooled_from_any_split_of_rows_is_the_whole_batchs(seed):
    """What makes the whitening layout-free: per-row moments pooled over all rows equal the statistics of all
    tokens, however the rows were batched (each rank pads its own rows to its own width)."""
    rnd, lengths = rows_of(seed, n_rows=9)
    rows = [[rnd.gauss(3.0, 2.0) for _ in range(n)] for n in lengths]
    flat = [v for r in rows for v in r]
    want_mean = sum(flat) / len(flat)
    want_var = sum((v - want_mean) ** 2 for v in flat) / (len(flat) - 1)

    x, mask = aligned(rows, max(lengths))
    whole = pooled_moments(*token_moments(x, mask))
    assert whole == pytest.approx((want_mean, want_var), rel=1e-12)

    cut = sorted(rnd.sample(range(1, len(rows)), 2))
    pieces = [rows[: cut[0]], rows[cut[0]: cut[1]], rows[cut[1]:]]  # three "ranks", each its own width
    parts = [token_moments(*aligned(p, max(len(r) for r in p) or 1)) for p in pieces]
    pooled = pooled_moments(*(torch.cat([p[k] for p in parts]) for k in range(3)))
    assert pooled == pytest.approx(whole, rel=1e-12, abs=1e-14)

    got = whiten(x, mask, *pooled)
    for g, w in zip(unaligned(got, lengths), naive_whiten(rows)):
        assert g == pytest.approx(w, abs=1e-9)
    assert torch.allclose(got, whiten_tokens(x, mask), atol=1e-12)


def test_whitening_degenerate_inputs_are_finite():
    x, mask = aligned([[2.0], []], 1)
    assert pooled_moments(*token_moments(x, mask)) == (2.0, 0.0)
    assert whiten_tokens(x, mask).tolist() == [[0.0], [0.0]]
    empty = torch.zeros(0, 3, dtype=torch.float64)
    assert pooled_moments(*token_moments(empty, empty.bool())) == (0.0, 0.0)


# ----------------------------------------------------------------------------------------------- losses


def test_value_loss_matches_naive_loop():
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    old = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    ret = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = right_aligned_mask(torch.tensor([6, 3, 0, 5]))
    clip = 0.3
    loss, stats = value_loss(v, old, ret, mask, clip)
    clipped_count = 0
    for i in range(4):
        for t in range(6):
            if not mask[i, t]:
                assert float(loss.detach()[i, t]) == 0
                continue
            vv, oo, rr = float(v.detach()[i, t]), float(old[i, t]), float(ret[i, t])
            vc = oo + min(max(vv - oo, -clip), clip)
            want = 0.5 * max((vv - rr) ** 2, (vc - rr) ** 2)
            clipped_count += (vc - rr) ** 2 > (vv - rr) ** 2
            assert float(loss.detach()[i, t]) == pytest.approx(want, abs=1e-12)
    assert [float(x) for x in stats["critic/clip_fraction"]] == [clipped_count, int(mask.sum())]
    assert float(stats["critic/loss"][0]) == pytest.approx(float(loss.detach().sum()))
    # gradient: values past the clip on the clipped (larger) branch get none
    loss.sum().backward()
    far = (v.detach() - old).abs() > clip
    assert v.grad[mask & ~far].abs().sum() > 0


def test_rl_loss_takes_per_token_advantages():
    """A [B, R] advantage gives each token its own weight; a [B] one broadcasts. Same logp, same ratio 1."""
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5]], dtype=torch.float64))
    mask = torch.tensor([[False, True, True]])
    common = dict(logp=logp, old_logp=logp.clone(), mask=mask, entropy=torch.zeros_like(logp))
    per_token, _ = rl_loss(LossInputs(advantages=torch.tensor([[9.0, 2.0, -1.0]], dtype=torch.float64), **common),
                           LossSettings())
    per_sample, _ = rl_loss(LossInputs(advantages=torch.tensor([2.0], dtype=torch.float64), **common),
                            LossSettings())
    assert per_token.tolist() == [[0.0, -2.0, 1.0]]
    assert per_sample.tolist() == [[0.0, -2.0, -2.0]]


# ----------------------------------------------------------------------------------------------- overlong, sampling


def test_overlong_penalty_matches_dapo():
    lens = torch.arange(0, 21)
    got = overlong_penalty(lens, max_new_tokens=20, buffer=5, penalty=2.0)
    for n, g in zip(lens.tolist(), got.tolist()):
        want = min(-(n - (20 - 5)) / 5 * 2.0, 0.0)  # verl's formula
        assert g == pytest.approx(want, abs=1e-7)
    assert got[15] == 0 and got[20] == pytest.approx(-2.0) and got[14] == 0
    assert not overlong_penalty(lens, 20, 0, 2.0).any()


def test_renumber_groups_closes_the_gaps_in_position_order():
    n = 2
    kept_groups = [5, 5, 1, 1, 8, 8]  # positions of kept groups from several rounds: this rank's rows
    b = Batch({"group": torch.tensor(kept_groups), "sample_index": torch.tensor([10, 11, 3, 2, 16, 17])})
    out = renumber_groups(b, [1, 3, 5, 8], n)  # group 3 was kept on another rank only
    assert out["group"].tolist() == [2, 2, 0, 0, 3, 3]
    assert out["sample_index"].tolist() == [4, 5, 1, 0, 6, 7]


def test_capped_runs_and_ragged_round_trip():
    assert capped_runs([3, 5, 2, 9, 1], cap=10) == [[0, 1], [2], [3], [4]]  # 2 x 5 fits 10
    assert capped_runs([30], cap=10) == [[0]]  # a row longer than the cap still runs, alone
    assert capped_runs([], cap=10) == []
    lens = torch.tensor([2, 0, 3])
    x = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 4.0, 5.0]])
    r = to_ragged(x, lens)
    assert isinstance(r, Ragged) and r.values.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] and r.lengths.tolist() == [2, 0, 3]


# ----------------------------------------------------------------------------------------------- the step's phases


def test_step_whitens_over_the_kept_samples_tokens_only():
    """add_token_returns -> gather_rows -> add_advantages on one process: the whitening statistics are those of
    the tokens of the samples left in learning (truncated ones masked by rewards.mask_truncated), every kept token
    gets the naive whitened return, masked samples get 0."""
    from types import SimpleNamespace

    from evenrl.config import load_config
    from evenrl.train.step import add_advantages, add_token_returns, gather_rows

    cfg = load_config(None, ["algo.advantage=reinforce_pp", "algo.gamma=0.8", "rewards.mask_truncated=true"])
    lengths, rewards, finished = [3, 1, 4, 2], [1.0, 0.0, 0.5, 1.0], [True, True, False, True]
    local = Batch({"sample_index": torch.tensor([2, 0, 3, 1]), "group": torch.tensor([2, 0, 3, 1]),
                   "tokens": Ragged.of([torch.arange(n + 2) for n in lengths], torch.long),
                   "response_len": torch.tensor(lengths), "reward": torch.tensor(rewards),
                   "reward_failed": torch.zeros(4, dtype=torch.bool), "finished": torch.tensor(finished),
                   "version": torch.zeros(4, dtype=torch.long)})
    run = SimpleNamespace(cfg=cfg)
    add_token_returns(run, local)
    everyone, _ = gather_rows(local)
    stats = add_advantages(run, local, everyone)
    kept = [naive_returns([0.0] * (n - 1) + [r], 0.8) for n, r, f in zip(lengths, rewards, finished) if f]
    flat = [v for r in kept for v in r]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    assert stats["advantage/raw_token_mean"] == pytest.approx(mean, abs=1e-12)
    assert stats["advantage/raw_token_std"] == pytest.approx(math.sqrt(var), abs=1e-12)
    got = torch.split(local["token_advantage"].values, lengths)
    want = iter(naive_whiten(kept))
    for g, f in zip(got, finished):
        assert g.tolist() == pytest.approx(next(want), abs=1e-6) if f else not g.any()
    assert float(everyone["advantage"][3]) == 0.0  # the truncated sample: no advantage
