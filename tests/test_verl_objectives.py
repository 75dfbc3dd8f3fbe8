"""verl's remaining objectives in evenrl (issue 43): SAPO, GPG, GMPO (geo_mean), Clip-Cov, KL-Cov, bypass mode, the
rejection criteria k1/k2/k3 per token and per sequence (sum, mean, max) chained, batch-normalised importance
weights and verl's seq-mean-token-sum-norm (token-sum-norm). Each pure function is checked against a plain-Python
loop on random inputs AND against hand-worked values or a plain re-statement of verl's own definition (read from
volcengine/verl@b178a3c: trainer/ppo/core_algos.py, trainer/ppo/rollout_corr_helper.py, workers/actor/dp_actor.py);
the `--from verl` translation against verl's own threshold rule on boundary values; the whole-mini-batch
selection against one computed from two pieces (two ranks); docs/algorithms.md's aggregation table against verl's
agg_loss; and, slow, one run on 1 and 2 processes."""

import argparse
import math
import re
from pathlib import Path

import pytest
import torch

from evenrl.config.load import load_config
from evenrl.core import selection
from evenrl.core.aggregation import Denominators, aggregate
from evenrl.core.importance import importance_weights, normalized, rejection_keep, weight_sums
from evenrl.core.losses import LossInputs, LossSettings, rl_loss
from evenrl.core.surrogates import PolicyParams as P, clip_cov, geo_mean, gpg, kl_cov, ppo_clip, sapo
from evenrl.errors import UsageError
from evenrl.planner.peers import translate
from test_objectives import close, random_batch, t64

ROOT = Path(__file__).resolve().parents[1]


def per_token_loop(logp, old, adv, mask, f):
    """[[f(lp, old, a) or 0 outside the mask]] and the gradient d f / d lp by a central difference."""
    vals, grads = [], []
    for b, row in enumerate(logp.tolist()):
        a = adv[b].item()
        vals.append([f(lp, old[b, t].item(), a) if mask[b, t] else 0.0 for t, lp in enumerate(row)])
        grads.append([(f(lp + 1e-6, old[b, t].item(), a) - f(lp - 1e-6, old[b, t].item(), a)) / 2e-6
                      if mask[b, t] else 0.0 for t, lp in enumerate(row)])
    return vals, grads


def ns(**kw):
    base = dict(nnodes=None, nproc_per_node=None, rollout_devices=None, device=None, device_memory_gib=None,
                capacity_weights=None, json=False, fit=False, peer_version=None, nodes=None)
    return argparse.Namespace(**{**base, **kw})


def verl(settings: dict, **layout):
    """translate() of a verl config given as dotted keys."""
    nested: dict = {}
    for key, value in settings.items():
        node = nested
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return translate("verl", nested, ns(**({"nnodes": 1, "nproc_per_node": 8} | layout)))


# ----------------------------------------------------------------------------------------------- SAPO, GPG


def test_sapo_matches_naive_loop_and_verls_gate():
    logp, old, adv, mask = random_batch(0, spread=0.8)
    tp, tn = 1.0, 1.05

    def f(lp, o, a):
        tau = tp if a > 0 else tn
        return -(1 / (1 + math.exp(-tau * (math.exp(lp - o) - 1)))) * 4 / tau * a

    loss, stats = sapo(logp, old, adv, P(tau_pos=tp, tau_neg=tn), mask=mask)
    want, grads = per_token_loop(logp, old, adv, mask, f)
    close(loss, want)
    loss.sum().backward()
    close(logp.grad, grads, tol=1e-7)
    assert int(stats["clipped_tokens"]) == 0 and int(stats["tokens"]) == int(mask.sum())


def test_sapo_hand_values():
    """verl gate f(r) = sigmoid(tau (r - 1)) 4 / tau: at r = 1 it is 2 / tau and its slope is 1, so the loss is
    -2 A / tau and the gradient -A (PPO's at r = 1); A = -1 with tau_neg 1.05: 4 / 1.05 / 2 = 1.9047619."""
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    loss, _ = sapo(logp, torch.zeros(1, 3, dtype=torch.float64), t64([[1.0, -1.0, 0.0]]), P(tau_pos=1.0, tau_neg=1.05))
    close(loss, [[-2.0, 2 / 1.05, 0.0]])
    loss.sum().backward()
    close(logp.grad, [[-1.0, 1.0, 0.0]])
    far = sapo(t64([[1.0]]), t64([[0.0]]), t64([1.0]), P(tau_pos=1.0))[0]  # r = e: -4 sigmoid(e - 1)
    close(far, [[-4 / (1 + math.exp(-(math.e - 1)))]])


def test_gpg_is_minus_advantage_times_logprob():
    logp, old, adv, mask = random_batch(1)
    loss, stats = gpg(logp, old, adv, mask=mask)
    want, grads = per_token_loop(logp, old, adv, mask, lambda lp, o, a: -a * lp)
    close(loss, want)
    loss.sum().backward()
    close(logp.grad, grads, tol=1e-7)
    assert int(stats["clipped_tokens"]) == 0


# ----------------------------------------------------------------------------------------------- GMPO


def naive_gmpo_rows(logp, old, adv, mask, lo, hi):
    """verl compute_policy_loss_geo_mean, row by row: -mean(A) exp(mean_t c_t) (0 for a row without tokens)."""
    out = []
    for b, row in enumerate(logp):
        ts = [t for t in range(len(row)) if mask[b][t]]
        a = adv[b]
        s = (a > 0) - (a < 0)
        c = [s * min(s * (row[t] - old[b][t]), s * min(max(row[t] - old[b][t], -lo), hi)) for t in ts]
        out.append(-a * math.exp(sum(c) / len(ts)) if ts else None)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geo_mean_is_verls_mean_over_sequences_value_and_gradient(seed):
    logp, old, adv, mask = random_batch(seed, spread=0.5)
    lo, hi = 0.4, 0.4
    rows = naive_gmpo_rows(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), lo, hi)
    loss, stats = geo_mean(logp, old, adv, P(lo, hi), mask=mask)
    for b, value in enumerate(rows):  # every token of a row carries the row's loss
        close(loss[b][mask[b]], [value] * int(mask[b].sum()) if value is not None else [])
    denom = Denominators(tokens=float(mask.sum()), seqs=float((mask.sum(-1) > 0).sum()))
    total = aggregate(loss, mask, "seq-mean-token-mean", denom)
    kept = [v for v in rows if v is not None]
    assert total.item() == pytest.approx(sum(kept) / len(kept), rel=1e-12)
    total.backward()
    # the gradient of verl's form written directly: per row -A exp(sum(c m) / n), averaged over rows
    y = logp.detach().clone().requires_grad_()
    d = y - old
    sign = torch.sign(adv)[:, None]
    c = sign * torch.minimum(sign * d, sign * d.clamp(-lo, hi))
    n = mask.sum(-1)
    has = n > 0
    per_row = -adv * torch.exp((c * mask).sum(-1) / n.clamp(min=1))
    per_row[has].mean().backward()
    close(logp.grad, y.grad.tolist(), tol=1e-12)
    assert int(stats["clipped_tokens"]) > 0 and logp.grad.abs().sum() > 0


def test_geo_mean_hand_values():
    """Row log-ratios [0.5, -0.1], clips 0.4 / 0.4. A = +1: c = [min(0.5, 0.4), -0.1] = [0.4, -0.1], mean 0.15,
    loss -e^0.15; A = -1: c = [max(0.5, 0.4), -0.1] = [0.5, -0.1] (a ratio already past the bound on the side that
    hurts is kept), mean 0.2, loss +e^0.2."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    loss, stats = geo_mean(t64([[0.5, -0.1], [0.5, -0.1]]), old, t64([1.0, -1.0]), P(0.4, 0.4))
    close(loss, [[-math.exp(0.15)] * 2, [math.exp(0.2)] * 2])
    assert (int(stats["clipped_high_tokens"]), int(stats["clipped_low_tokens"])) == (1, 1)


# ----------------------------------------------------------------------------------------------- Clip-Cov, KL-Cov


def verl_kl_cov_one_micro_batch(logp, old, adv, mask, ratio, coef):
    """verl compute_policy_loss_kl_cov on one micro-batch, token by token: cov over the valid tokens with the
    current log-probs; the top max(1, int(n ratio)) get -A r + coef |logp - old|, the rest -A r."""
    cells = [(b, t) for b in range(len(logp)) for t in range(len(logp[b])) if mask[b][t]]
    ma = sum(adv[b] for b, _ in cells) / len(cells)
    ml = sum(logp[b][t] for b, t in cells) / len(cells)
    cov = {(b, t): (adv[b] - ma) * (logp[b][t] - ml) for b, t in cells}
    k = max(1, int(len(cells) * ratio))
    top = set(sorted(cells, key=lambda bt: -cov[bt])[:k])
    out = [[0.0] * len(r) for r in logp]
    for b, t in cells:
        r = math.exp(logp[b][t] - old[b][t])
        out[b][t] = -adv[b] * r + (coef * abs(logp[b][t] - old[b][t]) if (b, t) in top else 0.0)
    return out, top


def whole_batch_selection(adv, logp, mask, fraction, pieces=((0, None),)):
    """KL-Cov's selection from pieces of the rows as ranks compute it: moments summed, candidates pooled."""
    totals = sum(selection.moments(adv[a:b], logp[a:b], mask[a:b]) for a, b in pieces)
    k = selection.count(fraction, float(totals[2]))
    covs = [selection.covariance(adv[a:b], logp[a:b], mask[a:b], totals) for a, b in pieces]
    threshold = selection.kth([selection.candidates(c, k) for c in covs], k)
    return torch.cat([mask[a:b] & selection.kl_cov_selected(c, threshold) for (a, b), c in zip(pieces, covs)])


def test_kl_cov_equals_verls_on_one_micro_batch():
    """verl's KL-Cov on one micro-batch that holds the whole mini-batch, its covariance taken on the current
    log-probs, and evenrl's, taken on the step's starting ones, given the same numbers there (at a step's first
    update they are): the same tokens and the same loss (the ratio itself against slightly different old ones)."""
    logp, _, adv, mask = random_batch(4, B=8, T=9)
    old = logp.detach() + 0.0
    near = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 1e-3
    chosen = whole_batch_selection(adv, old, mask, 0.1)
    loss, stats = kl_cov(logp, near, adv, P(kl_cov_coef=0.3), mask=mask, selected=chosen)
    want, top = verl_kl_cov_one_micro_batch(logp.tolist(), near.tolist(), adv.tolist(), mask.tolist(), 0.1, 0.3)
    assert {(b, t) for b, t in chosen.nonzero().tolist()} == top and len(top) == max(1, int(0.1 * mask.sum()))
    close(loss, want)
    assert int(stats["selected_tokens"]) == len(top) and int(stats["clipped_tokens"]) == 0


def test_kl_cov_hand_values():
    """Three one-token rows, A = [2, -1, 0.5], logp [-1, -4, -2]: mean A 0.5, mean logp -7/3, so cov =
    [1.5 x 4/3, -1.5 x -5/3, 0] = [2, 2.5, 0]; k = max(1, int(0.34 x 3)) = 1 picks the second. New log-probs
    [-1, -3.5, -2]: ratios [1, e^0.5, 1], loss -A r, plus 0.1 x |0.5| on the picked token."""
    adv = t64([2.0, -1.0, 0.5])
    logp = t64([[-1.0], [-4.0], [-2.0]])
    m = torch.ones(3, 1, dtype=torch.bool)
    totals = selection.moments(adv, logp, m)
    close(totals, [1.5, -7.0, 3.0])
    cov = selection.covariance(adv, logp, m, totals)  # means 0.5, -7/3
    close(cov, [[1.5 * (4 / 3)], [-1.5 * (-5 / 3)], [0.0]])
    assert whole_batch_selection(adv, logp, m, 0.34).tolist() == [[False], [True], [False]]  # 2.5 > 2 > 0
    loss, _ = kl_cov(t64([[-1.0], [-3.5], [-2.0]]), logp, adv, P(kl_cov_coef=0.1), mask=m,
                     selected=torch.tensor([[False], [True], [False]]))
    close(loss, [[-2.0], [math.exp(0.5) + 0.1 * 0.5], [-0.5]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selection_from_two_ranks_is_the_whole_mini_batch_and_per_rank_is_not(seed):
    """The layout-exactness of the statistic: moments summed and candidates pooled over two pieces of the rows
    (two ranks) select exactly what one piece of all rows does; selecting per piece (verl's per-micro-batch way)
    would not."""
    logp, _, adv, mask = random_batch(seed, B=10, T=8)
    old = logp.detach()
    whole = whole_batch_selection(adv, old, mask, 0.15)
    split = whole_batch_selection(adv, old, mask, 0.15, pieces=((0, 3), (3, None)))
    assert torch.equal(whole, split) and whole.sum() == max(1, int(0.15 * mask.sum()))
    local = torch.cat([whole_batch_selection(adv[a:b], old[a:b], mask[a:b], 0.15) for a, b in ((0, 3), (3, None))])
    assert not torch.equal(local, whole), "per-rank statistics happen to agree: weak test"


def test_clip_cov_drops_the_gradient_of_n_random_eligible_tokens():
    """clip_cov: PPO-clip everywhere; on the n = max(1, int(fraction x tokens)) eligible tokens (low < cov < high)
    with the smallest keys the loss is 0 (verl: corr = 0). Checked against a naive loop: the eligible set, its keys
    sorted, the first n, pooled from two pieces."""
    logp, _, adv, mask = random_batch(6, B=10, T=8, spread=0.0)
    old = logp.detach() + 0.05
    keys = torch.rand(logp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    lo, hi, fraction = -0.2, 0.3, 0.1
    pieces = ((0, 4), (4, None))
    totals = sum(selection.moments(adv[a:b], old[a:b], mask[a:b]) for a, b in pieces)
    n = selection.count(fraction, float(totals[2]))
    cands = []
    for a, b in pieces:
        cov = selection.covariance(adv[a:b], old[a:b], mask[a:b], totals)
        ok = mask[a:b] & selection.clip_cov_eligible(cov, lo, hi)
        cands.append(selection.candidates(torch.where(ok, keys[a:b], float("inf")), n, largest=False))
    threshold = selection.kth(cands, n, largest=False)
    cov = selection.covariance(adv, old, mask, totals)
    chosen = mask & selection.clip_cov_selected(cov, keys, lo, hi, threshold)
    # naive: the eligible tokens by the plain formula, their keys sorted
    cells = [(b, t) for b in range(10) for t in range(8) if mask[b, t]]
    ma = sum(adv[b].item() for b, _ in cells) / len(cells)
    ml = sum(old[b, t].item() for b, t in cells) / len(cells)
    eligible = [bt for bt in cells if lo < (adv[bt[0]].item() - ma) * (old[bt].item() - ml) < hi]
    want = set(sorted(eligible, key=lambda bt: keys[bt].item())[:n])
    assert {tuple(x) for x in chosen.nonzero().tolist()} == want and len(want) == n < len(eligible)
    loss, stats = clip_cov(logp, old, adv, P(0.2, 0.2), mask=mask, selected=chosen)
    plain, _ = ppo_clip(logp, old, adv, P(0.2, 0.2), mask=mask)
    close(loss, torch.where(chosen, 0.0, plain).tolist())
    loss.sum().backward()
    assert logp.grad[chosen].eq(0).all() and int(stats["selected_tokens"]) == n


# ----------------------------------------------------------------------------------------------- rollout correction


def verl_rejection_keep(log_ratio, mask, options: str, spec):
    """verl compute_rollout_rejection_mask with _parse_rollout_rs_thresholds, token by token: log_ratio = log pi_old
    - log pi_rollout; k1 = -log_ratio within [log lower, log upper] (one number u: lower = 1/u); k2, k3 <= upper."""
    opts = list(dict.fromkeys(o.strip() for o in options.split(",")))
    specs = [str(spec)] if isinstance(spec, (int, float)) else [s.strip() for s in spec.split(",")]
    specs = specs * len(opts) if len(specs) == 1 else specs
    B, T = len(log_ratio), len(log_ratio[0])
    keep = [[bool(mask[b][t]) for t in range(T)] for b in range(B)]
    for opt, sp in zip(opts, specs):
        if opt.endswith("k1"):
            lower, upper = (float(x) for x in sp.split("_")) if "_" in sp else (1.0 / float(sp), float(sp))
        else:
            upper = float(sp)
        for b in range(B):
            ts = [t for t in range(T) if mask[b][t]]
            lr = [max(-20.0, min(20.0, log_ratio[b][t])) for t in range(T)]
            stat = {"k1": lambda x: -x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(x) - 1 - x}[opt[-2:]]
            vals = [stat(x) for x in lr]
            if opt.startswith("token"):
                per = {t: vals[t] for t in ts}
            else:
                s = {"seq_sum": sum(vals[t] for t in ts),
                     "seq_mean": sum(vals[t] for t in ts) / (len(ts) + 1e-8),
                     "seq_max": max([vals[t] for t in ts], default=0.0)}[opt.rsplit("_", 1)[0]]
                per = {t: s for t in ts}
            for t, v in per.items():
                ok = math.log(lower) <= v <= math.log(upper) if opt.endswith("k1") else v <= upper
                keep[b][t] = keep[b][t] and ok
    return keep


def translated_criteria(rs: str, threshold):
    t, cfg = verl({"algorithm.rollout_correction.rollout_rs": rs,
                   "algorithm.rollout_correction.rollout_rs_threshold": threshold})
    assert cfg.algo.importance_correction == "all" and cfg.algo.importance_mode == "none"  # no rollout_is: no weight
    return tuple((r.criterion, r.low, r.high) for r in cfg.algo.rejection)


def test_the_issues_thresholds_are_verls_bands():
    """rollout_rs_threshold=2.0 with token_k1 is [1/2, 2] (not floor 0); "0.8_1.5" bounds pi_rollout / pi_old, so
    weights 1/1.5 <= w <= 1/0.8 are kept: w = 0.7 kept and w = 1.3 rejected by verl, and so by evenrl."""
    assert translated_criteria("token_k1", 2.0) == (("token_k1", 0.5, 2.0),)
    assert translated_criteria("token_k1", "0.8_1.5") == (("token_k1", 1 / 1.5, 1 / 0.8),)
    for spec, weights in ((2.0, [0.4, 0.5, 1.0, 2.0, 2.1]), ("0.8_1.5", [0.6, 0.7, 1.0, 1.2, 1.3])):
        d = [[math.log(w) for w in weights]]
        m = [[True] * len(weights)]
        keep, _ = rejection_keep(t64(d), torch.tensor(m), translated_criteria("token_k1", spec))
        assert keep.tolist() == verl_rejection_keep(d, m, "token_k1", spec)
    assert verl_rejection_keep([[math.log(0.7), math.log(1.3)]], [[True, True]], "token_k1", "0.8_1.5") == [[True, False]]


@pytest.mark.parametrize("rs, spec", [
    ("token_k1", 2.0), ("token_k1", "0.8_1.5"), ("token_k1", "0.5_2"), ("seq_sum_k1", "0.6_1.6"),
    ("seq_mean_k1", 1.25), ("token_k2", 0.02), ("token_k3", 0.01), ("seq_sum_k2", 0.25), ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.1), ("seq_max_k3", 0.1), ("token_k1,seq_max_k2", "0.6_1.6,0.1"),
    ("seq_mean_k1,token_k3,seq_sum_k2", "1.3,0.05,0.3"),
])
def test_rejection_criteria_keep_what_verls_rule_keeps(rs, spec):
    """Random log-ratios plus the bounds themselves shifted by +-1e-9 (the boundary values), translated from verl's
    own spelling and applied by evenrl, against verl's rule re-stated token by token."""
    gen = torch.Generator().manual_seed(len(rs) + int(10 * float(str(spec).split(",")[0].split("_")[-1])))
    d = torch.randn(12, 6, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.rand(12, 6, generator=gen) > 0.2
    mask[0] = False
    crit = translated_criteria(rs, spec)
    edges = [math.log(x) for name, low, high in crit if name == "token_k1" for x in (low, high)]
    for i, e in enumerate(edges):  # token_k1's bounds: just inside and just outside each
        d[2 + i, :3] = t64([e - 1e-9, e + 1e-9, e])
        mask[2 + i, :3] = True
    keep, stats = rejection_keep(d, mask, crit)
    want = verl_rejection_keep(d.tolist(), mask.tolist(), rs, spec)
    exact = {(2 + i, 2) for i in range(len(edges))}  # exactly on a bound: log(1/u) and -log(u) may differ by an ulp
    diff = {(b, t) for b in range(12) for t in range(6) if keep[b, t].item() != want[b][t]}
    assert diff <= exact, diff
    n_rej = sum(mask[b, t].item() and not want[b][t] for b in range(12) for t in range(6))
    assert 0 < n_rej < int(mask.sum()), "the criteria reject nothing or everything: weak test"
    assert int(stats["policy/rejected_fraction"][0]) == int((mask & ~keep).sum())


def test_rejection_keeps_uncorrected_rows_and_refuses_bands_without_1():
    mask = torch.ones(2, 3, dtype=torch.bool)
    keep, _ = rejection_keep(torch.zeros(2, 3, dtype=torch.float64), mask,
                             [("token_k1", 0.9, 1.1), ("seq_max_k3", 0.0, 1e-9), ("seq_sum_k2", 0.0, 1e-9)])
    assert keep.all()  # weight exactly 1: every criterion passes
    t, cfg = verl({"algorithm.rollout_correction.rollout_rs": "token_k1",
                   "algorithm.rollout_correction.rollout_rs_threshold": "1.1_2"})
    assert cfg.algo.rejection == [] and any("rejects exactly on-policy tokens" in n for n in t.notes)
    t, _ = verl({"algorithm.rollout_correction.rollout_rs": "token_k2"})
    assert any(c.message.startswith("rollout_rs_threshold must be explicitly provided") for c in t.checks)
    with pytest.raises(UsageError, match="one positive number"):
        verl({"algorithm.rollout_correction.rollout_rs": "token_k2",
              "algorithm.rollout_correction.rollout_rs_threshold": "0.1_0.2"})


def test_batch_normalised_weights_are_verls():
    """verl rollout_is_batch_normalize: token level divides by the mean over tokens of the truncated weights;
    sequence level by the mean over sequences. Token weights [[2, 1], [0.5, -]] (cap 2): mean 3.5 / 3; the same
    rows at sequence level: [e^(log 2 + 0) = 2 (capped), 0.5]: mean 1.25."""
    target = torch.log(t64([[2.0, 1.0], [0.5, 1.0]]))
    beh, m = torch.zeros(2, 2, dtype=torch.float64), torch.tensor([[True, True], [True, False]])
    w, _ = importance_weights(target, beh, 2.0, m)
    s = weight_sums(w, m, "token")
    close(s, [3.5, 3.0])
    close(normalized(w, float(s[0] / s[1])), [[2 / (3.5 / 3), 1 / (3.5 / 3)], [0.5 / (3.5 / 3), 0.0]])
    ws, _ = importance_weights(target, beh, 2.0, m, level="sequence")
    close(weight_sums(ws, m, "sequence"), [2.5, 2.0])
    assert normalized(w, 1e-9) is w  # verl leaves them when the mean is ~0


def test_off_mode_weighs_nothing_and_bypass_reinforce_is_verls():
    """importance_mode=none: weight 1, only rejection. old_policy=engine with gpg and token weights capped at 2 is
    verl's bypass mode with loss_type=reinforce: -A log pi x min(pi / pi_rollout, 2), rejected tokens 0."""
    logp, _, adv, mask = random_batch(8, spread=0.0)
    engine = logp.detach() + torch.randn(logp.shape, generator=torch.Generator().manual_seed(1),
                                         dtype=torch.float64) * 0.5
    ent = torch.zeros_like(engine)
    s = LossSettings(policy_loss="gpg", old_policy="engine", importance_cap=2.0,
                     rejection=(("token_k1", 0.5, 2.0),))
    inp = LossInputs(logp=logp, old_logp=engine, advantages=adv, mask=mask, entropy=ent, behavior_logp=engine)
    loss, stats = rl_loss(inp, s)
    want = []
    for b in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            lr = logp[b, t].item() - engine[b, t].item()
            ok = mask[b, t] and math.log(0.5) <= lr <= math.log(2.0)
            row.append(-adv[b].item() * logp[b, t].item() * min(math.exp(lr), 2.0) if ok else 0.0)
        want.append(row)
    close(loss, want)
    assert 0 < stats["policy/rejected_fraction"][0] < mask.sum()
    off, _ = rl_loss(inp, LossSettings(policy_loss="gpg", old_policy="engine", importance_mode="none"))
    close(off, gpg(logp, engine, adv, mask=mask)[0].tolist())


# ----------------------------------------------------------------------------------------------- aggregation


def verl_agg_loss(x, m, mode, C):
    """verl agg_loss on one micro-batch, dp 1, no global batch info (core_algos.py)."""
    rows = [sum(v for v, k in zip(r, mr) if k) for r, mr in zip(x, m)]
    counts = [sum(mr) for mr in m]
    live = [i for i, c in enumerate(counts) if c > 0]
    if mode == "token-mean":
        return sum(rows) / sum(counts)
    if mode == "seq-mean-token-sum":
        return sum(rows[i] for i in live) / len(live)
    if mode == "seq-mean-token-mean":
        return sum(rows[i] / (counts[i] + 1e-8) for i in live) / len(live)
    assert mode == "seq-mean-token-sum-norm"
    return sum(rows) / C


def test_verls_seq_mean_token_sum_norm_is_token_sum_norm():
    """The issue's numbers: 4 rows whose token sums are 1, C = 8. evenrl's seq-mean-token-sum-norm (Dr. GRPO) 0.125;
    verl's agg_loss 0.5 = token-sum-norm; verl's default actor with 2 micro-batches of 2 rows scales each by 1/2:
    0.25 = token-sum-norm with C x 2, what `--from verl` writes."""
    x = t64([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5], [1.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    d = Denominators(tokens=float(m.sum()), seqs=4.0, norm_tokens=8.0)
    assert float(aggregate(x, m, "seq-mean-token-sum-norm", d)) == 0.125
    assert float(aggregate(x, m, "token-sum-norm", d)) == 0.5 == verl_agg_loss(x.tolist(), m.tolist(),
                                                                                "seq-mean-token-sum-norm", 8)
    legacy = sum(verl_agg_loss(x[i:i + 2].tolist(), m[i:i + 2].tolist(), "seq-mean-token-sum-norm", 8) / 2
                 for i in (0, 2))
    assert legacy == 0.25 == float(aggregate(x, m, "token-sum-norm", Denominators(6.0, 4.0, 16.0)))
    # exact over micro-batches and ranks: the shares add up
    assert sum(float(aggregate(x[i:i + 1], m[i:i + 1], "token-sum-norm", d)) for i in range(4)) == 0.5


def test_verl_translation_folds_the_micro_batches_into_the_constant():
    """verl's seq-mean-token-sum-norm, default actor, 4 prompts x 1 a mini-batch on 1 GPU in micro-batches of 2,
    response length 8: loss_norm_tokens = 8 x 2 (the issue's 0.25 above); the newer engine on 8 GPUs: 8 x 8;
    loss_scale_factor replaces the width; GSPO keeps verl's forced seq-mean-token-mean."""
    base = {"data.train_batch_size": 4, "data.max_response_length": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm"}
    t, cfg = verl(base, nproc_per_node=1)
    assert (cfg.algo.loss_aggregation, cfg.algo.loss_norm_tokens) == ("token-sum-norm", 16)
    assert any("8 x 2" in n for n in t.notes)
    _, cfg = verl({**base, "data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
                   "trainer.use_legacy_worker_impl": "disable"}, nproc_per_node=8)
    assert cfg.algo.loss_norm_tokens == 64
    _, cfg = verl({**base, "actor_rollout_ref.actor.loss_scale_factor": 100}, nproc_per_node=1)
    assert cfg.algo.loss_norm_tokens == 200
    t, cfg = verl({**base, "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"}, nproc_per_node=1)
    assert (cfg.algo.policy_loss, cfg.algo.loss_aggregation, cfg.algo.loss_norm_tokens) == \
        ("gspo", "seq-mean-token-mean", None)
    row = next(k for k in t.keys if k["key"] == "actor_rollout_ref.actor.loss_agg_mode")
    assert row["status"] == "not_applicable" and "follows" in row["why"]


def test_docs_aggregation_table_matches_verls_agg_loss():
    """Each row of docs/algorithms.md's aggregation table that names a verl mode computes what verl's agg_loss
    computes for it (one micro-batch, one rank, C = loss_norm_tokens), on random losses and masks."""
    text = (ROOT / "docs" / "algorithms.md").read_text()
    section = text[text.index("## Loss aggregation"):]
    rows = re.findall(r"^\| `([a-z-]+)` \|[^|]*\| (`[a-z-]+`|–) \|", section, re.M)
    pairs = {ours: theirs.strip("`") for ours, theirs in rows if theirs != "–"}
    assert pairs.get("token-sum-norm") == "seq-mean-token-sum-norm" and "seq-mean-token-sum-norm" not in pairs
    assert set(pairs) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm"}
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    m = torch.rand(5, 6, generator=gen) > 0.4
    m[:, -1] = True
    d = Denominators(tokens=float(m.sum()), seqs=5.0, norm_tokens=6.0)
    for ours, theirs in pairs.items():
        assert float(aggregate(x, m, ours, d)) == pytest.approx(verl_agg_loss(x.tolist(), m.tolist(), theirs, 6.0),
                                                                rel=1e-7), ours


# ----------------------------------------------------------------------------------------------- verl's keys, config


def test_verl_loss_modes_and_their_keys_translate():
    a = "actor_rollout_ref.actor."
    _, cfg = verl({a + "policy_loss.loss_mode": "kl_cov", a + "policy_loss.kl_cov_ratio": 0.01,
                   a + "policy_loss.ppo_kl_coef": 0.5})
    assert (cfg.algo.policy_loss, cfg.algo.kl_cov_fraction, cfg.algo.kl_cov_coef, cfg.algo.clip_ratio_c) == \
        ("kl_cov", 0.01, 0.5, 0.0)
    _, cfg = verl({a + "policy_loss.loss_mode": "clip_cov", a + "policy_loss.clip_cov_lb": 2,
                   a + "policy_loss.clip_cov_ub": 8})
    assert (cfg.algo.policy_loss, cfg.algo.clip_cov_low, cfg.algo.clip_cov_high) == ("clip_cov", 2.0, 8.0)
    _, cfg = verl({a + "policy_loss.loss_mode": "geo_mean", a + "clip_ratio_low": 0.4, a + "clip_ratio_high": 0.4})
    assert (cfg.algo.policy_loss, cfg.algo.loss_aggregation, cfg.algo.clip_low) == \
        ("geo_mean", "seq-mean-token-mean", 0.4)
    c = "algorithm.rollout_correction."
    t, cfg = verl({c + "bypass_mode": True, c + "loss_type": "reinforce", c + "rollout_is": "sequence",
                   c + "rollout_is_threshold": 5.0, c + "rollout_rs": "seq_mean_k3", c + "rollout_rs_threshold": 0.01})
    assert (cfg.algo.old_policy, cfg.algo.policy_loss, cfg.algo.importance_level, cfg.algo.importance_cap,
            cfg.algo.importance_mode) == ("engine", "gpg", "sequence", 5.0, "truncate")
    assert [(r.criterion, r.high) for r in cfg.algo.rejection] == [("seq_mean_k3", 0.01)]
    _, cfg = verl({c + "rollout_is": "token", c + "rollout_is_batch_normalize": True})
    assert (cfg.algo.importance_normalize, cfg.algo.old_policy, cfg.algo.importance_mode) == (True, "trainer",
                                                                                              "truncate")


@pytest.mark.parametrize("overrides, field", [
    (["algo.rejection=[{criterion: token_k1, low: 0.5, high: 0.9}]"], "algo.rejection.0"),
    (["algo.rejection=[{criterion: seq_max_k2, low: 0.1, high: 1}]"], "algo.rejection.0"),
    (["algo.rejection=[{criterion: seq_max_k1, high: 2}]"], "algo.rejection.0.criterion"),
    (["algo.old_policy=engine", "algo.importance_normalize=true"], "algo.importance_normalize"),
    (["algo.policy_loss=sapo", "algo.clip_ratio_c=3"], "algo.clip_ratio_c"),
    (["algo.sapo_tau_pos=0"], "algo.sapo_tau_pos"),
])
def test_config_refuses_what_the_new_objectives_cannot_run_in_one_line(overrides, field):
    with pytest.raises(UsageError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(f"config: {field}: got") and "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------- 1 vs 2 processes

# KL-Cov picks its tokens by a covariance over the whole mini-batch and the weights are divided by their mean over
# the whole step: both pooled over the ranks before the update (evenrl.train.pooled). A k of 20% of the tokens makes
# the per-rank choice differ from the whole one (the unit test above). The penalty |logp - old_logp| has no gradient
# at a step's first update (logp = old_logp there, as in verl), so it bites in the second mini-batch (the assets'
# minibatches_per_step=2): with the sums left per rank this test fails on the weights, not only on the metrics.
# Chained rejection rides along (the fp32 engine's log-probs are the trainer's to ~1e-7: it rejects nothing here).
POOLED = ["algo.policy_loss=kl_cov", "algo.kl_cov_fraction=0.2", "algo.kl_cov_coef=1.0",
          "algo.importance_correction=all", "algo.importance_normalize=true",
          "algo.rejection=[{criterion: token_k1, low: 0.5, high: 2}, {criterion: seq_max_k3, high: 1}]",
          "rewards.isolate=false", "train.steps=2"]


@pytest.mark.slow
def test_whole_mini_batch_statistics_are_the_same_on_one_and_two_processes(assets, tmp_path):
    from e2e import same_on_n_processes

    m1, _ = same_on_n_processes(assets, tmp_path, POOLED, 2, ("policy/selected_fraction", "policy/is_batch_mean",
                                                             "policy/rejected_fraction", "policy/loss"))
    assert len(m1) == 2 and all(r["policy/selected_fraction"] > 0.15 for r in m1)

def test_pooled_objectives_get_pi_old_first_and_skip_no_sample():
    """A whole-mini-batch statistic needs pi_old before the first update: with one mini-batch and one epoch the step
    computes it in a pass of its own (verl always does); with old_policy=engine the engine's are pi_old and no pass
    runs. Samples with advantage 0 are then not skipped (KL-Cov penalises them; both count them)."""
    from evenrl.core.batch import Batch
    from evenrl.core.masking import zero_gradient_rows
    from evenrl.train.step import needs_old_logprobs

    everyone = Batch({"advantage": torch.tensor([0.0, 1.0]), "reward_failed": torch.tensor([False, False]),
                      "finished": torch.tensor([True, True])})
    plain = load_config(None, ["algo.minibatches_per_step=1"])
    assert not needs_old_logprobs(plain) and zero_gradient_rows(plain, everyone) == [True, False]
    for more in (["algo.policy_loss=kl_cov"], ["algo.policy_loss=clip_cov"],
                 ["algo.importance_correction=all", "algo.importance_normalize=true"]):
        cfg = load_config(None, ["algo.minibatches_per_step=1", *more])
        assert needs_old_logprobs(cfg) and zero_gradient_rows(cfg, everyone) is None, more
    assert not needs_old_logprobs(load_config(None, ["algo.policy_loss=kl_cov", "algo.old_policy=engine",
                                                     "algo.minibatches_per_step=2"]))


def test_trl_and_easyr1_sapo_are_the_same_gate():
    """TRL's loss_type=sapo and EasyR1's are verl's gate (sigmoid(tau (r - 1)) 4 / tau, read in their code); TRL
    reduces it like loss_type=grpo (seq-mean-token-mean), EasyR1 by its loss_avg_mode."""
    _, cfg = translate("trl", {"loss_type": "sapo", "sapo_temperature_neg": 1.2}, ns(nproc_per_node=2))
    assert (cfg.algo.policy_loss, cfg.algo.loss_aggregation, cfg.algo.sapo_tau_neg) == \
        ("sapo", "seq-mean-token-mean", 1.2)
    _, cfg = translate("easyr1", {"worker": {"actor": {"loss_type": "sapo", "tau_positive": 0.9}}},
                       ns(nnodes=1, nproc_per_node=8))
    assert (cfg.algo.policy_loss, cfg.algo.sapo_tau_pos, cfg.algo.clip_ratio_c) == ("sapo", 0.9, 0.0)
