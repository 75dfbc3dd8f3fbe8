"""The objectives beyond PPO-clip (evenrl.core.surrogates, evenrl.core.importance, the new aggregation, KL
estimators and advantage options), each against a plain-Python loop on random inputs AND against hand-worked values
of the peer's published definition (verl's core_algos, TRL's GRPO trainer, OpenRLHF), plus their config checks."""

import math
import random

import pytest
import torch

from evenrl.config.load import load_config
from evenrl.core.advantages import (compute_advantages, dr_grpo_advantages, grpo_advantages,
                                    reinforce_pp_baseline_advantages, rloo_advantages)
from evenrl.core.aggregation import Denominators, aggregate, row_sums
from evenrl.core.importance import importance_weights
from evenrl.core.losses import LossInputs, LossSettings, kl_penalty, rl_loss
from evenrl.core.surrogates import PolicyParams as P, cispo, gspo, ppo_clip, sequence_ratio, surrogate
from evenrl.errors import UsageError


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def close(got, want, tol=1e-12):
    got = got.tolist() if isinstance(got, torch.Tensor) else got
    flat_g = torch.tensor(got, dtype=torch.float64).reshape(-1)
    flat_w = torch.tensor(want, dtype=torch.float64).reshape(-1)
    assert flat_g.shape == flat_w.shape
    assert torch.allclose(flat_g, flat_w, rtol=tol, atol=tol), (got, want)


def random_batch(seed, B=5, T=6, spread=0.4):
    gen = torch.Generator().manual_seed(seed)
    logp = (torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[0] = False  # a row with no tokens
    mask[1, -1] = True
    return logp, old, adv, mask


# ----------------------------------------------------------------------------------------------- naive references


def naive_dual_clip(logp, old, adv, lo, hi, c):
    out = []
    for b, row in enumerate(logp):
        a, vals = adv[b], []
        for t, lp in enumerate(row):
            r = math.exp(lp - old[b][t])
            value = max(-r * a, -min(max(r, 1 - lo), 1 + hi) * a)
            if a < 0:
                value = min(value, -c * a)
            vals.append(value)
        out.append(vals)
    return out


def naive_gspo(logp, old, adv, mask, lo, hi):
    out = []
    for b, row in enumerate(logp):
        ts = [t for t in range(len(row)) if mask[b][t]]
        mean = sum(row[t] - old[b][t] for t in ts) / max(len(ts), 1)
        s = math.exp(min(mean, 10.0))
        value = max(-s * adv[b], -min(max(s, 1 - lo), 1 + hi) * adv[b])
        out.append([value if mask[b][t] else 0.0 for t in range(len(row))])
    return out


def naive_importance(old, beh, mask, level, mode, floor, cap):
    weights, cut, rejected = [], [], []
    for b, row in enumerate(old):
        ts = [t for t in range(len(row)) if mask[b][t]]
        logs = [row[t] - beh[b][t] for t in range(len(row))]
        if level == "sequence":
            logs = [sum(logs[t] for t in ts)] * len(row)
        elif level == "geometric":
            logs = [sum(logs[t] for t in ts) / max(len(ts), 1)] * len(row)
        w_row, c_row, r_row = [], [], []
        for t in range(len(row)):
            raw = math.exp(max(-20.0, min(20.0, logs[t])))
            out = mask[b][t] and (raw > cap or raw < floor)
            if mode == "truncate":
                w = min(max(raw, floor), cap)
            else:
                w = 0.0 if out else raw
            w_row.append(w if mask[b][t] else 0.0)
            c_row.append(bool(out and mode == "truncate"))
            r_row.append(bool(out and mode == "mask"))
        weights.append(w_row)
        cut.append(c_row)
        rejected.append(r_row)
    return weights, cut, rejected


# ----------------------------------------------------------------------------------------------- surrogates


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dual_clip_matches_naive_loop_and_zero_is_plain_ppo(seed):
    logp, old, adv, mask = random_batch(seed, spread=1.5)  # wide ratios: the dual bound bites
    adv[2] = -2.0
    loss, stats = ppo_clip(logp, old, adv, P(0.2, 0.28, 3.0), mask=mask)
    want = naive_dual_clip(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28, 3.0)
    close(loss, [[v if m else 0.0 for v, m in zip(r, mr)] for r, mr in zip(want, mask.tolist())])
    ratio = (logp - old).exp()
    held = ((adv[:, None] < 0) & (ratio > 3.0) & mask).sum()
    assert int(stats["dual_clipped_tokens"]) == int(held)
    plain, _ = ppo_clip(logp, old, adv, P(0.2, 0.28), mask=mask)
    big, _ = ppo_clip(logp, old, adv, P(0.2, 0.28, 1e9), mask=mask)
    assert torch.equal(plain, big)  # a bound never reached changes nothing


def test_dual_clip_hand_values_of_verls_definition():
    """verl compute_policy_loss_vanilla, clip_ratio_c=3: A = -1, ratio 5 -> max(5, 1.2) = 5, capped at 3 (no gradient);
    ratio 2 -> 2 (below the bound); A = +1, ratio 5 -> max(-5, -1.2) = -1.2 (dual clip only for A < 0)."""
    logp = torch.log(t64([[5.0, 2.0, 5.0]])).requires_grad_()
    adv = t64([[-1.0, -1.0, 1.0]])
    loss, stats = ppo_clip(logp, torch.zeros(1, 3, dtype=torch.float64), adv, P(0.2, 0.2, 3.0))
    close(loss, [[3.0, 2.0, -1.2]])
    loss.sum().backward()
    close(logp.grad, [[0.0, 2.0, 0.0]])  # d(-A r)/dlogp = -A r on the unclipped branch only
    assert int(stats["dual_clipped_tokens"]) == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_matches_naive_loop_and_trls_sequence_form(seed):
    """Value: the naive per-row loop. Gradient: TRL's importance_sampling_level=sequence form (exp of the row's mean
    log-ratio broadcast over the row, clipped like PPO) under token-mean and seq-mean-token-mean aggregation."""
    logp, old, adv, mask = random_batch(seed, spread=0.05)
    lo, hi = 0.02, 0.03
    loss, stats = gspo(logp, old, adv, P(lo, hi), mask=mask)
    close(loss, naive_gspo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), lo, hi))
    clipped_rows = {b for b, row in enumerate(loss.tolist()) if mask[b].any()}
    assert int(stats["clipped_tokens"]) <= int(mask.sum()) and clipped_rows
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        denom = Denominators(tokens=float(mask.sum()), seqs=float((mask.sum(-1) > 0).sum()), norm_tokens=8.0)
        x = logp.detach().clone().requires_grad_()
        aggregate(gspo(x, old, adv, P(lo, hi), mask=mask)[0], mask, mode, denom).backward()
        y = logp.detach().clone().requires_grad_()
        m = mask.double()
        seq = ((y - old) * m).sum(-1) / m.sum(-1).clamp(min=1)       # TRL: mean log-ratio per row, with gradient
        s = seq.exp()[:, None]
        trl = -torch.minimum(s * adv[:, None], s.clamp(1 - lo, 1 + hi) * adv[:, None]).expand_as(y)
        aggregate(trl, mask, mode, denom).backward()
        close(x.grad, y.grad.tolist(), tol=1e-10)
        assert x.grad.abs().sum() > 0


def test_gspo_hand_values():
    """Row log-ratios 0.1 and 0.3: s = e^0.2 = 1.2214 on both tokens; clip 1 +- 0.2: A = +1 -> -1.2 (clipped),
    A = -1 -> 1.2214 (the unclipped branch is larger)."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = t64([[0.1, 0.3], [0.1, 0.3]])
    loss, stats = gspo(logp, old, t64([1.0, -1.0]), P(0.2, 0.2))
    close(loss, [[-1.2, -1.2], [math.exp(0.2)] * 2])
    assert int(stats["clipped_tokens"]) == 2
    close(sequence_ratio(logp, old, torch.ones(2, 2, dtype=torch.bool)), [[math.exp(0.2)] * 2] * 2)


def test_sequence_ratio_from_row_sums_of_a_split_row():
    """Sequence parallelism splits a row's tokens over ranks: the row's two sums, added over the parts, are the
    whole row's, and they are all the sequence ratio depends on."""
    logp, old, _, mask = random_batch(5)
    whole = row_sums(logp.detach() - old, mask)
    parts = [row_sums(logp.detach()[:, s] - old[:, s], mask[:, s]) for s in (slice(0, 2), slice(2, None))]
    close(parts[0][0] + parts[1][0], whole[0].tolist())
    close(parts[0][1] + parts[1][1], whole[1].tolist())


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_matches_naive_loop_and_its_gradient_is_the_clipped_weight(seed):
    logp, old, adv, mask = random_batch(seed, spread=0.5)
    loss, stats = cispo(logp, old, adv, P(10.0, 0.1), mask=mask)
    want, grads, cut = [], [], 0
    for b, row in enumerate(logp.tolist()):
        vals, gs = [], []
        for t, lp in enumerate(row):
            r = math.exp(lp - old[b, t].item())
            w = min(max(r, 1 - 10.0), 1 + 0.1)
            on = bool(mask[b, t])
            vals.append(-w * adv[b].item() * lp if on else 0.0)
            gs.append(-w * adv[b].item() if on else 0.0)
            cut += on and w != r
        want.append(vals)
        grads.append(gs)
    close(loss, want)
    loss.sum().backward()
    close(logp.grad, grads)
    assert int(stats["clipped_tokens"]) == cut > 0


def test_cispo_hand_values_of_trls_definition():
    """TRL loss_type=cispo with epsilon_high 1.5 (an absolute cap on the ratio) = evenrl clip_high 0.5, clip_low 10:
    logp -0.5, old -1.0 -> ratio e^0.5 = 1.6487 -> weight 1.5; A = 2: loss -1.5 * 2 * -0.5 = 1.5, gradient -3.
    A ratio of e^-3 = 0.0498 stays unclipped below (verl's recipe clip_ratio_low=10)."""
    logp = t64([[-0.5, -4.0]]).requires_grad_()
    loss, _ = cispo(logp, t64([[-1.0, -1.0]]), t64([2.0]), P(10.0, 0.5))
    close(loss, [[1.5, -math.exp(-3.0) * 2 * -4.0]])
    loss.sum().backward()
    close(logp.grad, [[-3.0, -2 * math.exp(-3.0)]])


def test_surrogates_refuse_dual_clip_and_unknown_names():
    x = torch.zeros(1, 1, dtype=torch.float64)
    for name in ("gspo", "cispo", "sapo", "gpg", "geo_mean", "clip_cov", "kl_cov"):
        with pytest.raises(UsageError, match="clip_ratio_c"):
            surrogate(name)(x, x, x[0], P(0.2, 0.2, 3.0))
    with pytest.raises(UsageError, match="policy_loss"):
        surrogate("vanilla")


# ----------------------------------------------------------------------------------------------- importance weights


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_importance_weights_match_naive_loop(level, mode):
    logp, old, _, mask = random_batch(3, B=6, T=5)
    beh = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.3
    floor, cap = 0.8, 1.25
    w, stats = importance_weights(old, beh, cap, mask, level=level, mode=mode, floor=floor)
    want, cut, rejected = naive_importance(old.tolist(), beh.tolist(), mask.tolist(), level, mode, floor, cap)
    close(w, want)
    n, rows = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    assert int(stats["policy/is_clipped_fraction"][0]) == sum(map(sum, cut))
    assert int(stats["policy/is_masked_fraction"][0]) == sum(map(sum, rejected))
    assert int(stats["policy/is_clipped_seq_fraction"][0]) == sum(any(r) for r in cut)
    assert int(stats["policy/is_masked_seq_fraction"][0]) == sum(any(r) for r in rejected)
    assert int(stats["policy/is_masked_fraction"][1]) == n and int(stats["policy/is_masked_seq_fraction"][1]) == rows
    assert sum(map(sum, cut)) + sum(map(sum, rejected)) > 0  # the thresholds bite
    assert float(stats["policy/is_weight"][0]) == pytest.approx(sum(map(sum, want)), rel=1e-12)
    same, _ = importance_weights(old, old, cap, mask, level=level, mode=mode, floor=floor)
    assert torch.equal(same, mask.double())  # an uncorrected row: weight exactly 1


def test_importance_hand_values_of_trl_and_openrlhf():
    """old - engine per token [0.5, 0.5, -0.1] on one row. TRL token_truncate (clip_max 1.5): [1.5, 1.5, e^-0.1];
    token_mask (clip_max 1.5): [0, 0, e^-0.1]; sequence_truncate: e^0.9 = 2.46 -> 2 (cap 2) on every token;
    sequence_mask: e^0.9 > 2 -> 0; OpenRLHF icepop [0.95, 1.5]: e^-0.1 = 0.905 < 0.95 -> 0 too;
    verl geometric (mean 0.3): e^0.3 = 1.35 kept under cap 2."""
    old, beh, m = t64([[0.5, 0.5, -0.1]]), torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool)
    e = math.exp(-0.1)
    close(importance_weights(old, beh, 1.5, m)[0], [[1.5, 1.5, e]])
    close(importance_weights(old, beh, 1.5, m, mode="mask")[0], [[0.0, 0.0, e]])
    close(importance_weights(old, beh, 2.0, m, level="sequence")[0], [[2.0] * 3])
    close(importance_weights(old, beh, 2.0, m, level="sequence", mode="mask")[0], [[0.0] * 3])
    close(importance_weights(old, beh, 1.5, m, mode="mask", floor=0.95)[0], [[0.0] * 3])
    close(importance_weights(old, beh, 2.0, m, level="geometric", mode="mask")[0], [[math.exp(0.3)] * 3])


def test_rl_loss_weights_each_surrogate_and_default_settings_are_todays():
    logp, old, adv, mask = random_batch(7, spread=0.3)
    beh = old + 0.2
    ent = torch.rand(logp.shape, dtype=torch.float64)
    for name, fn in (("ppo", ppo_clip), ("gspo", gspo), ("cispo", cispo)):
        s = LossSettings(policy_loss=name, clip_low=0.2, clip_high=0.28, importance_level="geometric",
                         importance_mode="mask", importance_cap=1.5)
        got, stats = rl_loss(LossInputs(logp=logp, old_logp=old, advantages=adv, mask=mask, entropy=ent,
                                        behavior_logp=beh), s)
        plain, _ = fn(logp, old, adv, P(0.2, 0.28), mask=mask)
        w, _ = importance_weights(old, beh, 1.5, mask, level="geometric", mode="mask")
        close(got, (plain * w).tolist())
        assert "policy/dual_clip_fraction" not in stats and "policy/is_masked_seq_fraction" in stats
    default = rl_loss(LossInputs(logp=logp, old_logp=old, advantages=adv, mask=mask, entropy=ent), LossSettings())[0]
    assert torch.equal(default, ppo_clip(logp, old, adv, mask=mask)[0])


# ----------------------------------------------------------------------------------------------- aggregation, KL


def test_seq_mean_token_sum_norm_is_trls_dr_grpo_and_exact_over_micro_batches():
    """TRL dr_grpo: sum(loss * mask) / (rows x max_completion_length). Rows [1, 2, 3] and [4] with L = 8:
    (6 + 4) / (2 x 8) = 0.625; split into two micro-batches with the global denominators, the shares add up to it."""
    x = t64([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True], [True, False, False]])
    d = Denominators(tokens=4.0, seqs=2.0, norm_tokens=8.0)
    assert float(aggregate(x, m, "seq-mean-token-sum-norm", d)) == 0.625
    parts = sum(float(aggregate(x[i:i + 1], m[i:i + 1], "seq-mean-token-sum-norm", d)) for i in range(2))
    assert parts == pytest.approx(0.625, rel=1e-15)
    assert float(aggregate(x, m, "seq-mean-token-sum", d)) == 8.0 * 0.625  # differs by the constant alone


@pytest.mark.parametrize("kind", ["abs", "k1+", "k3+"])
def test_new_kl_estimators_values_and_straight_through_gradients(kind):
    gen = torch.Generator().manual_seed(2)
    logp = (torch.randn(3, 4, generator=gen, dtype=torch.float64) - 1).requires_grad_()
    ref = logp.detach() + torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.7
    kl = kl_penalty(logp, ref, kind)
    d = (ref - logp.detach()).tolist()
    value = {"abs": lambda x: abs(x), "k1+": lambda x: -x, "k3+": lambda x: min(math.exp(x) - x - 1, 10.0)}[kind]
    close(kl, [[value(x) for x in row] for row in d])
    kl.sum().backward()
    # abs: sign(logp - ref); the "+" estimators: k2's gradient, logp - ref (verl: the value of k1/k3, k2's gradient)
    grad = [[(1.0 if -x > 0 else -1.0) if kind == "abs" else -x for x in row] for row in d]
    close(logp.grad, grad)
    with pytest.raises(UsageError, match="kl kind"):
        kl_penalty(logp, ref, "k2+")


# ----------------------------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7, 1e-3])
def test_all_equal_groups_get_exactly_zero(value):
    rewards = t64([value] * 3 + [value] * 4 + [0.0, 1.0])
    groups = torch.tensor([0] * 3 + [1] * 4 + [2, 2])
    for adv in (grpo_advantages(rewards, groups), grpo_advantages(rewards, groups, "batch"),
                grpo_advantages(rewards, groups, eps=1e-4), dr_grpo_advantages(rewards, groups),
                rloo_advantages(rewards, groups), reinforce_pp_baseline_advantages(rewards, groups)):
        assert adv[:7].eq(0).all(), adv
        assert adv[7:].abs().min() > 0
    assert sum([0.1] * 3) / 3 != 0.1  # why: sum / count misses the common value by an ulp (weak test otherwise)


def test_std_eps_matches_trls_epsilon():
    """TRL: (r - mean) / (std + 1e-4). Group [0, 1]: std 0.7071, A = +-0.5 / 0.7072068."""
    adv = grpo_advantages(t64([0.0, 1.0]), torch.tensor([0, 0]), eps=1e-4)
    close(adv, [-0.5 / (math.sqrt(0.5) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4)])


def test_reinforce_pp_baseline_token_whitening_matches_naive_loop_and_verl_hand_values():
    """verl/OpenRLHF: the group-centred reward broadcast over each response's tokens, whitened over all tokens.
    Hand values: one group [1, 0] with lengths [1, 3]: centred [0.5, -0.5], tokens [0.5, -0.5, -0.5, -0.5],
    mean -0.25, unbiased var 0.25 -> [1.5, -0.5] (the per-sample whitening would give [0.707, -0.707])."""
    got = reinforce_pp_baseline_advantages(t64([1.0, 0.0]), torch.tensor([0, 0]), whiten="token",
                                           lengths=torch.tensor([1, 3]))
    close(got, [0.75 / math.sqrt(0.25 + 1e-8), -0.25 / math.sqrt(0.25 + 1e-8)])
    rng = random.Random(5)
    rewards = [rng.choice([0.0, 0.5, 1.0]) for _ in range(12)]
    groups = [i // 4 for i in range(12)]
    lengths = [rng.randint(0, 6) for _ in range(12)]
    tokens, centred = [], []
    for i, r in enumerate(rewards):
        same = [rewards[j] for j in range(12) if groups[j] == groups[i]]
        centred.append(r - sum(same) / len(same))
        tokens += [centred[-1]] * lengths[i]
    mu = sum(tokens) / len(tokens)
    var = sum((x - mu) ** 2 for x in tokens) / (len(tokens) - 1)
    want = [(c - mu) / math.sqrt(var + 1e-8) if n else 0.0 for c, n in zip(centred, lengths)]
    got = reinforce_pp_baseline_advantages(t64(rewards), torch.tensor(groups), whiten="token",
                                           lengths=torch.tensor(lengths))
    close(got, want)
    valid = torch.tensor([True] * 8 + [False] * 4)
    sub = compute_advantages("reinforce_pp_baseline", t64(rewards), torch.tensor(groups), valid,
                             lengths=torch.tensor(lengths), whiten="token")
    alone = reinforce_pp_baseline_advantages(t64(rewards[:8]), torch.tensor(groups[:8]), whiten="token",
                                             lengths=torch.tensor(lengths[:8]))
    close(sub[:8], alone.tolist())
    assert sub[8:].eq(0).all()


# ----------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, field", [
    (["algo.clip_low=10"], "algo.clip_low: got 10; with policy_loss=ppo"),
    (["algo.policy_loss=gspo", "algo.clip_low=1.5"], "algo.clip_low: got 1.5; with policy_loss=gspo"),
    (["algo.clip_ratio_c=1"], "algo.clip_ratio_c: got 1; 0 (off) or a bound > 1"),
    (["algo.policy_loss=cispo", "algo.clip_ratio_c=3"], "algo.clip_ratio_c: got 3; dual clip is ppo's"),
    (["algo.importance_floor=1.5"], "algo.importance_floor: got 1.5"),
    (["algo.loss_norm_tokens=0"], "algo.loss_norm_tokens: got 0"),
])
def test_config_refuses_settings_of_another_loss_mode_in_one_line(overrides, field):
    with pytest.raises(UsageError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(f"config: {field}") and "\n" not in str(err.value)


def test_config_accepts_the_peers_recipes():
    cfg = load_config(None, ["algo.policy_loss=cispo", "algo.clip_low=10", "algo.clip_high=4"])
    assert (cfg.algo.policy_loss, cfg.algo.clip_low) == ("cispo", 10.0)
    cfg = load_config(None, ["algo.clip_ratio_c=3", "algo.loss_aggregation=seq-mean-token-sum-norm",
                             "algo.kl_estimator=k3+", "algo.importance_level=geometric", "algo.importance_mode=mask",
                             "algo.importance_floor=0.5", "algo.reinforce_pp_baseline_whiten=token"])
    assert cfg.algo.clip_ratio_c == 3.0 and cfg.algo.loss_norm_tokens is None


# ----------------------------------------------------------------------------------------------- 1 vs 3 processes

# The layout-sensitive pieces in one run: GSPO's sequence ratio (clipped in the second mini-batch), sequence-level
# masked importance weights on every sample, the constant-length aggregation, length-weighted whitening over the
# whole step and the straight-through KL. The fp32 engine's log-probs differ from the trainer's by rounding (~1e-7)
# only, so every weight is within 1e-5 of 1 and none is rejected: the run holds the sequence-level path on any
# layout; which weights are cut or rejected is the unit tests' (above). Token-local surrogates (cispo, dual clip) reduce through the same global denominators as PPO-clip,
# whose 1 vs 3 exactness tests/test_train.py holds.
SEQUENCE_LEVEL = ["algo.advantage=reinforce_pp_baseline", "algo.reinforce_pp_baseline_whiten=token",
                  "algo.policy_loss=gspo", "algo.clip_low=0.003", "algo.clip_high=0.004",
                  "algo.loss_aggregation=seq-mean-token-sum-norm", "algo.importance_correction=all",
                  "algo.importance_level=sequence", "algo.importance_mode=mask", "algo.importance_cap=1.5",
                  "algo.importance_floor=0.5", "algo.kl_coef=0.05", "algo.kl_estimator=k3+", "rewards.isolate=false",
                  "train.steps=1"]  # one step, two optimizer steps (the assets' minibatches_per_step=2)


@pytest.mark.slow
def test_sequence_level_objectives_are_the_same_on_one_and_three_processes(assets, tmp_path):
    from e2e import same_on_n_processes

    m1, m3 = same_on_n_processes(assets, tmp_path, SEQUENCE_LEVEL, 3, ("policy/clip_fraction", "policy/is_weight",
                                                                      "policy/is_masked_seq_fraction", "kl",
                                                                      "policy/loss"))
    assert any(r["policy/clip_fraction"] > 0 for r in m1), "GSPO's clip never bit: weak test"
    assert all(abs(r["policy/is_weight"] - 1) < 1e-5 and r["policy/is_masked_seq_fraction"] == 0 for r in m1 + m3)
