import io
import random

import pytest
import torch

from evenrl.core.batch import Batch, Ragged


def make(n: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 6, (n,), generator=g)
    return Batch({
        "sample_index": torch.arange(n) * 10,
        "reward": torch.randn(n, generator=g),
        "pair": torch.randn(n, 2, generator=g),
        "tokens": Ragged(torch.randint(0, 99, (int(lens.sum()),), generator=g), lens),
        "topk": Ragged(torch.randn(int(lens.sum()), 3, generator=g), lens.clone()),
        "prompt": [f"p{i}" for i in range(n)],
    })


def row(b: Batch, i: int) -> dict:
    """Row i read the slow way: a ragged value is its slice of the flat storage."""
    out = {}
    for name in b.keys():
        col = b[name]
        if isinstance(col, Ragged):
            start = int(col.lengths[:i].sum())
            out[name] = col.values[start:start + int(col.lengths[i])]
        else:
            out[name] = col[i]
    return out


def rows(b: Batch) -> list[dict]:
    return [row(b, i) for i in range(len(b))]


def same_row(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(
        torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)


def assert_same(a: Batch, b: Batch) -> None:
    assert len(a) == len(b) and a.keys() == b.keys()
    for x, y in zip(rows(a), rows(b)):
        assert same_row(x, y)
    for k in a.keys():  # dtypes survive, including empty batches
        ca, cb = a[k], b[k]
        if isinstance(ca, Ragged):
            assert ca.values.dtype == cb.values.dtype and ca.values.shape[1:] == cb.values.shape[1:]
        elif isinstance(ca, torch.Tensor):
            assert ca.dtype == cb.dtype and ca.shape[1:] == cb.shape[1:]


def test_list_of_tensors_becomes_ragged():
    x = [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long), torch.tensor([3])]
    b = Batch({"x": x, "s": ["a", "b", "c"]})
    assert isinstance(b["x"], Ragged) and b["x"].lengths.tolist() == [2, 0, 1]
    assert row(b, 0)["x"].tolist() == [1, 2] and row(b, 1)["x"].tolist() == [] and row(b, 2)["s"] == "c"
    with pytest.raises(ValueError):
        b["bad"] = torch.zeros(4)
    with pytest.raises(ValueError):
        b["bad"] = Ragged(torch.zeros(4), torch.tensor([1, 1, 1]))


@pytest.mark.parametrize("seed", range(5))
def test_select_matches_rows(seed):
    b = make(9, seed)
    rng = random.Random(seed)
    idx = [rng.randrange(9) for _ in range(rng.randrange(0, 12))]  # repeats and empty allowed
    for form in (idx, torch.tensor(idx, dtype=torch.long)):
        s = b.select(form)
        assert len(s) == len(idx)
        for j, i in enumerate(idx):
            assert same_row(row(s, j), row(b, i))
    mask = torch.tensor([rng.random() < 0.5 for _ in range(9)])
    assert_same(b.select(mask), b.select(mask.nonzero().flatten().tolist()))


@pytest.mark.parametrize("seed", range(5))
def test_split_concat_round_trip(seed):
    b = make(11, seed)
    rng = random.Random(seed)
    cuts = sorted(rng.randrange(12) for _ in range(3))
    sizes = [a - p for p, a in zip([0] + cuts, cuts + [11])]
    parts = b.split(sizes)
    assert [len(p) for p in parts] == sizes
    assert_same(Batch.concat(parts), b)
    perm = list(range(11))
    rng.shuffle(perm)
    back = b.select(perm).select(sorted(range(11), key=perm.__getitem__))
    assert_same(back, b)
    with pytest.raises(ValueError):
        b.split([5, 5])


def test_empty_batches_keep_schema():
    b = make(4)
    e = b.select([])
    assert len(e) == 0 and e["tokens"].values.dtype == torch.long and e["topk"].values.shape[1:] == (3,)
    assert_same(Batch.concat([e, b, e]), b)
    v, m = e.padded("tokens")
    assert v.shape == (0, 0) and m.shape == (0, 0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_against_loop(side):
    b = make(7, 3)
    for name, pad in (("tokens", -1), ("topk", 0.5)):
        v, m = b.padded(name, pad, side=side)
        width = max(len(r[name]) for r in rows(b))
        assert v.shape[:2] == (7, width) and m.dtype == torch.bool
        for i, r in enumerate(rows(b)):
            L = len(r[name])
            real = slice(0, L) if side == "right" else slice(width - L, width)
            assert m[i].sum() == L and m[i, real].all()
            assert torch.equal(v[i, real], r[name])
            assert (v[i][~m[i]] == pad).all()


def test_to_dict_survives_weights_only_load():
    b = make(6)
    buf = io.BytesIO()
    torch.save(b.to_dict(), buf)
    buf.seek(0)
    assert_same(Batch.from_dict(torch.load(buf, weights_only=True)), b)
    assert_same(b.to("cpu"), b)
    e = b.select([])
    buf = io.BytesIO()
    torch.save(e.to_dict(), buf)
    buf.seek(0)
    assert_same(Batch.from_dict(torch.load(buf, weights_only=True)), e)


def test_concat_rejects_different_columns():
    b = make(3)
    c = Batch({"sample_index": torch.arange(2)})
    with pytest.raises(ValueError):
        Batch.concat([b, c])


def test_declared_columns_keep_their_kind_and_dtype():
    from evenrl.core.batch import COLUMNS

    b = Batch({"reward": torch.zeros(3), "tokens": Ragged.of([torch.tensor([1, 2]), torch.tensor([3])] * 1 +
                                                              [torch.tensor([4])], torch.long)})
    assert len(b) == 3 and b["tokens"].lengths.tolist() == [2, 1, 1]
    for name, value in [("reward", torch.zeros(3, dtype=torch.float64)),         # wrong dtype
                        ("advantage", torch.zeros(3, 1)),                         # per-sample column with a 2nd dim
                        ("tokens", torch.zeros(3, dtype=torch.long)),             # per-token column given per sample
                        ("old_logp", Ragged.of([torch.zeros(1)] * 3, torch.float64)),
                        ("completion", torch.zeros(3))]:                          # a list column given a tensor
        with pytest.raises(TypeError, match=name):
            b[name] = value
    b["undeclared"] = torch.zeros(3, dtype=torch.float64)  # scratch columns stay free
    assert all(c.meaning for c in COLUMNS.values())
    empty = Ragged.of([], torch.float32)
    assert empty.values.dtype == torch.float32 and empty.lengths.tolist() == []
