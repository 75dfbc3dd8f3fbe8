"""All collectives of evenrl. One code path for 1 and N ranks: with one process there is no process group and
every function below is the identity (or a local select), so callers never branch on the world size.

Launch (see evenrl.train.launch): `torchrun --nproc-per-node 3 -m evenrl.cli train CONFIG`, or under Slurm
`srun -N2 --ntasks-per-node 8 evenrl train CONFIG`. `init` reads the rank, world, node and master from
torchrun's or Slurm's variables by the rules of `evenrl.distributed.env`, and joins a process group only when
that environment launched this process as one of several ranks. Start Slurm ranks with srun: a batch script
run without srun is one process. The store is built here, prefixed by the restart count, because a restarted
gloo group otherwise trips over keys left in the shared store by the failed attempt (pytorch#135712).

Gradients are SUM-reduced (`all_reduce_grads`), never averaged: the loss shares of `evenrl.core.aggregation` are
already divided by global counts, so the sum over ranks is the single-device gradient.

A collective that fails (a peer died: at once; a peer stopped: after `timeout` seconds) raises RunStopped with one
line saying which phase this rank was in and where each other rank last said it was (`mark` leaves a rank's phase
in the group's store), instead of a backend traceback after a fixed 10 minutes.

Groups (all built here, in `init`): with `rollout_devices` R > 0 the last R ranks only generate. Every training
collective below then runs on the trainer group (ranks 0..T-1, so a trainer's rank in it is its global rank, and
`world()` is T), and the FSDP2 mesh is built on it (`device_mesh`). Two more meet the rollout ranks: the push group
(trainer 0 + the rollout ranks: `push_weights`, received on a rollout rank by `WeightReceiver`'s thread) and a gloo
group over the whole world for the samples (`send_rollouts` / `receive_rollouts`, point to point, so a rollout
rank can run ahead of the trainers by rollout.max_staleness steps without waiting for them). With R = 0 the trainer
group is the default group and nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import re
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as tdist

from evenrl.core.batch import SAMPLE_INDEX, Batch, Ragged
from evenrl.distributed.env import LaunchEnv, read_env
from evenrl.errors import RunStopped


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    local_world: int
    node_rank: int
    device: torch.device
    backend: str | None  # None: world 1 without a process group


_INFO: DistInfo | None = None
_OWN_GROUP = False
_STORE = None  # the group's store; each rank leaves its current phase there (mark)
_PHASE = "start"
_TRAINERS = None  # the trainer group when some ranks only generate; None: the default group
_PUSH = None  # trainer 0 + the rollout ranks: the weight push
_ROLLOUT = 0  # ranks that only generate (the last ones)
_HOST_GROUP = None  # the training ranks with gloo beside NCCL: FSDP2's mesh under CPU offload (device_mesh)
_SAMPLES = None  # gloo group over the whole world: rollouts travel from the rollout ranks to the trainers in it
_WAIT = timedelta(minutes=10)  # the collective timeout, for point-to-point waits
_SENDING: list = []  # a rollout rank's sends still in flight: (work, buffer), the buffer kept alive until done


def _active() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def init(backend: str | None = None, *, timeout: float | None = None, rollout_devices: int = 0) -> DistInfo:
    """Join the process group described by the environment (idempotent). backend None: NCCL with CUDA (one GPU per
    process), else gloo.
    timeout: seconds the rendezvous and each collective may wait before failing (default 10 minutes).
    rollout_devices: the last this many ranks only generate (reserved placement); the groups are built here."""
    global _INFO, _OWN_GROUP, _STORE
    if _INFO is not None:
        return _INFO
    env = read_env()
    lay = env if env.launched else LaunchEnv()  # not one of several launched ranks: one plain process
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", lay.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if _active():  # someone else built the group: adopt it
        _INFO = DistInfo(tdist.get_rank(), tdist.get_world_size(), lay.local_rank, lay.local_world,
                         lay.node_rank, device, str(tdist.get_backend()))
        return _INFO
    if lay.world > 1:
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): with more processes on a node than GPUs (a
        # trainer and a rollout process sharing one, say) the collectives go through gloo, on host copies. CUDA
        # only; run on one H100 by benchmarks/overlap.py --shape qwen2.5-0.5b.
        shared = cuda and lay.local_world > torch.cuda.device_count()
        backend = backend or ("nccl" if cuda and not shared else "gloo")
        wait = timedelta(seconds=timeout) if timeout else timedelta(minutes=10)
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
        store = tdist.TCPStore(lay.master_addr, lay.master_port, lay.world, is_master=lay.rank == 0 and not agent,
                               timeout=wait, multi_tenant=not agent)
        store = tdist.PrefixStore(f"evenrl/restart{lay.restart_count}", store)
        tdist.init_process_group(backend, store=store, rank=lay.rank, world_size=lay.world, timeout=wait,
                                 device_id=device if backend == "nccl" else None)
        _OWN_GROUP, _STORE = True, store
        global _WAIT
        _WAIT = wait
        if rollout_devices:
            _reserve(lay.world, rollout_devices, wait)
    else:
        backend = None
    _INFO = DistInfo(lay.rank, lay.world, lay.local_rank, lay.local_world, lay.node_rank, device, backend)
    return _INFO


def _reserve(world_size: int, r: int, wait: timedelta) -> None:
    """The trainer and push groups for `r` rollout ranks (every rank builds every group: new_group is collective)."""
    global _TRAINERS, _PUSH, _ROLLOUT, _SAMPLES
    if not 0 < r < world_size:
        raise RunStopped(f"--rollout-devices {r}: needs at least one training rank among the {world_size}")
    _ROLLOUT = r
    _TRAINERS = tdist.new_group(list(range(world_size - r)), timeout=wait)
    _PUSH = tdist.new_group([0, *range(world_size - r, world_size)], timeout=wait)
    # samples are host-side token ids and log-probs: gloo whatever the training backend
    _SAMPLES = tdist.new_group(list(range(world_size)), timeout=wait, backend="gloo")


def trainer_group():
    """The process group of the training ranks (None: the default group, when no rank is reserved for rollout)."""
    return _TRAINERS


def rollout_ranks() -> list[int]:
    """Global ranks that only generate ([] when every rank trains)."""
    if not _ROLLOUT:
        return []
    n = tdist.get_world_size()
    return list(range(n - _ROLLOUT, n))


def is_rollout_rank() -> bool:
    return bool(_ROLLOUT) and tdist.get_rank() >= tdist.get_world_size() - _ROLLOUT


def device_mesh(device: torch.device, *, host_collectives: bool = False):
    """The 1-D device mesh over the training ranks that FSDP2 shards on. One process has no group of its own
    (see init), so one is made here: FSDP2 needs a group even to shard over a single rank, and the sharded code path
    is then the same at every world size.
    host_collectives: the mesh's group reduces CPU tensors too (gloo beside NCCL). FSDP2's CPU offload needs it: its
    sharded parameters and gradients live on the host, and the gradient norm and the whole-tensor gathers of such
    DTensors are collectives on CPU tensors, which NCCL refuses ("No backend type associated with device type cpu",
    pytorch#148532)."""
    global _OWN_GROUP, _HOST_GROUP
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if host_collectives and device.type != "cpu":
        if _HOST_GROUP is None:
            hybrid = f"cpu:gloo,{device.type}:nccl"
            if not _active():  # one process: the default group itself gets both backends
                tdist.init_process_group(hybrid, store=tdist.HashStore(), rank=0, world_size=1)
                _OWN_GROUP, _HOST_GROUP = True, tdist.group.WORLD
            else:  # the training ranks 0..T-1 again (new_group called by them alone)
                _HOST_GROUP = tdist.new_group(list(range(world())), backend=hybrid, use_local_synchronization=True)
        return DeviceMesh.from_group(_HOST_GROUP, device.type)
    if not _active():
        backend = "nccl" if device.type == "cuda" else "gloo"
        tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1,
                                 device_id=device if backend == "nccl" else None)
        _OWN_GROUP = True
    if _TRAINERS is not None:  # reserved rollout ranks: shard over the trainers only
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(_TRAINERS, device.type)
    return init_device_mesh(device.type, (world(),))


def shutdown() -> None:
    """Leave the process group `init` built (an adopted one stays) and forget `init`'s answer, so the next `init`
    reads the environment again."""
    global _INFO, _OWN_GROUP, _STORE, _TRAINERS, _PUSH, _ROLLOUT, _SAMPLES
    if _OWN_GROUP and _active():
        tdist.destroy_process_group()
    _INFO, _OWN_GROUP, _STORE, _TRAINERS, _PUSH, _ROLLOUT, _SAMPLES = None, False, None, None, None, 0, None
    global _HOST_GROUP
    _HOST_GROUP = None
    _SENDING.clear()


def rank() -> int:
    """This rank (global; a trainer's rank in the trainer group is the same number)."""
    return tdist.get_rank() if _active() else 0


def world() -> int:
    """Ranks that train: what the step's schedule, gradients and per-sample views span."""
    return tdist.get_world_size() - _ROLLOUT if _active() else 1


def is_main() -> bool:
    return rank() == 0


def mark(phase: str) -> None:
    """Say where this rank is (e.g. "step 3 exchange"): kept here and, with several ranks, in the group's store,
    so that a failed collective on any rank can name the peer that stopped and where (one small store write)."""
    global _PHASE
    _PHASE = phase
    if _STORE is not None:
        try:
            _STORE.set(f"phase/{rank()}", phase)
        except Exception:  # the store's host (rank 0) is gone: the next collective fails and says so in one line
            pass


@contextlib.contextmanager
def guard(op: str):
    """A backend error inside a collective becomes one RunStopped line: this rank, its phase, the operation, the
    backend's reason, and where the other ranks last were."""
    t0 = time.monotonic()
    try:
        yield
    except RuntimeError as e:
        if not _active() or tdist.get_world_size() == 1:
            raise
        reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [type(e).__name__])[0])[:160]
        raise RunStopped(f"rank {rank()} in {_PHASE}: {op} failed after {time.monotonic() - t0:.0f} s ({reason}); "
                         f"{_whereabouts()}") from None


def _whereabouts() -> str:
    """Where each other rank last said it was. The store lives on rank 0 (or torchrun's agent), which may itself be
    gone; nothing here waits for long."""
    try:
        _STORE.set_timeout(timedelta(seconds=5))
        seen = {r: _STORE.get(f"phase/{r}").decode() if _STORE.check([f"phase/{r}"]) else "not started"
                for r in range(tdist.get_world_size()) if r != rank()}
    except Exception:  # the store's host is gone too
        return "the rendezvous store (on rank 0 or the launcher) is unreachable: rank 0 may have stopped or died"
    behind = {r: p for r, p in seen.items() if p != _PHASE}
    if not behind:
        return f"every other rank also reached {_PHASE}"
    return "; ".join(f"rank {r} was last in {p}" for r, p in behind.items()) + " (stopped, died or still busy)"


def _comm_device() -> torch.device:
    if "nccl" in str(tdist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if world() > 1 and not is_rollout_rank():  # the trainers' barrier; a rollout rank has no part in it
        with guard("barrier"):
            tdist.barrier(group=_TRAINERS)


def barrier_all() -> None:
    """Every rank, trainers and reserved rollout ranks: the end of a run. A rollout rank that left after its last
    rollout would tear down its end of the group while the trainers still train and save; seen as an abort
    ("terminate called without an active exception") of that rank, which ended the whole job."""
    if world() > 1:
        with guard("end-of-run barrier"):
            tdist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """SUM over ranks, in place; returns t."""
    if world() > 1:
        x = _on_comm_device(t)
        with guard("all-reduce"):
            tdist.all_reduce(x, op=tdist.ReduceOp.SUM, group=_TRAINERS)
        if x is not t:
            t.copy_(x)
    return t


def _on_comm_device(t: torch.Tensor) -> torch.Tensor:
    """t itself, or a copy where the backend can reduce it (NCCL cannot reduce the CPU tensors that small
    statistics are built in)."""
    dev = _comm_device()
    return t if t.device == dev or (dev.type == "cpu" and t.device.type != "cpu") else t.to(dev)


def all_gather_object(obj: Any) -> list:
    if world() == 1:
        return [obj]
    out: list = [None] * world()
    with guard("all-gather"):
        tdist.all_gather_object(out, obj, group=_TRAINERS)
    return out


def all_reduce_grads(params: Iterable[torch.nn.Parameter], bucket_mb: float = 64.0, *,
                     extra: Sequence[torch.Tensor] = ()) -> None:
    """SUM gradients over ranks in flat buckets (one collective per bucket, per device and dtype).

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
    if world() == 1:
        return
    groups: dict[tuple, list[list[torch.nn.Parameter]]] = {}
    filled: dict[tuple, int] = {}
    for p in params:
        if not p.requires_grad:
            continue
        k = (p.device, p.dtype)
        buckets = groups.setdefault(k, [[]])
        if buckets[-1] and filled[k] + p.nbytes > bucket_mb * 2**20:
            buckets.append([])
            filled[k] = 0
        buckets[-1].append(p)
        filled[k] = filled.get(k, 0) + p.nbytes
    with guard("gradient all-reduce"):
        pending = []
        for (device, dtype), buckets in groups.items():
            for ps in buckets:
                n = sum(p.numel() for p in ps)
                flat = torch.empty(n + len(ps), dtype=dtype, device=device)
                at = 0
                for p in ps:  # written in place: no temporaries, not even zeros for a missing grad
                    if p.grad is None:
                        flat[at:at + p.numel()].zero_()
                    else:
                        flat[at:at + p.numel()].copy_(p.grad.reshape(-1))
                    at += p.numel()
                flat[n:] = torch.tensor([float(p.grad is not None) for p in ps], dtype=dtype)
                pending.append((ps, flat, tdist.all_reduce(flat, op=tdist.ReduceOp.SUM, async_op=True, group=_TRAINERS)))
        extra_comm = [_on_comm_device(t) for t in extra]
        extra_work = [tdist.all_reduce(x, op=tdist.ReduceOp.SUM, async_op=True, group=_TRAINERS)
                      for x in extra_comm]
        for ps, flat, work in pending:
            work.wait()
            flags = flat[-len(ps):].tolist()
            at = 0
            for p, had in zip(ps, flags):
                piece = flat[at:at + p.numel()].view(p.shape)
                at += p.numel()
                if had > 0:
                    if p.is_contiguous():
                        p.grad = piece
                    else:  # keep the parameter's own strides, as autograd would
                        if p.grad is None:
                            p.grad = torch.empty_like(p)
                        p.grad.copy_(piece)
        for t, x, work in zip(extra, extra_comm, extra_work):
            work.wait()
            if x is not t:
                t.copy_(x)


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
    W, dev = world(), _comm_device()
    with guard("all-gather of per-sample numbers"):
        heads = torch.empty(W * 2, dtype=torch.long, device=dev)
        _all_gather_single(heads, torch.tensor([fingerprint, blob.numel()], dtype=torch.long, device=dev),
                           group=_TRAINERS)
        heads = heads.view(W, 2).tolist()
        if any(h[0] != fingerprint for h in heads):  # every rank sees every fingerprint: all raise, none hangs
            raise ValueError("all_gather_tensors: ranks passed different names, dtypes or trailing shapes")
        size = max(h[1] for h in heads)
        send = torch.zeros(size, dtype=torch.uint8, device=dev)
        send[:blob.numel()] = blob.to(dev)
        recv = torch.empty(W * size, dtype=torch.uint8, device=dev)
        _all_gather_single(recv, send, group=_TRAINERS)
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


# ---- exchange -------------------------------------------------------------------------------------------
def _pieces(b: Batch) -> list[torch.Tensor]:
    out = []
    for name in b.keys():
        col = b[name]
        if isinstance(col, Ragged):
            out += [col.values, col.lengths]
        elif isinstance(col, torch.Tensor):
            out.append(col)
    return out


def _schema(b: Batch) -> tuple[list, int]:
    shapes = [(t.dtype, tuple(t.shape[1:]), t.device) for t in _pieces(b)]
    text = repr([(n, type(b[n]).__name__) for n in b.keys()] + [(str(d), s) for d, s, _ in shapes])
    return shapes, zlib.crc32(text.encode()) & 0x7FFFFFFF


def _rebuild(template: Batch, tensors: list[torch.Tensor], lists: dict) -> Batch:
    cols: dict[str, Any] = {}
    it = iter(tensors)
    for name in template.keys():
        col = template[name]
        if isinstance(col, Ragged):
            cols[name] = Ragged(next(it), next(it))
        elif isinstance(col, torch.Tensor):
            cols[name] = next(it)
        else:
            cols[name] = lists[name]
    return Batch(cols)


def _pack(p: Batch, dev: torch.device) -> torch.Tensor:
    """One destination's rows as self-describing bytes: int64 (rows of each piece, length of the pickled list
    columns), then the pieces' bytes, then the pickle. The receiver reads the counts with its own schema, which
    the header collective has checked to be the sender's."""
    pieces = [t.contiguous().reshape(-1).view(torch.uint8) for t in _pieces(p)]
    lists = {n: p[n] for n in p.keys() if isinstance(p[n], list)}
    blob = pickle.dumps(lists) if lists else b""
    counts = torch.tensor([t.shape[0] for t in _pieces(p)] + [len(blob)], dtype=torch.long)
    if blob:
        pieces.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    return torch.cat([x.to(dev) for x in [counts.view(torch.uint8), *pieces]])


def _unpack(chunk: torch.Tensor, template: Batch, shapes: list) -> Batch:
    at = 8 * (len(shapes) + 1)
    h = chunk[:at].clone().view(torch.long).tolist()  # clone: view(dtype) needs an aligned offset
    tensors = []
    for n, (dtype, shape, device) in zip(h[:-1], shapes):
        size = n * torch.Size(shape).numel() * dtype.itemsize
        piece = chunk[at:at + size].clone()  # clone: view(dtype) needs an aligned offset
        tensors.append(piece.view(dtype).reshape(n, *shape).to(device))
        at += size
    lists = pickle.loads(chunk[at:at + h[-1]].cpu().numpy().tobytes()) if h[-1] else {}
    return _rebuild(template, tensors, lists)


def _exchange_all_to_all(parts: list[Batch] | None, template: Batch, problem: str | None = None) -> list[Batch]:
    """Two all_to_all_single calls. First 3 int64 per pair of ranks: the sender's schema fingerprint, whether its
    arguments were bad (`problem`; then parts is None and it sends nothing), and how many bytes follow. Every rank
    sees every other rank's fingerprint and flag, so a mistake anywhere raises ValueError on every rank before any
    data moves, and this check costs no collective of its own.
    Then all rows at once, each part with its own row counts in front (see _pack)."""
    W, dev = world(), _comm_device()
    shapes, fingerprint = _schema(template)
    empty = torch.zeros(0, dtype=torch.uint8, device=dev)
    sends = [_pack(p, dev) for p in parts] if parts is not None and problem is None else [empty] * W
    head = torch.tensor([[fingerprint, problem is not None, x.numel()] for x in sends], dtype=torch.long, device=dev)
    got = torch.empty_like(head)
    tdist.all_to_all_single(got, head, group=_TRAINERS)
    got = got.tolist()
    if problem:
        raise ValueError(problem)
    if any(g[1] for g in got):
        raise ValueError("exchange: another rank passed bad arguments (see its error)")
    if any(g[0] != fingerprint for g in got):
        raise ValueError(_SCHEMA_MISMATCH)
    sizes = [g[2] for g in got]
    recv = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    tdist.all_to_all_single(recv, torch.cat(sends), sizes, [x.numel() for x in sends], group=_TRAINERS)
    return [_unpack(chunk, template, shapes) for chunk in recv.split(sizes)]


_SCHEMA_MISMATCH = ("exchange: ranks hold batches with different columns/dtypes; give a rank without rows an empty "
                    "batch with the same columns, e.g. batch.select([])")


def _exchange_objects(parts: list[Batch], template: Batch) -> list[Batch]:
    """Fallback for backends without all_to_all: every rank receives everything and keeps its share."""
    gathered = all_gather_object([p.to("cpu").to_dict() for p in parts])
    out = []
    for g in gathered:
        b = Batch.from_dict(g[rank()])
        cols: dict[str, Any] = {}
        for n in b.keys():
            c, t = b[n], template[n]
            if isinstance(c, Ragged):
                c = Ragged(c.values.to(t.values.device), c.lengths.to(t.lengths.device))
            elif isinstance(c, torch.Tensor):
                c = c.to(t.device)
            cols[n] = c
        out.append(Batch(cols))
    return out


def exchange(local: Batch, dest: Sequence[int], *, key: str = SAMPLE_INDEX) -> Batch:
    """Send local row i to rank dest[i]; return the rows this rank received, sorted by the int column `key`.

    Every rank must call it (a rank with no rows passes an empty batch with the same columns). Arguments and
    columns are checked on all ranks first (a mismatch raises ValueError everywhere). gloo/NCCL/MPI: two
    all_to_all_single, the first of which also carries that check (each row crosses the network once; measured
    4-12x faster than all_gather_object on gloo, 3 ranks). Other backends: an all-reduce for the check, then
    all_gather_object.
    """
    W = world()
    d = torch.as_tensor(list(dest), dtype=torch.long)
    problem = None
    if len(d) != len(local):
        problem = f"exchange: {len(d)} destinations for {len(local)} rows"
    elif key not in local:
        problem = f"exchange: the batch has no {key!r} column to order rows by"
    elif d.numel() and (int(d.min()) < 0 or int(d.max()) >= W):
        problem = f"exchange: destinations must be ranks 0..{W - 1}"
    parts = None
    if problem is None and W > 1:
        order = torch.argsort(d, stable=True)
        parts = local.select(order).split(torch.bincount(d, minlength=W).tolist())
    if W == 1:
        if problem:
            raise ValueError(problem)
        return local.select(torch.argsort(local[key].cpu(), stable=True))
    with guard("exchange"):
        if any(b in str(tdist.get_backend()) for b in ("gloo", "nccl", "mpi")):
            received = Batch.concat(_exchange_all_to_all(parts, local, problem))  # agrees on arguments first
        else:  # agree first, so a mistake on one rank fails every rank instead of hanging the others
            fingerprint = _schema(local)[1]
            check = torch.tensor([fingerprint, -fingerprint, problem is not None], dtype=torch.long,
                                 device=_comm_device())
            tdist.all_reduce(check, op=tdist.ReduceOp.MAX, group=_TRAINERS)
            if problem is None and check[2]:
                problem = "exchange: another rank passed bad arguments (see its error)"
            elif problem is None and check.tolist()[:2] != [fingerprint, -fingerprint]:
                problem = _SCHEMA_MISMATCH
            if problem:
                raise ValueError(problem)
            received = Batch.concat(_exchange_objects(parts, local))
    return received.select(torch.argsort(received[key].cpu(), stable=True))


# ---- reserved rollout ranks --------------------------------------------------------------------------------
def push_weights(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The weight push to the rollout ranks, bucket by bucket over the push group (gloo on CPU, NCCL on GPU), each
    bucket one broadcast per dtype from trainer 0. Trainer 0 passes the weights to send; other trainers pass the
    weights and send nothing (a sharded model's gathers still need them); a rollout rank receives with
    `WeightReceiver`. Yields each bucket once it is sent. A rollout rank that stopped fails this within the
    collective timeout, in one line naming where each rank was (RunStopped), instead of hanging a broadcast."""
    for bucket in buckets:
        if rank() == 0 and _PUSH is not None:
            with guard("weight push"):
                for dtype in dict.fromkeys(t.dtype for _, t in bucket):
                    flat = torch.cat([t.reshape(-1) for _, t in bucket if t.dtype == dtype]).to(_comm_device())
                    tdist.broadcast(flat, src=0, group=_PUSH)
        yield bucket


class WeightSender:
    """Trainer 0's end of the push when generation runs ahead of training (rollout.max_staleness >= 1): `send`
    copies a version's buckets to host memory, then a thread broadcasts them while the trainers go on with the
    step. The copy fixes the version (the update that follows cannot change what is sent), so the push costs the
    trainers a copy instead of the broadcast. At most one push is in flight (`send` waits for the one before):
    memory for one copy of the weights in host RAM on trainer 0. A failed broadcast stops the run at the next
    `send` or `wait`, in one line."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> list[list[tuple[str, torch.Tensor]]]:
        """Start pushing `buckets` (consumed here, so a sharded model's gathers happen now, on every trainer);
        returns the host copy."""
        self.wait()
        staged = [[(name, t.to("cpu", copy=True)) for name, t in bucket] for bucket in buckets]
        self.thread = threading.Thread(target=self._run, args=(staged,), name="evenrl-weight-sender", daemon=True)
        self.thread.start()
        return staged

    def _run(self, staged) -> None:
        try:
            for _ in push_weights(staged):
                pass
        except BaseException as e:  # raised by the main thread in wait()
            self.error = e

    def wait(self) -> None:
        """The push in flight, if any, done (or its failure raised here)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, RunStopped):
                raise error
            raise RunStopped(f"rank {rank()}: weight push failed ({_last(error)})")


def _last(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


class WeightReceiver:
    """A rollout rank's end of `push_weights`: a thread that receives each push as soon as trainer 0 sends it, into
    fresh buffers, and queues it, while this rank keeps generating with the weights it has. So the trainer never
    waits for a busy rollout rank, and a rank generating step t+k holds the pushes meant for later steps until it
    gets there (at most rollout.max_staleness of them, the memory it costs).

    layout: the push's buckets as [(name, shape, dtype)], the order and bucket size push_weights sends (the
    rollout rank's own copy's full_weights). count: how many pushes the run makes."""

    def __init__(self, layout: list[list[tuple[str, torch.Size, torch.dtype]]], count: int):
        self.layout, self.count = layout, count
        self.device = _comm_device()  # here: the CUDA device is per thread, and the receiver's starts at cuda:0
        self.ready: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="evenrl-weight-receiver", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dev = self.device
        try:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            for _ in range(self.count):
                buckets = []
                for spec in self.layout:
                    bucket = [(name, torch.empty(shape, dtype=dtype)) for name, shape, dtype in spec]
                    for dtype in dict.fromkeys(t.dtype for _, t in bucket):
                        ts = [t for _, t in bucket if t.dtype == dtype]
                        flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=dev)
                        tdist.broadcast(flat, src=0, group=_PUSH)
                        flat = flat.cpu()
                        at = 0
                        for t in ts:
                            t.copy_(flat[at:at + t.numel()].view(t.shape))
                            at += t.numel()
                    buckets.append(bucket)
                self.ready.put(buckets)
        except BaseException as e:  # handed to the main thread, which raises it in its own phase
            self.ready.put(e)

    def next(self) -> list[list[tuple[str, torch.Tensor]]]:
        """The next push's buckets (on the CPU), waiting for it within the collective timeout."""
        t0 = time.monotonic()
        try:
            got = self.ready.get(timeout=_WAIT.total_seconds())
        except queue.Empty:
            got = RuntimeError("no weights arrived")
        if isinstance(got, BaseException):
            raise RunStopped(f"rank {rank()} in {_PHASE}: weight push failed after {time.monotonic() - t0:.0f} s "
                             f"({_last(got)}); {_whereabouts()}")
        return got

    def join(self) -> None:
        self.thread.join()


def send_rollouts(step: int, version: int, per_trainer: list[list]) -> None:
    """A rollout rank sends each trainer its share of this rank's samples of `step` (made by the policy after step
    `version`), point to point, without waiting for the trainers to take them: they arrive when the trainers reach
    that step. The payload is pickled completions (this job's own ranks, like all_gather_object)."""
    done = [(w, b) for w, b in _SENDING if w.is_completed()]
    for item in done:
        _SENDING.remove(item)
    with guard("send of rollouts"):
        for trainer, completions in enumerate(per_trainer):
            blob = torch.frombuffer(bytearray(pickle.dumps((step, version, completions))), dtype=torch.uint8)
            head = torch.tensor([blob.numel()], dtype=torch.long)
            for t in (head, blob):
                _SENDING.append((tdist.isend(t, dst=trainer, group=_SAMPLES), t))


def receive_rollouts(step: int) -> list[tuple[int, list]]:
    """A trainer's share of `step`'s samples from each rollout rank, in rank order: [(version, completions)].
    A rollout rank that stopped fails this within the collective timeout, in one line (RunStopped)."""
    out = []
    with guard("receive of rollouts"):
        for src in rollout_ranks():
            head = torch.empty(1, dtype=torch.long)
            tdist.irecv(head, src=src, group=_SAMPLES).wait(_WAIT)
            blob = torch.empty(int(head), dtype=torch.uint8)
            tdist.irecv(blob, src=src, group=_SAMPLES).wait(_WAIT)
            sent_step, version, completions = pickle.loads(blob.numpy().tobytes())
            if sent_step != step:
                raise RunStopped(f"rank {rank()}: rollout rank {src} sent the samples of step {sent_step} where "
                                 f"step {step} was due")
            out.append((version, completions))
    return out


def finish_sends() -> None:
    """A rollout rank's last sends taken by the trainers (their buffers must live until then)."""
    with guard("send of rollouts"):
        for work, _ in _SENDING:
            work.wait(_WAIT)
    _SENDING.clear()
