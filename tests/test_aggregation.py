import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenrl.core.aggregation import MODES, Denominators, aggregate
from evenrl.errors import UsageError


def local_counts(masks) -> Denominators:
    """A rank's counts over its micro-batches of one mini-batch (each mask [B, T]); summed over ranks they are the
    global denominators (the trainer instead computes them from the all-gathered lengths)."""
    tokens = seqs = 0
    for m in masks:
        if m.numel():
            per_row = m.bool().sum(-1)
            tokens += int(per_row.sum())
            seqs += int((per_row > 0).sum())
    return Denominators(float(tokens), float(seqs))


def naive(values: list[torch.Tensor], masks: list[torch.Tensor], mode: str) -> float:
    """The mode's value computed directly on one process over all sequences (plain Python loops)."""
    seqs = [[float(x) for x, m in zip(v, k) if m] for v, k in zip(values, masks)]
    seqs = [s for s in seqs if s]
    if not seqs:
        return 0.0
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    if mode == "token-sum-norm":  # the constant C is 1 here
        return sum(sum(s) for s in seqs)
    return sum(sum(s) for s in seqs) / len(seqs)


def pad(rows: list[int], values, masks, extra: int):
    """A micro-batch as [B, T] tensors; the padding holds nan/inf, which aggregate() must ignore."""
    width = max([len(values[r]) for r in rows], default=0) + extra
    x = torch.full((len(rows), width), float("nan"), dtype=torch.float64)
    m = torch.zeros((len(rows), width), dtype=torch.bool)
    for j, r in enumerate(rows):
        L = len(values[r])
        x[j, :L], m[j, :L] = values[r], masks[r]
        x[j, :L][~masks[r]] = float("inf")  # masked-out real positions too
    return x, m


@st.composite
def layouts(draw):
    """Sequences (lengths 0..12, some fully masked out) dealt to fake ranks, each with its micro-batches."""
    n = draw(st.integers(0, 25))
    world = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lens = [draw(st.integers(0, 12)) for _ in range(n)]
    values = [torch.randn(L, generator=g, dtype=torch.float64) for L in lens]
    masks = [torch.rand(L, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0])) for L in lens]
    owner = [draw(st.integers(0, world - 1)) for _ in range(n)]
    ranks = []
    for r in range(world):
        mine = [i for i in range(n) if owner[i] == r]
        k = draw(st.integers(1, 4))  # micro-batches on this rank; some may be empty
        micro = [[] for _ in range(k)]
        for i in mine:
            micro[draw(st.integers(0, k - 1))].append(i)
        ranks.append(micro)
    extra = draw(st.integers(0, 2))
    return values, masks, ranks, extra


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_sum_of_shares_equals_naive_value(layout):
    values, masks, ranks, extra = layout
    micro = [[pad(rows, values, masks, extra) for rows in rank] for rank in ranks]
    per_rank = [local_counts([m for _, m in rank]) for rank in micro]
    denom = Denominators(sum(d.tokens for d in per_rank), sum(d.seqs for d in per_rank))  # every rank's, summed
    for mode in MODES:
        total = sum(float(aggregate(x, m, mode, denom)) for rank in micro for x, m in rank)
        want = naive(values, masks, mode)
        assert math.isfinite(total)
        assert total == pytest.approx(want, rel=1e-12, abs=1e-12), mode


def test_empty_micro_batch_contributes_zero_with_a_graph():
    x = torch.zeros(0, 0, requires_grad=True)
    for mode in MODES:
        share = aggregate(x, torch.zeros(0, 0, dtype=torch.bool), mode, Denominators(10.0, 3.0))
        assert float(share.detach()) == 0.0 and share.requires_grad
    assert local_counts([torch.zeros(0, 0), torch.zeros(2, 0)]) == Denominators(0.0, 0.0)


def test_fully_masked_rows_are_not_sequences():
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert local_counts([m]) == Denominators(3.0, 2.0)


def test_naive_per_rank_mean_is_not_exact():
    """What the shares replace: each rank averaging its own tokens, then averaging over ranks (DDP).
    With uneven shards it is wrong, so the exact test above can fail."""
    values = [torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([0.0]), torch.tensor([5.0, 5.0])]
    masks = [torch.ones(len(v), dtype=torch.bool) for v in values]
    shards = [[0], [1, 2]]
    denom = Denominators(7.0, 3.0)
    per_rank_mean = 0.0
    for s in shards:
        x, m = pad(s, values, masks, 0)
        per_rank_mean += float(aggregate(x, m, "token-mean", local_counts([m]))) / len(shards)
    exact = sum(float(aggregate(*pad(s, values, masks, 0), "token-mean", denom)) for s in shards)
    assert exact == pytest.approx(naive(values, masks, "token-mean"))  # 14/7 = 2
    assert abs(per_rank_mean - exact) > 0.1                            # (1 + 10/3)/2 = 2.17


def test_unknown_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="loss_agg_mode"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean", Denominators(1.0, 1.0))
