"""distributed.fixed_point (the chunked fixed-point passes of train.reproducibility=bitwise) gives the bits of the
whole-tensor algorithm it replaced, kept here as the reference (REF_*: distributed/exact.py before the chunked
passes): ExactGrads' summed gradients, the fixed-point clip norm and the clipped gradients, the weights' hash, on
tensors of awkward sizes (empty, 1, a chunk and one either side, several chunks and a tail) and values (zeros of
both signs, subnormals, fp32's extremes, exact powers of two at the bins' edges, a top bin that moves by one and by
several between micro-batches, bf16, NaN and inf). A change of bits here changes recorded runs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from evenrl.distributed import exact
from evenrl.distributed.fixed_point import CHUNK

P = exact.P


# ----------------------------------------------------------------------------- the reference: the old algorithm
def ref_split(g, top):
    a = g.double() * 2.0 ** (-32 * top) if top > 0 or g.dtype != torch.float32 else g * 2.0 ** (-32 * top)
    hi = torch.trunc(a)
    return hi, a.sub_(hi).mul_(2.0 ** 32).trunc_()


def ref_sum(micro_batches: list[list[torch.Tensor | None]], dtypes) -> list[torch.Tensor | None]:
    """The old ExactGrads on one process: deposit each micro-batch, then reduce (its per-tensor expressions)."""
    n = len(dtypes)
    tops, had, bad = [exact.NONE] * n, [False] * n, False
    bins: list = [None] * n
    for grads in micro_batches:
        have = [i for i, g in enumerate(grads) if g is not None]
        amax = torch.stack([grads[i].abs().max() if grads[i].numel() else grads[i].new_zeros(()) for i in have])
        for i, m in zip(have, amax.tolist()):
            had[i] = True
            if not math.isfinite(m):
                bad = True
                continue
            new = max(tops[i], exact.top_bin(m))
            if new == exact.NONE:
                continue
            if bins[i] is None:
                bins[i] = [torch.zeros(grads[i].shape, dtype=torch.float64) for _ in range(2)]
            exact.realign(*bins[i], tops[i], new)
            tops[i] = new
            h, l_ = ref_split(grads[i], new)
            bins[i][0].add_(h)
            bins[i][1].add_(l_)
    out = []
    for i in range(n):
        shape = next(g[i].shape for g in micro_batches if g[i] is not None) if had[i] else None
        if not had[i]:
            out.append(None)
        elif bad:
            out.append(torch.full(shape, float("nan"), dtype=dtypes[i]))
        elif tops[i] == exact.NONE:
            out.append(torch.zeros(shape, dtype=dtypes[i]))
        else:
            hi, lo = bins[i]
            out.append((hi * 2.0 ** (32 * tops[i]) + lo * 2.0 ** (32 * (tops[i] - 1))).to(dtypes[i]))
    return out


def ref_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    squares = [g.double().square() for g in grads]
    amax = torch.stack([s.max() if s.numel() else s.new_zeros(()) for s in squares])
    tops = [exact.top_bin(float(m), lowest=-10) for m in amax.tolist()]
    sums = torch.zeros(len(grads), 2, dtype=torch.long)
    for i, (s, t) in enumerate(zip(squares, tops)):
        if t != exact.NONE and math.isfinite(float(amax[i])):
            hi, lo = ref_split(s, t)
            sums[i, 0], sums[i, 1] = hi.long().sum(), lo.long().sum()
    total = 0.0
    for (h, l_), t, m in zip(sums.tolist(), tops, amax.tolist()):
        if not math.isfinite(m):
            total = float("nan") if math.isnan(m) else float("inf")
            break
        if t != exact.NONE:
            total += float(h) * 2.0 ** (32 * t) + float(l_) * 2.0 ** (32 * (t - 1))
    norm = torch.tensor(math.sqrt(total) if total >= 0 else total, dtype=torch.float32)
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm


def ref_hash(tensors: list[torch.Tensor], offsets: list[int]) -> list[list[int]]:
    sums = []
    for j, (t, off) in enumerate(zip(tensors, offsets)):
        x = t.contiguous().reshape(-1)
        bits = ((x.view(torch.int32) if x.element_size() == 4 else x.view(torch.int16)).long() & 0xFFFFFFFF) % P
        idx = torch.arange(off, off + x.numel(), dtype=torch.long) % P
        sums.append([int(((bits * ((idx * c + (j + 1) * d + 1) % P)) % P).sum()) % P
                     for c, d in ((48271, 16807), (69621, 40692))])
    return sums


# ----------------------------------------------------------------------------- awkward gradients
SIZES = [0, 1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17]


def awkward(n: int, g: torch.Generator, scale: float, dtype=torch.float32) -> torch.Tensor:
    """Normal values over ~60 binary orders of magnitude around `scale`, with zeros of both signs, subnormals,
    powers of two at bin edges and values that are integers or halves once scaled."""
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale * 2.0 ** torch.randint(-30, 31, (n,), generator=g)
    if n >= 7:
        x[:7] = torch.tensor([0.0, -0.0, 2.0 ** -140, -(2.0 ** -130), scale, -2.0 ** -32, 2.0 ** -64 * 3])
        every = torch.randint(0, n, (max(1, n // 50),), generator=g)
        x[every] = -0.0
    return x.clamp(-3e38, 3e38).to(dtype)


def bits(t: torch.Tensor | None):
    if t is None:
        return None
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16).clone()


def summed(micro: list[list[torch.Tensor | None]], dtype=torch.float32) -> list[torch.Tensor | None]:
    """ExactGrads over parameters shaped as the first micro-batch's gradients: each micro-batch deposited, reduced
    (one process); the summed gradients."""
    params = [nn.Parameter(torch.zeros(next(m[i] for m in micro if m[i] is not None).shape, dtype=dtype))
              for i in range(len(micro[0]))]
    bins = exact.ExactGrads(params)
    for grads in micro:
        for p, x in zip(params, grads):
            p.grad = None if x is None else x.clone()
        bins.deposit()
    bins.reduce()
    return [p.grad for p in params]


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(bits(a), bits(b)))


CASES = {
    # name: per micro-batch, per tensor, the scale of its values (None: no gradient this micro-batch)
    "steady": [[1e-3, 1.0, 1e-6]] * 4,
    "top up by one then by several": [[1e-12, 1e-20, 1.0], [1e-3, 1e-20, 1e10], [1e8, 1e10, 1e-30], [1e30, 1e-3, 1e-3]],
    "extremes": [[1e-42, 3e38, 1e-38], [1e-45, 1e38, 2.0 ** -100]],
    "gaps": [[1e-3, None, 0.0], [None, 1e-2, 0.0], [1e-1, None, None]],
}


@pytest.fixture(params=["chunks", "whole"])
def passes(request, monkeypatch):
    """The CPU's chunked passes, and the whole-tensor passes a GPU takes (fixed_point.whole), both on the CPU."""
    from evenrl.distributed import fixed_point

    monkeypatch.setattr(fixed_point, "whole", lambda device: request.param == "whole")
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_exact_grads_clip_and_hash_are_the_old_bits(case, passes):
    g = torch.Generator().manual_seed(sorted(CASES).index(case))
    sizes = [SIZES[(k + len(case)) % len(SIZES)] for k in range(len(CASES[case][0]))] + SIZES
    micro = []
    for scales in CASES[case]:
        scales = list(scales) + [1e-3 * 10.0 ** (k % 7 - 3) for k in range(len(SIZES))]
        micro.append([None if s is None else (torch.zeros(n) if s == 0.0 else awkward(n, g, s))
                      for s, n in zip(scales, sizes)])
    want = ref_sum(micro, [torch.float32] * len(sizes))
    assert all(same(a, b) for a, b in zip(summed(micro), want)), case
    assert any(w is not None and w.numel() and w.abs().max() > 0 for w in want)  # not all zeros: a weak test
    live = [w for w in want if w is not None]
    for max_norm in (float("inf"), 1e-3):  # the norm, and the gradients it clipped
        clipped = [w.clone() for w in live]
        norm_want = ref_norm(clipped, max_norm)
        params = [nn.Parameter(torch.zeros(w.shape)) for w in live]
        for p, w in zip(params, live):
            p.grad = w.clone()
        norm = exact.clip_grad_norm(params, max_norm)
        assert same(norm, norm_want), (case, float(norm), float(norm_want))
        assert all(same(p.grad, w) for p, w in zip(params, clipped))
    params = [nn.Parameter(w.clone()) for w in live]
    assert exact.weights_hash(params) == _hash_hex(ref_hash(live, [0] * len(live)))


def _hash_hex(sums: list[list[int]]) -> str:
    h = torch.tensor(sums, dtype=torch.long).sum(0) % P
    return f"{int(h[0]):08x}{int(h[1]):08x}"


def test_non_finite_and_bf16_terms_are_the_old_bits(monkeypatch):
    """A NaN or an inf in one micro-batch makes every summed gradient NaN, as before; bf16 gradients take the fp64
    path and their sums round to bf16 as before; the hash of bf16 weights and of shards (flat offsets) too."""
    g = torch.Generator().manual_seed(11)
    for poison in (float("nan"), float("inf"), -float("inf")):
        micro = [[awkward(n, g, 1e-2) for n in (5, CHUNK + 3)] for _ in range(3)]
        micro[1][1][CHUNK // 2] = poison
        got, want = summed(micro), ref_sum(micro, [torch.float32] * 2)
        assert all(same(a, b) for a, b in zip(got, want)) and torch.isnan(got[0]).all()
        grads = [awkward(5, g, 1.0), awkward(CHUNK + 3, g, 1.0)]
        grads[1][3] = poison
        params = [nn.Parameter(torch.zeros(x.shape)) for x in grads]
        for p, x in zip(params, grads):
            p.grad = x.clone()
        assert same(exact.clip_grad_norm(params, 1.0), ref_norm([x.clone() for x in grads], 1.0))
    micro = [[awkward(n, g, s, torch.bfloat16) for n, s in ((CHUNK + 5, 1e-3), (3, 1e20))] for _ in range(3)]
    got, want = summed(micro, torch.bfloat16), ref_sum(micro, [torch.bfloat16] * 2)
    assert all(same(a, b) for a, b in zip(got, want)) and want[0].abs().max() > 0
    assert exact.weights_hash([nn.Parameter(w) for w in want]) == _hash_hex(ref_hash(want, [0, 0]))
    x = awkward(2 * CHUNK + 9, g, 1.0)
    for off in (5 * CHUNK + 3, P - 2 * CHUNK - 20):  # a shard's flat offset in its whole tensor, up to the prime
        monkeypatch.setattr(exact, "_global_offset", lambda t, off=off: off)
        params = [nn.Parameter(torch.zeros(3)), nn.Parameter(x.clone())]
        assert exact.weights_hash(params) == _hash_hex(ref_hash([p.data for p in params], [off, off]))


def ref_adamw_step(x, g, m, v, t: int, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.1):
    x.mul_(1.0 - lr * wd)
    m.mul_(b1).add_(g * (1.0 - b1))
    v.mul_(b2).add_((g * g).mul_(1.0 - b2))
    denom = (v.sqrt() / math.sqrt(1.0 - b2 ** t)).add_(eps)
    x.sub_((m / denom).mul_(lr / (1.0 - b1 ** t)))


@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_elementwise_adamw_in_chunks_is_the_old_bits(wd):
    """ElementwiseAdamW steps contiguous tensors chunk by chunk (and a transposed one whole): weights, both moments
    equal to the whole-tensor steps bit for bit over 3 steps, on awkward sizes and values."""
    g = torch.Generator().manual_seed(5)
    shapes = [(0,), (1,), (exact.STEP_CHUNK + 1,), (3, 1001)]
    params = [nn.Parameter(awkward(math.prod(s), g, 1.0).view(s)) for s in shapes]
    params.append(nn.Parameter(awkward(6 * 5, g, 1.0).view(6, 5).t()))  # not contiguous
    ref = [[p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)] for p in params]
    opt = exact.ElementwiseAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    for t in (1, 2, 3):
        for p, r in zip(params, ref):
            grad = awkward(p.numel(), g, 10.0 ** (t - 3)).view(p.shape) if p.is_contiguous() else \
                awkward(p.numel(), g, 1e-2).view(p.shape[1], p.shape[0]).t()
            p.grad = grad.clone()
            ref_adamw_step(r[0], grad, r[1], r[2], t, wd=wd)
        opt.step()
    for p, (x, m, v) in zip(params, ref):
        state = opt.state[p]
        assert same(p.detach(), x) and same(state["exp_avg"], m) and same(state["exp_avg_sq"], v), p.shape
    assert all(float(x.abs().max()) > 0 for x, _, _ in ref if x.numel())  # weights to compare, not zeros
