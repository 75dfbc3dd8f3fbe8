"""FSDP2's gradient reduce-scatter in fixed point (train.reproducibility=bitwise with parallel.sharding=fsdp): the
layout-free sum of distributed.exact done inside FSDP2's own reduce-scatter, so gradients stay sharded.

FSDP2 reduce-scatters each unit's gradients after every micro-step's backward and adds the result into the sharded
.grad: which micro-batches meet in one reduce-scatter, and the order of the float additions, is the layout. Here each
unit's reduce-scatter (FSDPModule.set_custom_reduce_scatter) is replaced by: the unit's per-parameter top bins
max-reduced over the data group, this rank's accumulated shard bins realigned to them, the input cut into the two
fixed-point bins and reduce-scattered as integer-valued fp64 (exact), added to the shard's bins; FSDP2 gets zeros.
After the mini-batch's last backward, `finish` writes the bins' value into each sharded .grad. The result is the
bits ExactGrads gives a replicated model (same bins, same tops): the reductions agree (the runs
not quite: a replicated model may run a shared prompt once, FSDP2 never; docs/reproducibility.md).

Every unit reduce-scatters every trainable parameter, used or not (set_reduce_scatter_unused_params), so the input's
layout (per rank, each parameter's padded shard in order) is known here. Memory: the shard's bins (16 bytes per
shard element) and a send buffer 4x the unit's fp32 input while it runs. One process (a data group of 1) never
reduce-scatters: train.reduction then deposits .grad after each micro-batch as for a replicated model.

    install(model)              # before training, per sharded model (policy, critic)
    ... backward passes ...
    finish(model)               # .grad = the layout-free sums; the bins reset
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from evenrl.distributed import fixed_point
from evenrl.distributed.exact import NONE, largest, realign, top_bin
from evenrl.distributed.guard import guard

_reduce_scatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


class ExactReduceScatter(DefaultReduceScatter):
    """One FSDP2 unit's reduce-scatter, in fixed point; its shard's bins kept between micro-steps."""

    def __init__(self, unit):
        self.unit = unit
        self.tops: list[int] | None = None
        self.acc: torch.Tensor | None = None  # [2, shard elements]: hi and lo bins of this rank's padded shard
        self.bad = False

    def params(self):
        group = self.unit._get_fsdp_state()._fsdp_param_group
        return [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        fps = self.params()
        sizes = [fp.padded_sharded_param_size.numel() for fp in fps]
        width = tdist.get_world_size(group)
        x = input_tensor.view(width, -1)
        if x.shape[1] != sum(sizes):
            raise RuntimeError(f"exact reduce-scatter: input of {x.shape[1]} elements per rank, parameters of "
                               f"{sum(sizes)}")
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        amax = torch.tensor(largest([x[:, a:b] for a, b in zip(bounds, bounds[1:])]), dtype=torch.float64,
                            device=x.device)
        flags = torch.cat([amax, torch.tensor([0.0 if torch.isfinite(amax).all() else 1.0],
                                              dtype=torch.float64, device=amax.device)])
        flags = torch.nan_to_num(flags, nan=float("inf"))
        with guard("exact reduce-scatter"):
            tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=group)
        self.bad |= bool(flags[-1] > 0)
        if self.tops is None:
            self.tops = [NONE] * len(fps)
            self.acc = torch.zeros(2, x.shape[1], dtype=torch.float64, device=x.device)
        send = torch.empty(width, 2, x.shape[1], dtype=torch.float64, device=x.device)
        for i, (a, b, m) in enumerate(zip(bounds, bounds[1:], flags[:-1].tolist())):
            new = max(self.tops[i], top_bin(m)) if m != float("inf") else self.tops[i]
            realign(self.acc[0, a:b], self.acc[1, a:b], self.tops[i], new)
            self.tops[i] = new
            if new != NONE and m != float("inf"):
                for r in range(width):  # each rank's slice written into its bins (a -0 in hi: see deposit)
                    fixed_point.deposit(send[r, 0, a:b], send[r, 1, a:b], x[r, a:b], new, fresh=True)
            else:
                send[:, :, a:b].zero_()
        out = torch.empty(2 * x.shape[1], dtype=torch.float64, device=x.device)
        with guard("exact reduce-scatter"):
            _reduce_scatter(out, send.view(-1), op=tdist.ReduceOp.SUM, group=group)
        self.acc += out.view(2, -1)
        output_tensor.zero_()
        return None

    def finish(self) -> None:
        """The bins' value into each parameter's sharded .grad (NaN if any term was not finite); bins reset."""
        if self.tops is None:
            return
        at = 0
        for fp, top in zip(self.params(), self.tops):
            n = fp.padded_sharded_param_size.numel()
            grad = fp.sharded_param.grad
            if grad is not None:
                local = grad.to_local()
                if self.bad:
                    local.fill_(float("nan"))
                elif top == NONE:
                    local.zero_()
                else:
                    k = local.numel()
                    out = local.view(-1) if local.is_contiguous() else torch.empty(k, dtype=local.dtype)
                    fixed_point.combine_into(out, self.acc[0, at:at + k], self.acc[1, at:at + k], top)
                    if out.data_ptr() != local.data_ptr():
                        local.copy_(out.view(local.shape))
            at += n
        self.tops, self.acc, self.bad = None, None, False


def _units(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def install(model) -> None:
    """Give every FSDP2 unit of `model` the fixed-point reduce-scatter (a data group of one has none to replace)."""
    for unit in _units(model):
        unit.set_reduce_scatter_unused_params(True)
        unit.set_custom_reduce_scatter(ExactReduceScatter(unit))


def _comm(unit):
    group = unit._get_fsdp_state()._fsdp_param_group
    return None if group is None else group._reduce_scatter_comm


def finish(model) -> None:
    """After a mini-batch's backward passes: every unit's bins into the sharded gradients."""
    for unit in _units(model):
        comm = _comm(unit)
        if isinstance(comm, ExactReduceScatter):
            comm.finish()
