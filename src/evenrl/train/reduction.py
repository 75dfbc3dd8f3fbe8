"""How one mini-batch's gradients and statistics are summed over its micro-batches and the ranks: a strategy per
trained model, chosen once where the model is parallelized (train.parallelize, from train.reproducibility and what
the plan applied), kept in its ModelPlan (`plan.reduction`), and called by the update (train.update.minibatch_update),
which therefore has no branch on either.

                replicated                                       FSDP2 (parallel.sharding=fsdp)
  rounding      FloatReplicated: one bucketed all-reduce of      FloatSharded: FSDP2 reduce-scattered (summed) the
                the gradients, the statistics riding along       gradients in each backward; the statistics are
                (distributed.ops.all_reduce_grads, extra=)       all-reduced over the data group
  bitwise       ExactBins: each micro-batch's gradient into      ExactSharded: FSDP2's reduce-scatter in fixed
                fixed-point bins, summed once over the ranks     point (distributed.exact_fsdp), written into the
                (distributed.exact.ExactGrads); also FSDP2 on    sharded gradients after the last backward
                a data group of one (no reduce-scatter there)

Both exact ones (docs/reproducibility.md) also seed the global RNG per micro-batch from the mini-batch's seed and
the micro-batch's first sample (dropout's masks the micro-batch's own, on any rank), add the statistics rows in
the micro-batches' canonical order (exact.canonical_sum), and clip by a norm summed in fixed point
(exact.clip_grad_norm). All but FloatReplicated (whose all-reduce keeps None where no rank had a gradient) drop
the gradients of a mini-batch no rank ran and none counted, where filler backwards or the bins left zeros: one
device has no gradient there and takes no step.

Why an object chosen once, not flags tested in the update (torchtitan's `parallelize` picks FSDP, HSDP or DDP for a
model and its train step only calls backward and clip): the choice needs the config and the model's plan (sharded,
its data group of one or more), both known where the model is parallelized and nowhere in the update, which read
`bitwise`, `sharded` and `exact_fsdp.installed` in 9 if-tests. The strategy also cuts the step's micro-batches
(`schedule`), since an exact sum is layout-free only over micro-batches that are: the canonical ones (core.canonical)
for an exact one, make_schedule's (balanced per rank) for a float one. The elementwise AdamW stays with the
optimizer's builder: it is no sum. This module sits in train/, not distributed/: it composes distributed's sums with
the step's rules (the dropout seed, the statistics row, no step without rows), and the seed is engines.base's
keyed_seed.

Per step, `r.schedule(lengths, token_cap=..., fixed_cap=..., world=..., ...)`: its StepSchedule. Per mini-batch, in
this order:
    r.begin(params, seed)               # before the first forward: the parameters as registered now
    r.micro_batch(mb)                   # before each forward of a micro-batch with rows
    r.backward_done()                   # after each backward, a filler's too
    r.add(row)                          # a counted micro-batch's statistics: sums and counts, images, 1.0
    flat = r.finish(params, width, seqs)  # .grad summed over ranks; the rows' global sums (fp64, `width` long)
    norm = r.clip(params, max_norm)
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from evenrl.core.batch import Batch
from evenrl.core.canonical import canonical_schedule
from evenrl.core.model_plan import plan_of
from evenrl.core.schedule import StepSchedule, make_schedule
from evenrl.distributed import collectives as dist
from evenrl.distributed import exact, exact_fsdp, expert_parallel
from evenrl.engines.base import keyed_seed


class Reduction(Protocol):
    def schedule(self, lengths: Sequence[int], *, token_cap, fixed_cap: int | None = None, **kw) -> StepSchedule: ...
    def begin(self, params: list, seed: int) -> None: ...
    def micro_batch(self, mb: Batch) -> None: ...
    def backward_done(self) -> None: ...
    def add(self, row: list[float]) -> None: ...
    def finish(self, params: list, width: int, seqs: float) -> torch.Tensor: ...
    def clip(self, params: list, max_norm: float) -> torch.Tensor: ...


def choose(model, *, bitwise: bool, data: int) -> Reduction:
    """The strategy for a trained model after parallelize applied its plan (FSDP2 or not); `data`: the size of its
    data group. A sharded model's fixed-point reduce-scatter is installed here (a data group of one has none)."""
    sharded = plan_of(model).sharded
    if not bitwise:
        return FloatSharded() if sharded else FloatReplicated()
    if sharded and data > 1:
        exact_fsdp.install(model)
        return ExactSharded(model)
    return ExactBins(every=sharded)


def reduction_of(model) -> Reduction:
    """The strategy parallelize chose for `model`; a float one for a model it was never applied to (a test's)."""
    plan = plan_of(model)
    return plan.reduction or (FloatSharded() if plan.sharded else FloatReplicated())


class _Float:
    """Rounding: statistics rows added as they come (fp64); torch's norm (distributed.ops.clip_grad_norm)."""

    def schedule(self, lengths: Sequence[int], *, token_cap, fixed_cap: int | None = None, **kw) -> StepSchedule:
        """make_schedule's: `token_cap` per rank (a list where ranks differ: parallel.capacity_weights)."""
        return make_schedule(lengths, token_cap=token_cap, **kw)

    def begin(self, params: list, seed: int) -> None:
        self.total: list[float] | None = None

    def micro_batch(self, mb: Batch) -> None:
        pass

    def backward_done(self) -> None:
        pass

    def add(self, row: list[float]) -> None:
        self.total = [0.0] * len(row) if self.total is None else self.total
        for i, v in enumerate(row):
            self.total[i] += v

    def _flat(self, width: int) -> torch.Tensor:
        return torch.tensor(self.total or [0.0] * width, dtype=torch.float64)

    def clip(self, params: list, max_norm: float) -> torch.Tensor:
        return dist.clip_grad_norm(params, max_norm)


class FloatReplicated(_Float):
    def finish(self, params: list, width: int, seqs: float) -> torch.Tensor:
        flat = self._flat(width)
        dist.all_reduce_grads(params, extra=[flat])  # one wait for both instead of a second meeting
        return flat


class FloatSharded(_Float):
    def finish(self, params: list, width: int, seqs: float) -> torch.Tensor:
        flat = self._flat(width)  # the gradients were reduce-scattered in each backward: the statistics are left
        dist.all_reduce_sum(flat, over="data")
        _no_rows_no_step(params, flat, seqs)
        return flat


class _Exact:
    """Bitwise: the same bits on any layout (module docstring)."""

    def schedule(self, lengths: Sequence[int], *, token_cap, fixed_cap: int | None = None, **kw) -> StepSchedule:
        """The canonical one, whole micro-batches cut by `fixed_cap` (the config's cap alone, the same on any
        layout; `token_cap` where not given)."""
        return canonical_schedule(lengths, token_cap=token_cap if fixed_cap is None else fixed_cap, **kw)

    def begin(self, params: list, seed: int) -> None:
        self.seed, self.key, self.keyed = seed, 0, []

    def micro_batch(self, mb: Batch) -> None:
        self.key = int(mb["sample_index"][0])  # its canonical place
        torch.manual_seed(keyed_seed("evenrl-micro-batch", self.seed, self.key) >> 1)

    def backward_done(self) -> None:
        pass

    def add(self, row: list[float]) -> None:
        self.keyed.append((self.key, row))

    def _flat(self, width: int) -> torch.Tensor:
        return torch.tensor(exact.canonical_sum([k for k, _ in self.keyed], [r for _, r in self.keyed], width),
                            dtype=torch.float64)

    def clip(self, params: list, max_norm: float) -> torch.Tensor:
        return exact.clip_grad_norm(params, max_norm)


class ExactBins(_Exact):
    """`every`: a parameter no forward used gets zeros, not None, as FSDP2's fixed-point reduce-scatter gives it
    (a sharded model on one process the same as on several)."""

    def __init__(self, every: bool = False):
        self.every = every

    def begin(self, params: list, seed: int) -> None:
        super().begin(params, seed)
        self.bins = exact.ExactGrads(params, every=self.every)

    def backward_done(self) -> None:
        self.bins.deposit(more=expert_parallel.take_terms())  # experts split over "ep": a term per source rank

    def finish(self, params: list, width: int, seqs: float) -> torch.Tensor:
        flat = self._flat(width)
        self.bins.reduce()
        _no_rows_no_step(params, flat, seqs)
        return flat


class ExactSharded(_Exact):
    def __init__(self, model):
        self.model = model

    def finish(self, params: list, width: int, seqs: float) -> torch.Tensor:
        flat = self._flat(width)
        exact_fsdp.finish(self.model)
        _no_rows_no_step(params, flat, seqs)
        return flat


def _no_rows_no_step(params: list, flat: torch.Tensor, seqs: float) -> None:
    """No micro-batch ran on any rank (flat[-1], the rows' count) and none counts (`seqs`): what one device has
    here is no gradient at all, no step, where the filler backwards left zeros."""
    if flat[-1] == 0 and seqs == 0:
        for p in params:
            p.grad = None
