"""Every advantage and loss function (evenrl.core.advantages, evenrl.core.losses) against a plain-Python loop (float64, math module) on random inputs."""

import math
import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenrl.core import advantages, losses
from evenrl.core.losses import LossInputs, LossSettings, entropy_from_logits, kl_penalty, rl_loss, token_logprobs
from evenrl.core.surrogates import PolicyParams, ppo_clip
from evenrl.core.advantages import compute_advantages, grpo_advantages, reinforce_pp_baseline_advantages, rloo_advantages
from evenrl.errors import UsageError

EPS = 1e-6


def policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.2, clip_ratio_c=0.0, **kw):
    return ppo_clip(logp, old, adv, PolicyParams(clip_low, clip_high, clip_ratio_c), **kw)


# ----------------------------------------------------------------------------------------------- naive references


def members(groups):
    out = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def sample_std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def naive_grpo(rewards, groups, std_scale="group", eps=EPS):
    by_group = members(groups)
    out = []
    for i, r in enumerate(rewards):
        mates = [rewards[j] for j in by_group[groups[i]]]
        centred = r - sum(mates) / len(mates)
        if std_scale == "group":
            centred /= sample_std(mates) + eps
        elif std_scale == "batch":
            centred /= sample_std(rewards) + eps
        out.append(centred)
    return out


def naive_rloo(rewards, groups):
    by_group = members(groups)
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in by_group[groups[i]] if j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def naive_rpp(rewards, groups, eps=EPS):
    centred = naive_grpo(rewards, groups, "none")
    std = sample_std(centred)
    return [c / (std + eps) for c in centred]


def naive_policy_loss(logp, old, adv, clip_low, clip_high):
    loss, low, high = [], 0, 0
    for b in range(len(logp)):
        row = []
        for t in range(len(logp[b])):
            a = adv[b]
            ratio = math.exp(logp[b][t] - old[b][t])
            value = -min(ratio * a, min(max(ratio, 1 - clip_low), 1 + clip_high) * a)
            row.append(value)
            low += a < 0 and ratio < 1 - clip_low
            high += a > 0 and ratio > 1 + clip_high
        loss.append(row)
    return loss, low, high


def naive_kl(lp, ref, kind):
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * (lp - ref) ** 2
    d = max(-20.0, min(20.0, ref - lp))
    return min(10.0, math.exp(d) - d - 1)


def naive_log_softmax(row):
    m = max(row)
    z = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - z for x in row]


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def close(actual, expected, tol=1e-9):
    assert torch.allclose(actual.double(), t64(expected), atol=tol, rtol=tol), (actual, expected)


# ----------------------------------------------------------------------------------------------- advantages

# Rewards from a small set of values so that ties and all-equal groups are common; group ids are sparse integers
# drawn from a few values so groups are non-contiguous and often of size 1.
batches = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from([0.0, 0.1, 1.0, -2.5, 3.75]) | st.floats(-10, 10), min_size=n, max_size=n),
        st.lists(st.sampled_from([3, 17, 40, 1000, -5]), min_size=n, max_size=n),
    )
)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_advantages_match_naive_loops(batch):
    rewards, groups = batch
    r, g = t64(rewards), torch.tensor(groups)
    for scale in ("group", "batch", "none"):
        close(grpo_advantages(r, g, std_scale=scale), naive_grpo(rewards, groups, scale), tol=1e-6)
    close(rloo_advantages(r, g), naive_rloo(rewards, groups), tol=1e-9)
    close(reinforce_pp_baseline_advantages(r, g), naive_rpp(rewards, groups), tol=1e-6)
    expected = {"grpo": naive_grpo(rewards, groups), "dr_grpo": naive_grpo(rewards, groups, "none"),
                "rloo": naive_rloo(rewards, groups), "reinforce_pp_baseline": naive_rpp(rewards, groups)}
    for name, values in expected.items():
        close(compute_advantages(name, r, g), values, tol=1e-6)


@settings(max_examples=60, deadline=None)
@given(batches.flatmap(lambda b: st.tuples(st.just(b), st.lists(st.booleans(), min_size=len(b[0]),
                                                                  max_size=len(b[0])))))
def test_advantages_over_valid_samples_match_naive_loops_without_the_others(batch_and_valid):
    """valid=: the advantages of the valid samples are those of a step in which the others were never sampled
    (naive loops over the kept samples only); the others get 0."""
    (rewards, groups), valid = batch_and_valid
    r, g, v = t64(rewards), torch.tensor(groups), torch.tensor(valid, dtype=torch.bool)
    kept_r = [x for x, ok in zip(rewards, valid) if ok]
    kept_g = [x for x, ok in zip(groups, valid) if ok]

    def spread(values):  # back to all samples, 0 where not valid
        it = iter(values)
        return [next(it) if ok else 0.0 for ok in valid]

    expected = {"grpo": naive_grpo(kept_r, kept_g), "dr_grpo": naive_grpo(kept_r, kept_g, "none"),
                "rloo": naive_rloo(kept_r, kept_g), "reinforce_pp_baseline": naive_rpp(kept_r, kept_g)}
    for name, values in expected.items():
        close(compute_advantages(name, r, g, valid=v), spread(values), tol=1e-6)
    for scale in ("group", "batch", "none"):
        close(compute_advantages("grpo", r, g, valid=v, std_scale=scale), spread(naive_grpo(kept_r, kept_g, scale)),
              tol=1e-6)
    everyone = torch.ones(len(rewards), dtype=torch.bool)
    assert torch.equal(compute_advantages("grpo", r, g, valid=everyone), compute_advantages("grpo", r, g))


def test_advantages_degenerate_groups_are_finite_and_zero():
    g = torch.tensor([7, 7, 7, 2])  # one all-equal group, one singleton
    r = torch.tensor([1.0, 1.0, 1.0, 5.0])
    for name in advantages.ADVANTAGES:
        adv = compute_advantages(name, r, g)
        assert torch.isfinite(adv).all() and torch.equal(adv, torch.zeros(4)), name
    single = compute_advantages("grpo", torch.tensor([3.0]), torch.tensor([0]), std_scale="batch")
    assert single.tolist() == [0.0]


def test_advantages_known_values_and_dtype():
    # Group {0, 2} = [1, 0] and group {1, 3} = [2, 4]: interleaved ids.
    r = torch.tensor([1.0, 2.0, 0.0, 4.0], dtype=torch.bfloat16)
    g = torch.tensor([9, 4, 9, 4])
    adv = grpo_advantages(r, g, std_scale="none")
    assert adv.dtype == torch.float32 and adv.tolist() == [0.5, -1.0, -0.5, 1.0]
    assert rloo_advantages(r, g).tolist() == [1.0, -2.0, -1.0, 2.0]
    std = math.sqrt(0.5)  # unbiased std of [1, 0]
    assert grpo_advantages(r, g)[0].item() == pytest.approx(0.5 / (std + EPS))


def test_advantage_errors():
    r, g = torch.zeros(3), torch.zeros(3, dtype=torch.long)
    with pytest.raises(UsageError, match="advantage: got 'ppo'.*dr_grpo, grpo, reinforce_pp_baseline, rloo"):
        compute_advantages("ppo", r, g)
    with pytest.raises(UsageError, match="std_scale"):
        grpo_advantages(r, g, std_scale="global")
    with pytest.raises(ValueError):
        grpo_advantages(r, g.float())
    with pytest.raises(ValueError):
        grpo_advantages(r, g[:2])
    with pytest.raises(ValueError, match="valid"):
        compute_advantages("grpo", r, g, valid=torch.ones(3))
    with pytest.raises(ValueError, match="valid"):
        compute_advantages("grpo", r, g, valid=torch.ones(2, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------- policy loss


def test_policy_loss_matches_naive_loop():
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 9
    logp = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5 - 2
    old = logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) > 0.3
    loss, stats = policy_loss(logp, old, adv, 0.2, 0.28, mask=mask)
    expected, low, high = naive_policy_loss(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28)
    close(loss, (t64(expected) * mask).tolist())
    unmasked, _ = policy_loss(logp, old, adv, 0.2, 0.28)
    close(unmasked, expected)
    _, low_all, high_all = naive_policy_loss(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28)
    stats_all = policy_loss(logp, old, adv, 0.2, 0.28)[1]
    assert stats_all["clipped_low_tokens"] == low_all and stats_all["clipped_high_tokens"] == high_all
    assert stats_all["clipped_tokens"] == low_all + high_all > 0
    assert stats["tokens"] == mask.sum()
    assert stats["approx_kl_sum"].item() == pytest.approx(((old - logp) * mask).sum().item())
    assert all(not v.requires_grad for v in stats.values())


def grad_at(ratio, adv, clip_low=0.2, clip_high=0.28, **kw):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
                              clip_low, clip_high, **kw)
    loss.sum().backward()
    return logp.grad.item(), stats


def test_policy_loss_gradient_signs_and_asymmetric_clip():
    # Inside the trust region the gradient raises logp of positive-advantage tokens and lowers negative ones.
    g, stats = grad_at(1.0, 1.0)
    assert g == pytest.approx(-1.0) and stats["clipped_tokens"] == 0
    g, _ = grad_at(1.0, -1.0)
    assert g == pytest.approx(1.0)
    # clip_high = 0.28: ratio 1.25 would be clipped with a symmetric 0.2 but is not here.
    g, stats = grad_at(1.25, 1.0)
    assert g == pytest.approx(-1.25) and stats["clipped_high_tokens"] == 0
    g, stats = grad_at(1.281, 1.0)
    assert g == 0.0 and stats["clipped_high_tokens"] == 1 and stats["clipped_tokens"] == 1
    # clip_low = 0.2 for negative advantages.
    g, stats = grad_at(0.801, -1.0)
    assert g == pytest.approx(0.801) and stats["clipped_low_tokens"] == 0
    g, stats = grad_at(0.799, -1.0)
    assert g == 0.0 and stats["clipped_low_tokens"] == 1
    # PPO clips only the side that helps: a low ratio with A > 0 and a high ratio with A < 0 keep their gradient.
    assert grad_at(0.5, 1.0)[0] == pytest.approx(-0.5)
    assert grad_at(1.5, -1.0)[0] == pytest.approx(1.5)


def test_policy_loss_token_level_advantages_and_extreme_ratio():
    logp = torch.tensor([[0.0, -100.0]])
    old = torch.tensor([[-100.0, 0.0]])  # log-ratios +-100 would overflow exp without the clamp
    loss, _ = policy_loss(logp, old, torch.tensor([[1.0, -1.0]]))
    assert torch.isfinite(loss).all()
    assert loss.tolist()[0] == pytest.approx([-1.2, 0.8])  # both on the clipped branch


# ----------------------------------------------------------------------------------------------- KL


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_matches_naive(kind):
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(4, 7, generator=gen, dtype=torch.float64) * 3
    ref = torch.randn(4, 7, generator=gen, dtype=torch.float64) * 3
    lp[0, 0], ref[0, 0] = -40.0, 0.0  # exercises both k3 clamps
    expected = [[naive_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    close(kl_penalty(lp, ref, kind), expected)
    close(kl_penalty(lp, lp, kind), [[0.0] * 7] * 4)


def test_k3_is_nonnegative_and_clamped():
    d = torch.linspace(-30, 30, 601, dtype=torch.float64)
    k3 = kl_penalty(torch.zeros_like(d), d, "k3")
    assert (k3 >= 0).all() and k3.max() == 10.0
    with pytest.raises(UsageError, match="kl kind"):
        kl_penalty(d, d, "k4")


@pytest.mark.parametrize("kl_coef, entropy_coef, with_ref", [(0.0, 0.0, False), (0.1, 0.0, True), (0.0, 0.01, True),
                                                              (0.05, 0.02, True)])
def test_rl_loss_matches_naive_loop(kl_coef, entropy_coef, with_ref):
    """The whole micro-batch objective token by token: clip surrogate + kl_coef x k3 - entropy_coef x entropy, and
    each statistic as (sum over response tokens, count)."""
    gen = torch.Generator().manual_seed(3)
    B, T = 5, 6
    logp = (torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    ref = logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    ent = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) > 0.3
    inp = LossInputs(logp=logp, old_logp=old, advantages=adv, mask=mask, entropy=ent,
                     ref_logp=ref if with_ref else None)
    loss, stats = rl_loss(inp, LossSettings(clip_low=0.2, clip_high=0.28, kl_coef=kl_coef, kl_estimator="k3",
                                            entropy_coef=entropy_coef))
    surrogate, _, _ = naive_policy_loss(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28)
    want, sums = [], {"policy/loss": 0.0, "kl": 0.0, "entropy": 0.0, "policy/approx_kl": 0.0}
    clipped = 0
    for b in range(B):
        row = []
        for t_ in range(T):
            lp, o, r, e, a = logp[b, t_].item(), old[b, t_].item(), ref[b, t_].item(), ent[b, t_].item(), adv[b].item()
            kl = naive_kl(lp, r, "k3")
            value = surrogate[b][t_] + (kl_coef * kl if with_ref else 0.0) - entropy_coef * e
            row.append(value if mask[b, t_] else 0.0)
            if mask[b, t_]:
                ratio = math.exp(lp - o)
                clipped += ratio * a > min(max(ratio, 0.8), 1.28) * a
                sums["policy/loss"] += surrogate[b][t_]
                sums["kl"] += kl
                sums["entropy"] += e
                sums["policy/approx_kl"] += o - lp
        want.append(row)
    close(loss * mask, want)
    n = int(mask.sum())
    assert set(stats) == {"policy/loss", "policy/clip_fraction", "policy/approx_kl", "entropy"} | ({"kl"} if with_ref
                                                                                                    else set())
    for name, (s, c) in stats.items():
        assert int(c) == n and not s.requires_grad
        expected = clipped if name == "policy/clip_fraction" else sums[name]
        assert float(s) == pytest.approx(expected, rel=1e-9, abs=1e-9), name
    loss.sum().backward()  # the surrogate and KL terms reach logp; entropy is an input here, not a function of logp
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("cap", [1.0, 1.5, 1000.0])
def test_importance_weighted_loss_matches_naive_loop(cap):
    """Off-policy samples: each token's clip surrogate times w = min(exp(old - behavior), cap), w a constant (no
    gradient through it), KL and entropy terms unweighted; the gradient is that of the naive sum; statistics
    policy/is_weight (mean w) and policy/is_clipped_fraction (w cut to the cap) over response tokens."""
    gen = torch.Generator().manual_seed(11)
    B, T = 4, 5
    logp = (torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5 - 2).requires_grad_()
    old = logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.2
    behavior = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.6
    ref = logp.detach() + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    ent = torch.rand(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) > 0.25
    settings = LossSettings(clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01, importance_cap=cap)
    loss, stats = rl_loss(LossInputs(logp=logp, old_logp=old, advantages=adv, mask=mask, entropy=ent, ref_logp=ref,
                                     behavior_logp=behavior), settings)
    surrogate, _, _ = naive_policy_loss(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28)
    want, weights, cut = [], [], 0
    for b in range(B):
        row = []
        for t_ in range(T):
            raw = math.exp(old[b, t_].item() - behavior[b, t_].item())
            w = min(raw, cap)
            value = (w * surrogate[b][t_] + 0.1 * naive_kl(logp[b, t_].item(), ref[b, t_].item(), "k3")
                     - 0.01 * ent[b, t_].item())
            row.append(value if mask[b, t_] else 0.0)
            if mask[b, t_]:
                weights.append(w)
                cut += raw > cap
        want.append(row)
    close(loss * mask, want)
    n = int(mask.sum())
    assert float(stats["policy/is_weight"][0]) / n == pytest.approx(sum(weights) / n, rel=1e-12)
    assert int(stats["policy/is_clipped_fraction"][0]) == cut and int(stats["policy/is_clipped_fraction"][1]) == n
    if cap == 1.0:
        assert 0 < cut < n  # the cap bites on some tokens and not on others
    # the gradient: w is a constant, so d/dlogp of the weighted loss is w x d(surrogate) + the KL term's
    (loss * mask).sum().backward()
    eps, grad = 1e-6, torch.zeros(B, T, dtype=torch.float64)
    base = logp.detach()
    for b in range(B):
        for t_ in range(T):
            if not mask[b, t_]:
                continue
            hi, lo = base.clone(), base.clone()
            hi[b, t_] += eps
            lo[b, t_] -= eps
            f = [sum(v for v in (rl_loss(LossInputs(logp=x, old_logp=old, advantages=adv, mask=mask, entropy=ent,
                                                    ref_logp=ref, behavior_logp=behavior), settings)[0] * mask
                                 ).reshape(-1).tolist()) for x in (hi, lo)]
            grad[b, t_] = (f[0] - f[1]) / (2 * eps)
    close(logp.grad, grad.tolist(), tol=1e-5)


# ----------------------------------------------------------------------------------------------- vocabulary functions


@pytest.fixture(params=[False, True], ids=["one_chunk", "many_chunks"])
def chunking(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 25)  # 2 positions per chunk at V = 11


def test_token_logprobs_matches_naive(chunking):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    for temperature in (1.0, 0.7):
        expected = [[naive_log_softmax([x / temperature for x in logits[b, t].tolist()])[targets[b, t]]
                     for t in range(5)] for b in range(3)]
        out = token_logprobs(logits, targets, temperature)
        assert out.dtype == torch.float32 and out.shape == (3, 5)
        close(out, expected, tol=1e-5)


def test_token_logprobs_gradient_and_bf16(chunking):
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 6, 11, generator=gen) * 3).requires_grad_()
    targets = torch.randint(0, 11, (2, 6), generator=gen)
    token_logprobs(logits, targets, 0.9).sum().backward()
    ref = logits.detach().clone().requires_grad_()
    torch.log_softmax(ref / 0.9, -1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    assert torch.allclose(logits.grad, ref.grad, atol=1e-6)
    low = logits.detach().bfloat16()
    expected = torch.log_softmax(low.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(low, targets), expected, atol=1e-6)


def saved_vocab_bytes(fn, logits):
    """Bytes of vocabulary-sized tensors autograd keeps for backward that are not the logits' own storage."""
    saved = {}  # storage pointer -> bytes; one tensor saved by two ops counts once

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if t.dim() >= 1 and t.shape[-1] == logits.shape[-1] and ptr != logits.untyped_storage().data_ptr():
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


def test_token_logprobs_keeps_at_most_one_float32_copy():
    B, T, V = 2, 8, 64
    targets = torch.zeros(B, T, dtype=torch.long)
    fp32 = torch.randn(B, T, V, requires_grad=True)
    assert saved_vocab_bytes(lambda: token_logprobs(fp32, targets), fp32) == 0
    assert saved_vocab_bytes(lambda: token_logprobs(fp32, targets, 0.5), fp32) <= B * T * V * 4
    bf16 = torch.randn(B, T, V).bfloat16().requires_grad_()
    assert saved_vocab_bytes(lambda: token_logprobs(bf16, targets), bf16) <= B * T * V * 4
    # The textbook log_softmax(...).gather keeps a full float32 log-prob tensor even for float32 logits.
    assert saved_vocab_bytes(lambda: torch.log_softmax(fp32, -1).gather(-1, targets[..., None]), fp32) >= B * T * V * 4


def test_entropy_matches_naive(chunking):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64) * 3
    for temperature in (1.0, 2.0):
        logp = [[naive_log_softmax([x / temperature for x in row]) for row in per_b] for per_b in logits.tolist()]
        expected = [[-sum(math.exp(lp) * lp for lp in row) for row in per_b] for per_b in logp]
        close(entropy_from_logits(logits, temperature), expected, tol=1e-5)


def test_entropy_extremes():
    V = 50
    assert entropy_from_logits(torch.zeros(1, 1, V)).item() == pytest.approx(math.log(V), rel=1e-6)
    peaked = torch.zeros(1, 2, V)
    peaked[0, :, 3] = 1e4  # exp would overflow without max-subtraction; entropy is 0
    masked = torch.full((1, 1, 4), float("-inf"))
    masked[0, 0, :2] = 0.0  # two live tokens, two masked: entropy log 2
    assert entropy_from_logits(peaked).abs().max() < 1e-6
    assert entropy_from_logits(masked).item() == pytest.approx(math.log(2))
    assert torch.isfinite(entropy_from_logits(torch.randn(2, 3, V).bfloat16() * 100)).all()


def test_vocab_functions_reject_bad_temperature():
    with pytest.raises(UsageError, match="temperature"):
        token_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), 0.0)
    with pytest.raises(UsageError, match="temperature"):
        entropy_from_logits(torch.zeros(1, 1, 3), -1.0)


def test_random_seeded_policy_loss_many_shapes():
    rng = random.Random(6)
    for _ in range(20):
        B, T = rng.randint(1, 4), rng.randint(1, 6)
        logp = [[rng.uniform(-3, 0) for _ in range(T)] for _ in range(B)]
        old = [[x + rng.uniform(-0.5, 0.5) for x in row] for row in logp]
        adv = [rng.choice([0.0, rng.uniform(-2, 2)]) for _ in range(B)]
        cl, ch = rng.uniform(0.05, 0.3), rng.uniform(0.05, 0.4)
        loss, _ = policy_loss(t64(logp), t64(old), t64(adv), cl, ch)
        close(loss, naive_policy_loss(logp, old, adv, cl, ch)[0])
