"""Mixed devices, the pure part: measured speeds smoothed into capacity weights, weights limited by per-rank token
caps (evenrl.core.capacity), and the schedule under per-rank caps (evenrl.core.schedule), each against a naive
computation."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from evenrl.core.capacity import MIN_RATIO, SMOOTHING, cap_limited_weights, smoothed_weights
from evenrl.core.schedule import ScheduleError, make_schedule


def naive_smoothing(prev, tokens, seconds):
    """One rank at a time, straight from the definition in the module docstring."""
    rates = {}
    for r, (t, s) in enumerate(zip(tokens, seconds)):
        if t > 0 and s > 0:
            rates[r] = t / s
    if not rates:
        return prev
    fastest = max(rates.values())
    new = []
    for r in range(len(tokens)):
        if r not in rates:
            new.append(1.0 if prev is None else prev[r])
        elif prev is None:
            new.append(rates[r] / fastest)
        else:
            new.append((1 - SMOOTHING) * prev[r] + SMOOTHING * rates[r] / fastest)
    top = max(new)
    return [round(max(x, MIN_RATIO * top) / top, 2 - 1 - math.floor(math.log10(max(x, MIN_RATIO * top) / top)))
            for x in new]


@pytest.mark.parametrize("seed", range(20))
def test_smoothed_weights_against_a_naive_loop(seed):
    rng = random.Random(seed)
    k = rng.randint(1, 6)
    prev = None if seed % 3 == 0 else [rng.uniform(0.05, 1.0) for _ in range(k)]
    tokens = [rng.choice([0, rng.randint(1, 5000)]) for _ in range(k)]
    seconds = [rng.choice([0.0, rng.uniform(0.01, 3.0)]) for _ in range(k)]
    got, want = smoothed_weights(prev, tokens, seconds), naive_smoothing(prev, tokens, seconds)
    assert (got is None) == (want is None)
    if got is not None:
        assert got == pytest.approx(want, rel=1e-12)
        assert max(got) == 1.0 or got == prev  # rescaled to the fastest, or kept when nothing was measured


def test_smoothing_converges_to_the_speeds_and_keeps_a_floor():
    w = None
    for _ in range(12):  # rank 1 does the same work 4x slower, rank 2 is 100x slower
        w = smoothed_weights(w, [400, 400, 400], [1.0, 4.0, 100.0])
    assert w == [1.0, 0.25, MIN_RATIO]
    assert smoothed_weights(w, [0, 0, 0], [0.0, 0.0, 0.0]) == w  # nothing measured: kept
    assert smoothed_weights(None, [0, 0], [1.0, 1.0]) is None


def naive_shares(total, w, caps):
    """The water-filling of the module docstring by bisection on the fill level."""
    largest = max(caps)
    steps = max([1] + [math.ceil(total * x / sum(w) / largest - 1e-9) for x in w]
                + [math.ceil(total / sum(caps) - 1e-9)])
    limits = [steps * c for c in caps]
    lo, hi = 0.0, total / min(w) + 1
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(min(mid * x, lim) for x, lim in zip(w, limits)) < total:
            lo = mid
        else:
            hi = mid
    return [min(hi * x, lim) for x, lim in zip(w, limits)], steps


@pytest.mark.parametrize("seed", range(30))
def test_cap_limited_weights_against_bisection(seed):
    rng = random.Random(seed)
    k = rng.randint(2, 6)
    w = [rng.choice([1.0, 0.5, 2.0, rng.uniform(0.1, 3)]) for _ in range(k)]
    caps = [rng.choice([64, 256, 1024]) for _ in range(k)]
    total = rng.randint(1, 20_000)
    got = cap_limited_weights(total, w, caps)
    if min(caps) == max(caps):
        assert got == w
        return
    want, steps = naive_shares(total, w, caps)
    if got == w:  # no cap binds: the speed shares already fit
        assert all(total * x / sum(w) <= steps * c + 1e-6 for x, c in zip(w, caps))
    else:
        assert sum(got) == pytest.approx(total)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6 * total)
        assert all(g <= steps * c + 1e-6 for g, c in zip(got, caps))


def test_a_small_cap_adds_no_micro_steps():
    """Equal speeds, caps 4 : 4 : 1 samples: the small rank takes 1 sample per micro-step in the same 3 micro-steps
    the others need for 4, instead of the 10 it would need for an equal share."""
    s = make_schedule([20] * 27, world=3, token_cap=[80, 80, 20])
    assert s.micro_steps() == [3]
    assert [[m.tokens for m in micros] for micros in s.minibatches[0].per_rank] == [[80, 80, 80], [80, 80, 80],
                                                                                     [20, 20, 20]]
    assert s.token_cap == (80, 80, 20) and s.cap(2) == 20 and s.over_cap() == [] and s.oversize == ()
    equal = make_schedule([20] * 27, world=3, token_cap=20)
    assert equal.micro_steps() == [9]  # what every rank would run with the small device's cap


@pytest.mark.parametrize("seed", range(40))
def test_per_rank_caps_hold_and_every_row_runs_once(seed):
    rng = random.Random(seed)
    world = rng.randint(2, 5)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(0, 80))]
    caps = [rng.choice([60, 120, 240, 480]) for _ in range(world)]
    weights = None if seed % 2 else [rng.choice([1.0, 0.3, 2.0]) for _ in range(world)]
    s = make_schedule(lengths, world=world, minibatches=rng.randint(1, 3), token_cap=caps, weights=weights,
                      groups=[i // 3 for i in range(len(lengths))])
    assert s.over_cap() == []  # every row fits the smallest cap here
    for mb in s.minibatches:
        assert len({len(micros) for micros in mb.per_rank}) == 1
        for r, micros in enumerate(mb.per_rank):
            assert all(m.tokens <= caps[r] for m in micros)
    rows = sorted(r for mb in s.minibatches for micros in mb.per_rank for m in micros for r in m.rows)
    assert rows == list(range(len(lengths)))


def test_equal_per_rank_caps_are_the_single_cap():
    lengths = [random.Random(1).randint(1, 50) for _ in range(40)]
    one = make_schedule(lengths, world=3, minibatches=2, token_cap=100)
    listed = make_schedule(lengths, world=3, minibatches=2, token_cap=[100, 100, 100])
    assert one == listed and listed.token_cap == 100


def test_per_rank_caps_are_checked():
    with pytest.raises(ScheduleError, match=r"token_cap: got \[8, 8\]; need one token cap per rank \(3\)"):
        make_schedule([4, 4], world=3, token_cap=[8, 8])
    with pytest.raises(ScheduleError, match=r"token_cap\[1\]: got 0"):
        make_schedule([4, 4], world=2, token_cap=[8, 0])


def test_a_row_longer_than_a_small_cap_runs_alone_over_it():
    s = make_schedule([50, 10, 10, 10], world=2, token_cap=[100, 20])
    assert s.oversize == ()  # fits the largest cap
    for b, r, step in s.over_cap():
        assert r == 1 and s.minibatches[b].per_rank[r][step].rows and len(s.minibatches[b].per_rank[r][step].rows) == 1


def test_brute_force_small_instances_meet_the_step_count():
    """Every equal-length instance up to 9 rows on 2-3 ranks with caps of 1-3 rows: the schedule needs no more
    micro-steps than max(the largest cap's count, the caps' total)."""
    for n, caps in itertools.product(range(1, 10), [(1, 3), (2, 3), (3, 1, 1), (2, 2, 1)]):
        s = make_schedule([10] * n, world=len(caps), token_cap=[10 * c for c in caps])
        bound = max(math.ceil(n / len(caps) / max(caps)), math.ceil(n / sum(caps)))
        assert s.micro_steps()[0] <= bound, (n, caps, s.micro_steps())
