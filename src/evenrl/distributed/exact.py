"""Layout-free reductions (train.reproducibility=bitwise): sums whose bits do not depend on how their terms were
split over ranks and micro-batches, so that a run is the same on 1, 2, 3, ... processes.

A float sum depends on its order: (a + b) + c is not a + (b + c) in the last bit, and which micro-batch gradients a
rank adds before the all-reduce, and in which order the collective adds the ranks' (gloo's ring starts its chunks
at different ranks), is the layout. Three ways were measured to remove it (docs/reproducibility.md): an fp64 sum
rounded once (exact only while the terms' exponents stay within ~29 bits of each other: not a guarantee), gathering
every micro-batch's gradient and summing in a fixed order (memory: a gradient per micro-batch), and fixed point,
chosen here: integers add associatively, so any grouping, any collective, gives the same bits.

Gradients (`ExactGrads`; FSDP2's reduce-scatter: distributed.exact_fsdp). Each micro-batch's fp32 gradient is cut
at absolute bit positions into two integer "bins" of 32 bits under the tensor's top bin T (the one holding its
largest magnitude so far, over every micro-batch of every rank): hi = trunc(g / 2^32T), lo = trunc(frac * 2^32),
bits below 2^32(T-1) dropped. Each bin is summed exactly (as integer-valued fp64: exact below 2^53, i.e. up to 2^21
terms). When a larger gradient raises T by one, the old hi bin becomes the lo bin and the old lo bin is dropped;
since the bins sit at absolute positions, that equals cutting every earlier term at the new T, so the result is the
exact sum of every term's bits at and above 2^32(T-1) for the final T, whatever the order or grouping: T is
max-reduced over the ranks, then the bins SUM-reduced. Error against the exact sum: under 2^-32 of the tensor's
largest magnitude per term (fp32 rounds at 2^-24 of each value).

The passes over the elements run chunk by chunk in cache (distributed.fixed_point: the same bits, fewer passes).

Statistics (`canonical_sum`): each micro-batch's vector, gathered and added in the micro-batches' canonical order.
Gradient norm (`clip_grad_norm`): the squares' sum in fixed point (int64 bins), per tensor, then over tensors in
order. Weights (`weights_hash`): a sum over elements of (bits x a weight of the element's index) modulo a prime,
so shards add up to the whole tensor's hash.

    exact = ExactGrads(params)
    for micro_batch in mine: loss.backward(); exact.deposit()     # p.grad moved into the bins
    exact.reduce()                                                 # p.grad = the layout-free sum
"""

from __future__ import annotations

import math

import torch
import torch.distributed as tdist

from evenrl.distributed import fixed_point
from evenrl.distributed.fixed_point import BIN
from evenrl.distributed.guard import guard
from evenrl.distributed.mesh import G, comm_device, group, size
from evenrl.distributed.ops import (_is_dtensor, _local, _reduced_over, all_gather_object, all_gather_tensors,
                                   sharded_dims)

NONE = -(1 << 20)  # the top bin of a tensor that got no nonzero gradient yet
LOWEST = -3  # bins below it are clamped to it (|g| < 2^-96); keeps 2^(32 * -T) an fp32 number
P = (1 << 31) - 1  # the hash's prime (products of two residues fit int64)
STEP_CHUNK = 1 << 17  # ElementwiseAdamW's elements per pass
_SPARE: dict[tuple, torch.Tensor] = {}  # CPU: the last ExactGrads' bins, reused by the next of the same size


def top_bin(amax: float, lowest: int = LOWEST) -> int:
    """The bin holding `amax`'s highest bit (bin T spans [2^32T, 2^32(T+1))); NONE for 0."""
    if amax == 0.0:
        return NONE
    return max(lowest, (math.frexp(amax)[1] - 1) // BIN)


def largest(tensors: list[torch.Tensor]) -> list[float]:
    """Each tensor's largest magnitude (0.0 if empty, NaN if it holds one), in one pass that writes nothing."""
    if not tensors:
        return []
    ends = [torch.aminmax(t) if t.numel() else (t.new_zeros(()), t.new_zeros(())) for t in tensors]
    low, high = (torch.stack([e[k] for e in ends]) for k in (0, 1))  # promoted to the widest dtype: exact
    return torch.maximum(-low, high).tolist()  # maximum propagates a NaN (max() of Python floats may not)


def realign(hi: torch.Tensor, lo: torch.Tensor, old: int, new: int) -> None:
    """Bins of top `old` moved to top `new` >= old: what cutting every earlier term at `new` would have given."""
    if new == old or old == NONE:
        return
    if new == old + 1:
        lo.copy_(hi)
    else:
        lo.zero_()
    hi.zero_()


def combine(hi: torch.Tensor, lo: torch.Tensor, top: int) -> torch.Tensor:
    """The bins' value as fp64: hi x 2^32T + lo x 2^32(T-1)."""
    return hi * 2.0 ** (BIN * top) + lo * 2.0 ** (BIN * (top - 1))


def all_reduce(t: torch.Tensor, op, over: str = "data") -> torch.Tensor:
    """`op` over this rank's group of mesh dimension `over` (a no-op alone), in place on the comm device."""
    if size(over) > 1:
        x = t.to(comm_device())
        with guard("exact reduction"):
            tdist.all_reduce(x, op=op, group=group(over))
        if x is not t:
            t.copy_(x)
    return t


class ExactGrads:
    """The fixed-point sum of each parameter's micro-batch gradients on this rank (one flat fp64 buffer, hi and lo
    halves, 16 bytes per parameter element while a mini-batch runs; on CPU kept for the next mini-batch, whose
    fresh pages would cost more than its passes), then over the `data` group. `every`: a
    parameter no forward used gets zeros instead of None, as FSDP2's fixed-point reduce-scatter gives it
    (distributed.exact_fsdp), so a sharded model is the same on one process as on several."""

    def __init__(self, params, every: bool = False):
        # by the group each is summed over (experts split over "ep": the ranks holding the same ones), so that each
        # group's bins lie together in the buffer
        self.params = sorted((p for p in params if p.requires_grad), key=lambda p: _reduced_over(p) != "data")
        self.overs = [_reduced_over(p) for p in self.params]
        self.every = every
        self.tops = [NONE] * len(self.params)
        self.had = [False] * len(self.params)
        self.bad = False
        self.buf: torch.Tensor | None = None

    def _bins(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Parameter i's bins; they hold what was there before until its first deposit (tops[i] is NONE)."""
        if self.buf is None:
            local = [_local(p) for p in self.params]
            self.sizes = [x.numel() for x in local]
            self.offsets = [0]
            for n in self.sizes:
                self.offsets.append(self.offsets[-1] + n)
            key = (self.offsets[-1], str(local[0].device))
            self.buf = _SPARE.pop(key, None)
            if self.buf is None:
                self.buf = torch.empty(2, self.offsets[-1], dtype=torch.float64, device=local[0].device)
            self.flat = [(self.buf[0, a:b], self.buf[1, a:b]) for a, b in zip(self.offsets, self.offsets[1:])]
        return self.flat[i]

    def deposit(self, more: list | None = None) -> None:
        """Move every parameter's gradient (one micro-batch's) into its bins; its grad is None afterwards. more:
        (parameter, gradient of its local part) pairs, each a term of its own (expert parallelism's per-source
        gradients: distributed.expert_parallel.take_terms)."""
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        terms = [(i, _local(self.params[i].grad)) for i in have]
        if more:
            where = {id(p): i for i, p in enumerate(self.params)}
            terms += [(where[id(p)], g) for p, g in more]
        if not terms:
            return
        grads = [g.detach().reshape(-1) for _, g in terms]
        for (i, _), g, m in zip(terms, grads, largest(grads)):
            self.had[i] = True
            if not math.isfinite(m):
                self.bad = True
                continue
            new = max(self.tops[i], top_bin(m))
            if new == NONE:
                continue
            hi, lo = self._bins(i)
            realign(hi, lo, self.tops[i], new)
            fixed_point.deposit(hi, lo, g, new, fresh=self.tops[i] == NONE)
            self.tops[i] = new
        for i in have:
            self.params[i].grad = None

    def reduce(self) -> None:
        """The layout-free sum over the ranks of each parameter's group (`data`; `edata` for experts split over "ep")
        into p.grad (None where no rank had a gradient; NaN everywhere if any term was not finite, so the step's
        non-finite check stops the run). The top bins are max-reduced over the whole data group, experts' too: every
        shard of an expert tensor is cut at the whole tensor's top, as one process cuts it."""
        n = len(self.params)
        head = torch.tensor(self.tops + [int(h) for h in self.had] + [int(self.bad)], dtype=torch.long)
        all_reduce(head, tdist.ReduceOp.MAX, "data")
        tops, had, bad = head[:n].tolist(), head[n:2 * n].tolist(), bool(head[-1])
        for over in dict.fromkeys(self.overs):
            mine = [i for i in range(n) if self.overs[i] == over]  # consecutive (__init__)
            if all(tops[i] == NONE for i in mine):
                continue
            for i in mine:
                hi, lo = self._bins(i)
                if self.tops[i] == NONE:  # nothing deposited here: zeros to the sum
                    hi.zero_()
                    lo.zero_()
                realign(hi, lo, self.tops[i], tops[i])
            if len(mine) == n:
                all_reduce(self.buf, tdist.ReduceOp.SUM, over)
            else:  # the group's bins: a contiguous column range of the two rows
                part = self.buf[:, self.offsets[mine[0]]:self.offsets[mine[-1] + 1]]
                part.copy_(all_reduce(part.contiguous(), tdist.ReduceOp.SUM, over))
        for i, p in enumerate(self.params):
            if not had[i] and not self.every:
                p.grad = None
                continue
            local = _local(p)
            like = dict(dtype=local.dtype, device=local.device)
            if bad:
                value = torch.full(local.shape, float("nan"), **like)
            elif tops[i] == NONE:
                value = torch.zeros(local.shape, **like)
            else:
                value = torch.empty(local.shape, **like)
                hi, lo = self._bins(i)
                fixed_point.combine_into(value.view(-1), hi, lo, tops[i])
            if _is_dtensor(p):
                p.grad = torch.zeros_like(p)
                _local(p.grad).copy_(value)
            else:
                p.grad = value
        if self.buf is not None and self.buf.device.type == "cpu":
            _SPARE.clear()  # one kept: the fresh pages of a new one cost more than the passes (glibc unmaps them)
            _SPARE[(self.buf.shape[1], str(self.buf.device))] = self.buf
        self.tops, self.had, self.bad, self.buf = [NONE] * n, [False] * n, False, None


def _over_shards(values: torch.Tensor, tensors: list, op) -> torch.Tensor:
    """values[i] (a row per tensor) reduced by `op` over the ranks that hold parts of tensors[i]; rows of tensors
    whole on this rank are left as they are. One all-reduce per kind of split and mesh dimension, in the order the
    tensors come (the same on every rank: the same parameters); exact for integers (and MAX)."""
    kinds: dict[tuple, list] = {}
    for i, t in enumerate(tensors):
        if dims := sharded_dims(t):
            kinds.setdefault((id(t.device_mesh), dims), [t.device_mesh, dims, []])[2].append(i)
    for mesh, dims, rows in kinds.values():
        part = values[rows]
        for d in dims:
            x = part.to(comm_device())
            with guard("exact reduction"):
                tdist.all_reduce(x, op=op, group=mesh.get_group(d))
            part = x.to(values.device)
        values[rows] = part
    return values


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ with a layout-free norm: each gradient's sum of squares in fixed point (the
    squares are exact in fp64; int64 bins under the tensor's top bin, summed exactly, and over the ranks holding
    parts of a split gradient), the tensors' sums then added in parameter order. Gradients whole on a rank need no
    collective (a norm weight's beside tensor parallelism is whole on each rank of its group: counted once); FSDP2's
    shards are summed over the data group, tensor parallelism's over the tp group."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    flat = [_local(g).detach().reshape(-1) for g in grads]
    amax = torch.tensor([m * m for m in largest(flat)], dtype=torch.float64)  # the largest square, exactly
    _over_shards(amax[:, None], grads, tdist.ReduceOp.MAX)
    tops = [top_bin(float(m), lowest=-10) for m in amax.tolist()]
    sums = torch.zeros(len(grads), 2, dtype=torch.long)
    for i, (g, t) in enumerate(zip(flat, tops)):
        if t != NONE and math.isfinite(float(amax[i])):
            sums[i, 0], sums[i, 1] = fixed_point.square_bins(g, t)
    _over_shards(sums, grads, tdist.ReduceOp.SUM)
    total = 0.0
    for (h, l_), t, m in zip(sums.tolist(), tops, amax.tolist()):
        if not math.isfinite(m):
            total = float("nan") if math.isnan(m) else float("inf")
            break
        if t != NONE:
            total += float(h) * 2.0 ** (BIN * t) + float(l_) * 2.0 ** (BIN * (t - 1))
    norm = torch.tensor(math.sqrt(total) if total >= 0 else total, dtype=torch.float32)
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            _local(g).mul_(coef.to(g.dtype).to(_local(g).device))
    return norm


class ElementwiseAdamW(torch.optim.AdamW):
    """torch's AdamW (its state and checkpoints, decoupled weight decay, bias correction) whose step is single IEEE
    operations per element (mul, add, div, sqrt; no fused kernel, no addcdiv or lerp), so an element's new value
    does not depend on which shard holds it or where: a fused or vectorised kernel rounds an element in a
    vector's body and in the loop's scalar tail differently (measured: FSDP2 shards of 22/22/20 elements, the
    fused AdamW moved 4 elements of 3 bias vectors by one ulp against one process)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            (b1, b2), lr, wd, eps = group["betas"], float(group["lr"]), group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                x, g = _local(p), _local(p.grad)
                m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                if 1.0 - lr * wd != 1.0:  # x * 1.0 is x, bit for bit
                    x.mul_(1.0 - lr * wd)
                root, step = math.sqrt(1.0 - b2 ** t), lr / (1.0 - b1 ** t)
                if not all(y.is_contiguous() for y in (x, g, m, v)):
                    _adamw(x, g, m, v, b1, b2, eps, root, step, torch.empty_like(x), torch.empty_like(x))
                    continue
                # in chunks that stay in cache, the same operations; longer than the fixed point's: 13 calls a
                # chunk (at 32 K elements 946 ms a 30.7 M-parameter step, at 128 K 646, torch's fused AdamW 130-160)
                buffers = fixed_point.scratch(x.dtype, x.device, 2, STEP_CHUNK, n=x.numel())
                for part in fixed_point.chunks(x.numel(), [y.view(-1) for y in (x, g, m, v)], buffers):
                    _adamw(*part[:4], b1, b2, eps, root, step, *part[4:])
        return loss


def _adamw(x, g, m, v, b1: float, b2: float, eps: float, root: float, step: float, t, u) -> None:
    """AdamW's moments and update of x (after its decay), each a single IEEE operation per element, so the bits do not
    depend on how x is cut (chunks, shards); t and u: buffers of x's shape for the temporaries."""
    m.mul_(b1).add_(torch.mul(g, 1.0 - b1, out=t))
    v.mul_(b2).add_(torch.mul(g, g, out=t).mul_(1.0 - b2))
    torch.sqrt(v, out=t).div_(root).add_(eps)
    x.sub_(torch.div(m, t, out=u).mul_(step))


def canonical_sum(keys: list[int], rows: list[list[float]], width: int) -> list[float]:
    """Every rank's `rows` (one vector of `width` numbers per micro-batch, `keys` its canonical place) added in
    canonical order, as fp64: the same numbers on every rank and layout. Ranks that do not count their rows (a
    sequence- or tensor-parallel group's later ranks) pass none."""
    mine = {"key": torch.tensor(keys, dtype=torch.long),
            "rows": torch.tensor(rows, dtype=torch.float64).reshape(len(rows), width)}
    parts = all_gather_tensors(mine)
    every = sorted(zip(torch.cat([p["key"] for p in parts]).tolist(), torch.cat([p["rows"] for p in parts]).tolist()))
    total = [0.0] * width
    for _, row in every:
        total = [a + b for a, b in zip(total, row)]
    return total


def _global_offset(t: torch.Tensor) -> int:
    """The flat index of a local shard's first element in its whole tensor (a Shard(0) DTensor: FSDP2's rows)."""
    if not _is_dtensor(t):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    stride = math.prod(t.shape[1:]) if t.dim() > 1 else 1
    return int(offset[0]) * stride if offset else 0


def weights_hash(params) -> str:
    """A short hash of the parameters' bits (16 hex digits), layout-free: per element (bits mod p) x (a weight of
    its tensor and flat index) mod p, summed, for two weightings; a shard's sum is its part of the whole tensor's,
    so FSDP2's shards add up over the data group and a replicated rank hashes what it holds (a tensor-parallel
    split of a weight's columns hashes each shard as if its elements came first: the same hash on any number of
    data-parallel ranks, not the unsplit model's). The weight is
    (index x c + d_j) mod p, so a tensor's sum is c x (sum of index x bits) + d_j x (sum of bits) mod p: two exact
    integer sums per tensor (fixed_point.hash_sums), whatever the weighting."""
    params = list(params)
    sums = torch.zeros(len(params), 2, dtype=torch.long)
    for j, p in enumerate(params):
        x = _local(p).detach().contiguous().reshape(-1)
        total, moment = fixed_point.hash_sums(x.view(torch.int32) if x.element_size() == 4 else x.view(torch.int16))
        moment += _global_offset(p) * total  # the flat indices of the whole tensor, not of this shard
        for k, (c, d) in enumerate(((48271, 16807), (69621, 40692))):
            sums[j, k] = (c * moment + ((j + 1) * d + 1) * total) % P
    _over_shards(sums, params, tdist.ReduceOp.SUM)
    h = (sums % P).sum(0) % P
    return f"{int(h[0]):08x}{int(h[1]):08x}"


def group_agrees(value: str) -> bool:
    """Whether every training rank computed the same `value` (replicas' weights: a check, one small gather)."""
    return len(set(all_gather_object(value))) == 1 if G.info is not None else True
