"""The trainers' collectives: barriers, sums, gathers and the gradient all-reduce; and, once at start, every rank's
device (`gather_devices`, over the whole job). One code path for 1 and N ranks: with one process there is no process
group and every function here is the identity, so callers never branch on the world size. Each runs on the trainer
group (evenrl.distributed.mesh) or, where named, one of the mesh's dimensions, inside `guard`, so a failure is one
line.

Gradients are SUM-reduced (`all_reduce_grads`), never averaged: the loss shares of `evenrl.core.aggregation` are
already divided by global counts, so the sum over ranks is the single-device gradient.
"""

from __future__ import annotations

import zlib
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as tdist

from evenrl.distributed.devices import Device, cpu_share, host_memory_gib, model_of
from evenrl.distributed.mesh import G, active, comm_device, group, is_rollout_rank, size, world
from evenrl.distributed.guard import guard

def barrier() -> None:
    if world() > 1 and not is_rollout_rank():  # the trainers' barrier; a rollout rank has no part in it
        with guard("barrier"):
            tdist.barrier(group=G.trainers)


def barrier_all() -> None:
    """Every rank, trainers and reserved rollout ranks: the end of a run. A rollout rank that left after its last
    rollout would tear down its end of the group while the trainers still train and save; seen as an abort
    ("terminate called without an active exception") of that rank, which ended the whole job."""
    if world() > 1:
        with guard("end-of-run barrier"):
            tdist.barrier()


def all_reduce_sum(t: torch.Tensor, over: str = "trainers") -> torch.Tensor:
    """SUM over the training ranks (or over this rank's group of a mesh dimension, `over`), in place; returns t."""
    if size(over) > 1:
        x = _on_comm_device(t)
        with guard("all-reduce"):
            tdist.all_reduce(x, op=tdist.ReduceOp.SUM, group=group(over))
        if x is not t:
            t.copy_(x)
    return t


def _on_comm_device(t: torch.Tensor) -> torch.Tensor:
    """t itself, or a copy where the backend can reduce it (NCCL cannot reduce the CPU tensors that small
    statistics are built in)."""
    dev = comm_device()
    return t if t.device == dev or (dev.type == "cpu" and t.device.type != "cpu") else t.to(dev)


def all_gather_object(obj: Any, over: str = "trainers") -> list:
    """Every rank's `obj`, in rank order: of the training ranks, or of this rank's group of a mesh dimension
    (`over`)."""
    n = size(over)
    if n == 1:
        return [obj]
    out: list = [None] * n
    with guard("all-gather"):
        tdist.all_gather_object(out, obj, group=group(over))
    return out


def broadcast_object(obj: Any, over: str) -> Any:
    """The first rank's `obj` of this rank's group of a mesh dimension (`over`), on every rank of that group (what
    the others pass is ignored)."""
    if size(over) == 1:
        return obj
    box = [obj]
    with guard("broadcast"):
        tdist.broadcast_object_list(box, group=group(over), group_src=0)
    return box[0]


def all_reduce_grads(params: Iterable[torch.nn.Parameter], bucket_mb: float = 64.0, *,
                     extra: Sequence[torch.Tensor] = ()) -> None:
    """SUM gradients over the ranks that hold the same parameters in flat buckets (one collective per bucket, per
    group, device and dtype): the mesh's `data` group (every training rank without tensor parallelism; with it, the
    ranks of this rank's tensor-parallel index, whose shards are this rank's: a DTensor's gradient is reduced as its
    local shard), and for a mixture's experts split by expert parallelism (DTensors on the mesh's "ep" dimension)
    the `edata` group only: the ranks holding the same experts. Their gradients are complete on each rank after the
    backward all-to-all; a sum over the whole data group would add other experts' gradients to them.

    A parameter whose grad is None on some ranks is sent as zeros, so every rank issues the same collectives;
    afterwards it gets the summed grad. Each bucket also carries one 'had a grad' flag per parameter, so a
    parameter unused on every rank keeps grad None, as it would on one device (the optimizer skips it).

    Afterwards a contiguous parameter's grad IS its slice of the reduced bucket, not a copy of it: copying the
    bucket back into the old grads cost ~1 ms of this call's ~11 ms (2.4 M parameters, 2 gloo ranks on a busy
    2-core CPU), and the bucket is freed with the grads (`zero_grad(set_to_none=True)`), so memory is what it
    was. The summed values are the same either way.

    extra: more tensors (any dtype, e.g. a mini-batch's loss statistics) to SUM in place. They are issued with
    the buckets, so the ranks wait once, instead of meeting again later for a tiny all-reduce (each meeting
    costs a thread wake-up on both sides: 0.1 ms on an idle CPU, milliseconds on a busy one).

    Not overlapped with the last backward (DDP-style per-parameter hooks launching buckets early): measured no
    gain on a 2-core CPU with 2 ranks (fwd+bwd+reduce 121-127 ms overlapped vs 121 ms after the backward), since
    gloo's threads and the backward compete for the same cores; and with reentrant activation checkpointing a
    hook fires once per inner backward, before the grad is final. Splitting this model's one 9.6 MB bucket in
    two (two gloo threads) was within noise (~0.5 ms).
    """
    if size("data") == 1:
        return
    groups: dict[tuple, list[list[torch.nn.Parameter]]] = {}
    filled: dict[tuple, int] = {}
    for p in params:
        if not p.requires_grad or size(over := _reduced_over(p)) == 1:
            continue
        k = (over, p.device, p.dtype)
        buckets = groups.setdefault(k, [[]])
        if buckets[-1] and filled[k] + p.nbytes > bucket_mb * 2**20:
            buckets.append([])
            filled[k] = 0
        buckets[-1].append(p)
        filled[k] = filled.get(k, 0) + p.nbytes
    with guard("gradient all-reduce"):
        pending = []
        for (over, device, dtype), buckets in groups.items():
            for ps in buckets:
                n = sum(_numel(p) for p in ps)
                flat = torch.empty(n + len(ps), dtype=dtype, device=device)
                at = 0
                for p in ps:  # written in place: no temporaries, not even zeros for a missing grad
                    if p.grad is None:
                        flat[at:at + _numel(p)].zero_()
                    else:
                        flat[at:at + _numel(p)].copy_(_local(p.grad).reshape(-1))
                    at += _numel(p)
                flat[n:] = torch.tensor([float(p.grad is not None) for p in ps], dtype=dtype)
                work = tdist.all_reduce(flat, op=tdist.ReduceOp.SUM, async_op=True, group=group(over))
                pending.append((ps, flat, work))
        extra_comm = [_on_comm_device(t) for t in extra]
        extra_work = [tdist.all_reduce(x, op=tdist.ReduceOp.SUM, async_op=True, group=group("data"))
                      for x in extra_comm]
        for ps, flat, work in pending:
            work.wait()
            flags = flat[-len(ps):].tolist()
            at = 0
            for p, had in zip(ps, flags):
                piece = flat[at:at + _numel(p)].view(_local(p).shape)
                at += _numel(p)
                if had > 0:
                    if _is_dtensor(p):  # a tensor-parallel shard: the reduced local shard, in the DTensor's layout
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        _local(p.grad).copy_(piece)
                    elif p.is_contiguous():
                        p.grad = piece
                    else:  # keep the parameter's own strides, as autograd would
                        if p.grad is None:
                            p.grad = torch.empty_like(p)
                        p.grad.copy_(piece)
        for t, x, work in zip(extra, extra_comm, extra_work):
            work.wait()
            if x is not t:
                t.copy_(x)


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over parameters whose gradients are sharded over several mesh dimensions
    (tensor parallelism, expert parallelism, either with or without FSDP2): each gradient's squared norm is summed
    over the dimensions it is sharded on and counted once where it is replicated (a norm weight's gradient is whole
    on every rank of its tensor-parallel group, a dense weight's on every rank of an ep group), then the total
    scales every gradient as torch does. Otherwise torch's own (every gradient plain, or every one a DTensor of the
    FSDP2 data mesh)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(_is_dtensor(g) and set(g.device_mesh.mesh_dim_names or ()) - {"data"} for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    by_dims: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        dims = sharded_dims(g)
        key = (id(g.device_mesh), dims) if dims else ()
        by_dims.setdefault(key, [g.device_mesh if dims else None, dims, []])[2].append(_local(g))
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for mesh, dims, local in by_dims.values():
        sq = torch.stack([torch.linalg.vector_norm(x.float()) ** 2 for x in local]).sum()
        for d in dims:  # a sharded placement: this rank holds a part of the squares
            with guard("gradient norm all-reduce"):
                tdist.all_reduce(sq, op=tdist.ReduceOp.SUM, group=mesh.get_group(d))
        total = total + sq
    norm = total.sqrt()
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            _local(g).mul_(coef.to(g.dtype))
    return norm


def sharded_dims(t) -> tuple[int, ...]:
    """The mesh dimensions a DTensor is split on (FSDP2's data, tensor parallelism's tp, both); () for a tensor whole
    on this rank. Sharded: neither replicated nor partial. Not isinstance(Shard): FSDP2 over a tensor-parallel dim 0
    is a _StridedShard, no Shard (torch 2.13), and counting it as whole left out half of a DP 2 x TP 2 norm."""
    if not _is_dtensor(t):
        return ()
    return tuple(i for i, pl in enumerate(t.placements) if not (pl.is_replicate() or pl.is_partial()))


def _reduced_over(p: torch.Tensor) -> str:
    """The mesh dimension a parameter's gradient is summed over: `edata` for experts split over "ep", else `data`."""
    return "edata" if _is_dtensor(p) and "ep" in (p.device_mesh.mesh_dim_names or ()) else "data"


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor is its own)."""
    return t.to_local() if _is_dtensor(t) else t


def _numel(p: torch.Tensor) -> int:
    return _local(p).numel()


def probe_device(device: torch.device, local_world: int) -> Device:
    """This rank's device: a GPU's model and memory (shared evenly when the node runs more processes than it has
    GPUs), or a CPU process's share of the host's memory and the threads torch computes on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        sharing = -(-local_world // torch.cuda.device_count())
        return Device("cuda", model_of(props.name), props.total_memory / 2**30 / sharing)
    return Device("cpu", "cpu", cpu_share(host_memory_gib(), local_world), torch.get_num_threads())


def gather_devices(device: torch.device, local_world: int) -> tuple[Device, ...]:
    """Every rank's device in rank order, the reserved rollout ranks' too: one all-gather over the whole job, at
    start (every rank calls it)."""
    mine = probe_device(device, local_world)
    if not active() or tdist.get_world_size() == 1:
        return (mine,)
    out: list = [None] * tdist.get_world_size()
    with guard("gather of every rank's device"):
        tdist.all_gather_object(out, mine)
    return tuple(out)


# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name); torch >= 2.4 is supported
_all_gather_single = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor


def all_gather_tensors(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every rank's dict of tensors, in rank order, on the CPU (world 1: [tensors]). Every rank passes the same
    names, dtypes and shapes except the first dimension, which may differ (a rank may have no rows); otherwise
    every rank raises ValueError.

    all_gather_object for tensors without pickling them: two all_gathers (sizes, then all bytes at once).
    Pickling was most of all_gather_object's time for a step's per-sample scalars: 6 columns of 16 values on
    2 gloo ranks took ~2.5 ms, ~1.5 ms of it torch's tensor pickling.
    """
    if world() == 1:
        return [tensors]
    names = list(tensors)
    ts = [tensors[k].detach().cpu().contiguous() for k in names]
    tails = [tuple(t.shape[1:]) if t.dim() else None for t in ts]  # None: a 0-d tensor, sent as one row
    fingerprint = zlib.crc32(repr([(k, str(t.dtype), tail) for k, t, tail in zip(names, ts, tails)]).encode())
    rows = torch.tensor([t.shape[0] if t.dim() else 1 for t in ts], dtype=torch.long)
    blob = torch.cat([rows.view(torch.uint8)] + [t.reshape(-1).view(torch.uint8) for t in ts])
    W, dev = world(), comm_device()
    with guard("all-gather of per-sample numbers"):
        heads = torch.empty(W * 2, dtype=torch.long, device=dev)
        _all_gather_single(heads, torch.tensor([fingerprint, blob.numel()], dtype=torch.long, device=dev),
                           group=G.trainers)
        heads = heads.view(W, 2).tolist()
        if any(h[0] != fingerprint for h in heads):  # every rank sees every fingerprint: all raise, none hangs
            raise ValueError("all_gather_tensors: ranks passed different names, dtypes or trailing shapes")
        size = max(h[1] for h in heads)
        send = torch.zeros(size, dtype=torch.uint8, device=dev)
        send[:blob.numel()] = blob.to(dev)
        recv = torch.empty(W * size, dtype=torch.uint8, device=dev)
        _all_gather_single(recv, send, group=G.trainers)
        recv = recv.cpu()
    out = []
    for r in range(W):
        chunk = recv[r * size:(r + 1) * size]
        counts = chunk[:8 * len(ts)].clone().view(torch.long).tolist()  # clone: view(dtype) needs alignment
        at, got = 8 * len(ts), {}
        for k, t, tail, n in zip(names, ts, tails, counts):
            nbytes = n * torch.Size(tail or ()).numel() * t.element_size()
            x = chunk[at:at + nbytes].clone().view(t.dtype)
            got[k] = x.reshape(n, *tail) if tail is not None else x.reshape(())
            at += nbytes
        out.append(got)
    return out
