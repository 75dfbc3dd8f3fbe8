"""Tests for evenrl.schedule: the acceptance criteria of "any batch on any number of ranks"."""

import json
import random
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenrl.errors import UsageError
from evenrl.core.partition import sample_cost
from evenrl.core.schedule import MicroBatch, ScheduleError, StepSchedule, make_schedule, split_minibatches

EPS = 1e-9


def _lengths(rng: random.Random, n: int) -> list[int]:
    kind = rng.randrange(3)
    if kind == 0:
        return [int(rng.lognormvariate(5.0, 1.0)) for _ in range(n)]
    if kind == 1:
        return [rng.randint(0, 3000) for _ in range(n)]
    return [rng.choice([1, 7, 64, 300]) for _ in range(n)]


def _groups(rng: random.Random, n: int, size: int | None, contiguous: bool):
    if size is None:
        return None
    ids = [i // size for i in range(n)]
    if not contiguous:
        rng.shuffle(ids)
    return ids


def _check(s: StepSchedule, lengths, *, world, minibatches, token_cap, groups, weights, min_rows, quadratic_cost=0.0):
    n = len(lengths)
    m = min_rows
    w = [1.0] * world if weights is None else [float(x) for x in weights]
    assert s.world == world and s.token_cap == token_cap and s.min_rows == m
    # Mini-batch membership is the world-free split.
    assert [mb.rows for mb in s.minibatches] == split_minibatches(n, minibatches, groups)
    seen = []
    for mb in s.minibatches:
        assert len(mb.per_rank) == world
        steps = {len(micros) for micros in mb.per_rank}
        assert len(steps) == 1 and steps.pop() >= 1, "ranks disagree on the number of micro-steps"
        mb_rows = []
        for micros in mb.per_rank:
            filler_seen = False
            real = [x for x in micros if x.rows]
            for micro in micros:
                if not micro.rows:
                    assert micro == MicroBatch((), 0)
                    filler_seen = True
                    continue
                assert not filler_seen, "fillers must come after the real micro-batches"
                assert list(micro.rows) == sorted(set(micro.rows))
                longest = max(lengths[i] for i in micro.rows)
                assert micro.tokens == len(micro.rows) * longest
                assert len(micro.rows) >= m, "micro-batch smaller than min_rows"
                if token_cap is not None and micro.tokens > token_cap:
                    if m == 1:
                        assert len(micro.rows) == 1 and micro.rows[0] in s.oversize
                    else:
                        assert len(micro.rows) <= 2 * m - 1
                        assert m * longest > token_cap or micro.tokens * m <= (2 * m - 1) * token_cap
                mb_rows.extend(micro.rows)
            if filler_seen:
                # A rank pads only after it could not split any further.
                assert all(len(x.rows) < 2 * m for x in real)
        assert sorted(mb_rows) == list(mb.rows)
        seen.extend(mb_rows)

        # Balance: active ranks = the floor(rows/m) highest-weight ones; the greedy bound over them, plus at most
        # m-1 rows handed to a rank that had fewer than m.
        cost = {i: sample_cost(lengths[i], 1.0, quadratic_cost) for i in mb.rows}
        active = sorted(range(world), key=lambda r: (-w[r], r))[: min(world, len(mb.rows) // m)]
        wa = sum(w[r] for r in active)
        pmax = max(cost.values())
        bound = (sum(cost.values()) + (len(active) - 1) * pmax) / wa + (m - 1) * pmax / min(w[r] for r in active)
        for r, micros in enumerate(mb.per_rank):
            load = sum(cost[i] for x in micros for i in x.rows)
            if r not in active:
                assert load == 0 and all(not x.rows for x in micros)
            assert load / w[r] <= bound * (1 + EPS) + EPS
    assert sorted(seen) == list(range(n)), "every row exactly once"
    expected_oversize = () if token_cap is None else tuple(i for i in range(n) if lengths[i] > token_cap)
    assert s.oversize == expected_oversize
    over = [
        (b, r, k)
        for b, mb in enumerate(s.minibatches)
        for r, micros in enumerate(mb.per_rank)
        for k, x in enumerate(micros)
        if token_cap is not None and x.tokens > token_cap
    ]
    assert s.over_cap() == over
    for r in range(world):
        rows = s.rank_rows(r)
        assert len(rows) == len(set(rows))
        assert rows == [i for mb in s.minibatches for x in mb.per_rank[r] for i in x.rows]
    assert len(s.micro_steps()) == len(s.minibatches)
    assert sum(s.rank_loads()) == sum(x.tokens for mb in s.minibatches for micros in mb.per_rank for x in micros)
    json.dumps(s.to_dict())


@settings(deadline=None, max_examples=120)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 600),
    world=st.integers(1, 9),
    other_world=st.integers(1, 9),
    minibatches=st.integers(1, 5),
    token_cap=st.none() | st.integers(1, 2000),
    group_size=st.none() | st.integers(1, 8),
    contiguous=st.booleans(),
    weighted=st.booleans(),
    min_rows=st.sampled_from([1, 2]),
)
def test_schedule_properties(
    seed, n, world, other_world, minibatches, token_cap, group_size, contiguous, weighted, min_rows
):
    rng = random.Random(seed)
    lengths = _lengths(rng, n)
    groups = _groups(rng, n, group_size, contiguous)
    weights = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(world)] if weighted else None
    kw = dict(minibatches=minibatches, token_cap=token_cap, groups=groups, min_rows=min_rows)
    split = split_minibatches(n, minibatches, groups)
    if any(len(rows) < min_rows for rows in split):
        # The only impossible case: a mini-batch with fewer rows than min_rows.
        with pytest.raises(ScheduleError, match="min_rows"):
            make_schedule(lengths, world=world, weights=weights, **kw)
        return
    s = make_schedule(lengths, world=world, weights=weights, **kw)
    _check(s, lengths, world=world, weights=weights, **kw)
    assert make_schedule(lengths, world=world, weights=weights, **kw) == s, "not deterministic"
    other = make_schedule(lengths, world=other_world, **kw)
    assert [mb.rows for mb in other.minibatches] == [mb.rows for mb in s.minibatches], "membership depends on world"


@settings(deadline=None, max_examples=150)
@given(n=st.integers(0, 60), minibatches=st.integers(1, 12), group_size=st.none() | st.integers(1, 9))
def test_split_minibatches(n, minibatches, group_size):
    groups = None if group_size is None else [i // group_size for i in range(n)]
    split = split_minibatches(n, minibatches, groups)
    assert [i for rows in split for i in rows] == list(range(n)), "contiguous, in order, each row once"
    assert all(split) and len(split) <= minibatches
    if groups is None or group_size == 1:
        assert len(split) == min(n, minibatches)
        if split:
            assert max(map(len, split)) - min(map(len, split)) <= 1
    else:
        for a, b in zip(split, split[1:]):
            assert groups[a[-1]] != groups[b[0]], "a group was cut"


def test_split_minibatches_gathers_non_contiguous_groups():
    groups = ["a", "b", "a", "c", "b", "c"]
    assert split_minibatches(6, 2, groups) == [(0, 2), (1, 3, 4, 5)]  # cut at 3 ties between 2 and 4: earlier
    assert split_minibatches(6, 3, groups) == [(0, 2), (1, 4), (3, 5)]


def _named(lengths, **kw):
    s = make_schedule(lengths, **kw)
    _check(
        s,
        lengths,
        world=kw["world"],
        minibatches=kw.get("minibatches", 1),
        token_cap=kw.get("token_cap"),
        groups=kw.get("groups"),
        weights=kw.get("weights"),
        min_rows=kw.get("min_rows", 1),
        quadratic_cost=kw.get("quadratic_cost", 0.0),
    )
    return s


def test_512_on_6_ranks():
    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(6.4, 1.0)) + 1 for _ in range(512)]
    s = _named(lengths, world=6, minibatches=4, token_cap=8192, groups=[i // 8 for i in range(512)], min_rows=2)
    assert [len(mb.rows) for mb in s.minibatches] == [128] * 4
    for mb in s.minibatches:
        loads = [sum(lengths[i] for x in micros for i in x.rows) for micros in mb.per_rank]
        assert max(loads) <= 1.05 * sum(loads) / 6


def test_2_on_4_ranks():
    s = _named([5, 9], world=4)
    assert s.micro_steps() == [1]
    assert sorted(s.rank_rows(r) for r in range(4)) == [[], [], [0], [1]]


def test_0_samples():
    s = _named([], world=4, minibatches=3, token_cap=100, min_rows=2)
    assert s.minibatches == () and s.micro_steps() == [] and s.rank_loads() == [0, 0, 0, 0]


def test_1_rank():
    s = _named([5, 3, 8, 1, 4], world=1, minibatches=2, token_cap=10)
    assert [mb.rows for mb in s.minibatches] == [(0, 1, 2), (3, 4)]
    assert s.rank_rows(0) and sorted(s.rank_rows(0)) == [0, 1, 2, 3, 4]
    # 8 alone, 5 and 3 together (2 * 5 = 10 tokens, run first: most tokens first), then 4 and 1 together.
    assert [[x.rows for x in micros] for mb in s.minibatches for micros in mb.per_rank] == [[(0, 1), (2,)], [(3, 4)]]


def test_1_sample_on_8_ranks():
    s = _named([7], world=8)
    assert s.micro_steps() == [1]
    assert s.rank_rows(0) == [0] and all(s.rank_rows(r) == [] for r in range(1, 8))
    assert s.minibatches[0].per_rank[3] == (MicroBatch((), 0),)


def test_more_minibatches_than_samples():
    s = _named([4, 5, 6], world=2, minibatches=5)
    assert [mb.rows for mb in s.minibatches] == [(0,), (1,), (2,)]


def test_min_rows_three_over_two_ranks_goes_to_one_rank():
    s = _named([3, 9, 4], world=2, min_rows=2)
    assert s.rank_rows(0) == [0, 1, 2] and s.rank_rows(1) == []


def test_min_rows_lone_long_row_gets_a_companion():
    # Balancing alone would put the 1000 on its own rank; min_rows=2 gives that rank the shortest other row.
    lengths = [1000, 10, 20, 30, 40, 50, 60]
    s = _named(lengths, world=2, min_rows=2)
    ranks = sorted(sorted(s.rank_rows(r)) for r in range(2))
    assert ranks == [[0, 1], [2, 3, 4, 5, 6]]


def test_min_rows_impossible_cases():
    with pytest.raises(ScheduleError, match="min_rows"):
        make_schedule([5], world=2, min_rows=2)
    with pytest.raises(ScheduleError, match="mini-batch 2 has 1 row"):
        make_schedule([1, 2, 3, 4, 5], world=2, minibatches=3, min_rows=2)
    with pytest.raises(ScheduleError):
        make_schedule([1, 2, 3], world=1, groups=["a", "b", "c"], minibatches=2, min_rows=2)  # (0,1) | (2)
    assert issubclass(ScheduleError, UsageError) and issubclass(ScheduleError, ValueError)


def test_oversize_rows_run_alone():
    s = _named([50, 10, 200, 10, 10], world=1, token_cap=100)
    assert s.oversize == (2,)
    micros = s.minibatches[0].per_rank[0]
    assert micros[0] == MicroBatch((2,), 200)
    assert s.over_cap() == [(0, 0, 0)]


def test_tight_cap_with_min_rows_exceeds_and_reports():
    # No two rows of 10 fit under 15, but BatchNorm needs 2: run 3 together (30 <= 3/2 * 15) and report it.
    s = _named([10, 10, 10], world=1, token_cap=15, min_rows=2)
    assert s.oversize == ()
    assert s.minibatches[0].per_rank[0] == (MicroBatch((0, 1, 2), 30),)
    assert s.over_cap() == [(0, 0, 0)]


def test_short_ranks_split_before_padding():
    # Weights 3:1 put the three 1000-token rows on rank 0 (3 micro-batches under the cap) and the hundred 10-token
    # rows on rank 1 (one micro-batch); rank 1 splits into 3 near-equal pieces instead of running 2 fillers.
    s = _named([1000] * 3 + [10] * 100, world=2, weights=[3, 1], token_cap=1000)
    assert s.micro_steps() == [3]
    assert [len(x.rows) for x in s.minibatches[0].per_rank[1]] == [34, 33, 33]
    # With min_rows=2 the three long rows cannot be split into pairs within the cap: one micro-batch of 3, reported.
    s = _named([1000] * 3 + [10] * 100, world=2, weights=[3, 1], token_cap=1000, min_rows=2)
    assert s.micro_steps() == [1] and s.over_cap() == [(0, 0, 0)]
    # A rank that cannot split any further pads with fillers.
    s = _named([1000, 1000, 1000, 10, 10], world=2, weights=[3, 1], token_cap=1000)
    assert s.micro_steps() == [3]
    assert [x.rows for x in s.minibatches[0].per_rank[1]] == [(3,), (4,), ()]


def test_no_cap_means_one_micro_batch_per_rank():
    s = _named(list(range(1, 101)), world=3, quadratic_cost=0.01)
    assert s.micro_steps() == [1]


@settings(deadline=None, max_examples=80)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 200), world=st.integers(1, 7),
       minibatches=st.integers(1, 4), share=st.sampled_from([0.0, 0.3, 0.9, 1.0]))
def test_inert_rows_stay_members_but_nobody_runs_them(seed, n, world, minibatches, share):
    rng = random.Random(seed)
    lengths = _lengths(rng, n)
    groups = [i // 4 for i in range(n)]
    inert = [rng.random() < share for _ in range(n)]
    kw = dict(world=world, minibatches=minibatches, token_cap=400, groups=groups)
    plain = make_schedule(lengths, **kw)
    s = make_schedule(lengths, inert=inert, **kw)
    # Membership (what the loss denominators count) is unchanged; only rows with work are run, once each.
    assert [mb.rows for mb in s.minibatches] == [mb.rows for mb in plain.minibatches]
    run = [i for mb in s.minibatches for micros in mb.per_rank for m in micros for i in m.rows]
    assert sorted(run) == [i for i in range(n) if not inert[i]]
    for mb in s.minibatches:
        assert len({len(micros) for micros in mb.per_rank}) == 1, "equal micro-steps on every rank"
        work = [lengths[i] for i in mb.rows if not inert[i]]
        if work:  # balanced over the working rows alone
            loads = [sum(lengths[i] for m in micros for i in m.rows) for micros in mb.per_rank]
            assert max(loads) <= (sum(work) + (world - 1) * max(work)) / world + 1e-9


def test_all_inert_minibatch_is_one_filler_step_per_rank():
    s = make_schedule([5, 6, 7, 8], world=3, minibatches=2, inert=[True, True, False, False])
    assert [len(mb.rows) for mb in s.minibatches] == [2, 2]
    assert all(m.rows == () for micros in s.minibatches[0].per_rank for m in micros)
    assert s.micro_steps() == [1, 1]
    with pytest.raises(ScheduleError, match="^inert"):
        make_schedule([5, 6], world=1, inert=[True])
    with pytest.raises(ScheduleError, match="^inert"):
        make_schedule([5, 6, 7, 8], world=1, min_rows=2, inert=[True, False, False, False])


def test_bad_arguments_name_the_field():
    for kw, field in [
        (dict(world=0), "world"),
        (dict(world=2, minibatches=0), "minibatches"),
        (dict(world=2, token_cap=0), "token_cap"),
        (dict(world=2, min_rows=0), "min_rows"),
        (dict(world=2, weights=[1.0]), "weights"),
        (dict(world=2, weights=[1.0, -1.0]), "weights[1]"),
        (dict(world=2, quadratic_cost=-1.0), "quadratic_cost"),
        (dict(world=2, groups=[1]), "groups"),
    ]:
        with pytest.raises(ScheduleError, match=f"^{field.replace('[', '.').replace(']', '.')}"):
            make_schedule([1, 2], **kw)
    with pytest.raises(ScheduleError, match=r"lengths\[1\]"):
        make_schedule([1, -2], world=1)
    with pytest.raises(ScheduleError, match=r"lengths\[0\]"):
        make_schedule([1.5], world=1)


def test_fast_enough_for_the_planner():
    rng = random.Random(0)
    lengths = [int(rng.lognormvariate(6.4, 1.0)) + 1 for _ in range(4096)]
    t = time.thread_time()
    s = make_schedule(lengths, world=64, minibatches=4, token_cap=16384)
    assert time.thread_time() - t < 1.0  # measured ~20 ms; generous so a busy CI box does not fail it
    assert sum(len(mb.rows) for mb in s.minibatches) == 4096


def test_no_torch_or_numpy_at_import():
    code = "import sys, evenrl.core.schedule, evenrl.core.partition; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_packed_micro_batches_count_the_sum_of_their_rows():
    """packed: a micro-batch's tokens are the sum of its rows (rows back to back), so more rows fit a cap than
    rows x longest allows; the padding share is 0 packed (group 1), rows x longest - real padded, and only the
    split's rounding to a multiple of the group otherwise."""
    lengths = [30, 20, 10, 30, 20, 10]
    padded = make_schedule(lengths, world=1, token_cap=60)
    packed = make_schedule(lengths, world=1, token_cap=60, packed=True)
    for s in (padded, packed):
        assert sorted(r for m in s.minibatches[0].per_rank[0] for r in m.rows) == list(range(6))
        assert all(m.tokens <= 60 for m in s.minibatches[0].per_rank[0])
    assert len(packed.minibatches[0].per_rank[0]) < len(padded.minibatches[0].per_rank[0])
    assert all(m.tokens == sum(lengths[i] for i in m.rows) for m in packed.minibatches[0].per_rank[0])
    assert packed.padding_share(lengths) == 0.0
    real = sum(lengths)
    slots = sum(len(m.rows) * max(lengths[i] for i in m.rows) for m in padded.minibatches[0].per_rank[0])
    assert padded.padding_share(lengths) == pytest.approx(1 - real / slots) and slots > real
    rounded = sum(-(-sum(lengths[i] for i in m.rows) // 4) * 4 for m in packed.minibatches[0].per_rank[0])
    assert packed.padding_share(lengths, group=4) == pytest.approx(1 - real / rounded)
