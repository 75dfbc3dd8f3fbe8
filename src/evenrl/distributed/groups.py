"""Who this process is in the job, and its process groups: `init` joins the group the launcher describes and
builds the extra groups reserved rollout ranks need; everything else in evenrl.distributed asks here.

Launch (see evenrl.train.launch): `torchrun --nproc-per-node 3 -m evenrl.cli train CONFIG`, or under Slurm
`srun -N2 --ntasks-per-node 8 evenrl train CONFIG`. `init` reads the rank, world, node and master from
torchrun's or Slurm's variables by the rules of `evenrl.distributed.env`, and joins a process group only when
that environment launched this process as one of several ranks. Start Slurm ranks with srun: a batch script
run without srun is one process. The store is built here, prefixed by the restart count, because a restarted
gloo group otherwise trips over keys left in the shared store by the failed attempt (pytorch#135712).

Groups: with `rollout_devices` R > 0 the last R ranks only generate. Every training collective then runs on the
trainer group (ranks 0..T-1, so a trainer's rank in it is its global rank, and `world()` is T), and the FSDP2 mesh
is built on it (`device_mesh`). Two more meet the rollout ranks: the push group (trainer 0 + the rollout ranks:
the weight push, evenrl.distributed.rollout_link) and a gloo group over the whole world for the samples (point to
point, so a rollout rank can run ahead of the trainers by rollout.max_staleness steps without waiting for them).
With R = 0 the trainer group is the default group and nothing changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

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


@dataclass
class Groups:
    """This process's place in the job, built by `init` and forgotten by `shutdown`: one object instead of module
    globals, so what a rank knows about its groups is in one place."""

    info: DistInfo | None = None
    own_group: bool = False  # init (or device_mesh) built the default group, so shutdown destroys it
    store: Any = None  # the group's store; each rank leaves its current phase there (guard.mark)
    phase: str = "start"  # where this rank last said it was (guard.mark)
    trainers: Any = None  # the trainer group when some ranks only generate; None: the default group
    push: Any = None  # trainer 0 + the rollout ranks: the weight push
    rollout: int = 0  # ranks that only generate (the last ones)
    host_group: Any = None  # the training ranks with gloo beside NCCL: FSDP2's mesh under CPU offload
    samples: Any = None  # gloo group over the whole world: rollouts travel from the rollout ranks to the trainers
    wait: timedelta = field(default_factory=lambda: timedelta(minutes=10))  # the collective timeout, for p2p waits
    sending: list = field(default_factory=list)  # a rollout rank's sends in flight: (work, buffer) kept alive
    sequence: Any = None  # this rank's sequence-parallel group (SequenceGroup) when parallel.sequence_parallel_size > 1

    def reset(self) -> None:
        self.__dict__.update(Groups().__dict__)


G = Groups()


def active() -> bool:
    """Whether a process group exists in this process (built by init, device_mesh or someone else)."""
    return tdist.is_available() and tdist.is_initialized()


def init(backend: str | None = None, *, timeout: float | None = None, rollout_devices: int = 0,
         sequence_parallel: int = 1) -> DistInfo:
    """Join the process group described by the environment (idempotent). backend None: NCCL with CUDA (one GPU per
    process), else gloo.
    timeout: seconds the rendezvous and each collective may wait before failing (default 10 minutes).
    rollout_devices: the last this many ranks only generate (reserved placement); the groups are built here.
    sequence_parallel: the training ranks in consecutive groups of this many split each sample (sequence_group)."""
    if G.info is not None:
        return G.info
    env = read_env()
    lay = env if env.launched else LaunchEnv()  # not one of several launched ranks: one plain process
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", lay.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if active():  # someone else built the group: adopt it
        G.info = DistInfo(tdist.get_rank(), tdist.get_world_size(), lay.local_rank, lay.local_world,
                         lay.node_rank, device, str(tdist.get_backend()))
        return G.info
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
        G.own_group, G.store, G.wait = True, store, wait
        if rollout_devices:
            _reserve(lay.world, rollout_devices, wait)
    else:
        backend = None
    G.info = DistInfo(lay.rank, lay.world, lay.local_rank, lay.local_world, lay.node_rank, device, backend)
    _sequence_groups(sequence_parallel)
    return G.info


def _reserve(world_size: int, r: int, wait: timedelta) -> None:
    """The trainer and push groups for `r` rollout ranks (every rank builds every group: new_group is collective)."""
    if not 0 < r < world_size:
        raise RunStopped(f"--rollout-devices {r}: needs at least one training rank among the {world_size}")
    G.rollout = r
    G.trainers = tdist.new_group(list(range(world_size - r)), timeout=wait)
    G.push = tdist.new_group([0, *range(world_size - r, world_size)], timeout=wait)
    # samples are host-side token ids and log-probs: gloo whatever the training backend
    G.samples = tdist.new_group(list(range(world_size)), timeout=wait, backend="gloo")


def trainer_group():
    """The process group of the training ranks (None: the default group, when no rank is reserved for rollout)."""
    return G.trainers


def rollout_ranks() -> list[int]:
    """Global ranks that only generate ([] when every rank trains)."""
    if not G.rollout:
        return []
    n = tdist.get_world_size()
    return list(range(n - G.rollout, n))


def is_rollout_rank() -> bool:
    return bool(G.rollout) and tdist.get_rank() >= tdist.get_world_size() - G.rollout


def device_mesh(device: torch.device, *, host_collectives: bool = False):
    """The 1-D device mesh over the training ranks that FSDP2 shards on. One process has no group of its own
    (see init), so one is made here: FSDP2 needs a group even to shard over a single rank, and the sharded code path
    is then the same at every world size.
    host_collectives: the mesh's group reduces CPU tensors too (gloo beside NCCL). FSDP2's CPU offload needs it: its
    sharded parameters and gradients live on the host, and the gradient norm and the whole-tensor gathers of such
    DTensors are collectives on CPU tensors, which NCCL refuses ("No backend type associated with device type cpu",
    pytorch#148532)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if host_collectives and device.type != "cpu":
        if G.host_group is None:
            hybrid = f"cpu:gloo,{device.type}:nccl"
            if not active():  # one process: the default group itself gets both backends
                tdist.init_process_group(hybrid, store=tdist.HashStore(), rank=0, world_size=1)
                G.own_group, G.host_group = True, tdist.group.WORLD
            else:  # the training ranks 0..T-1 again (new_group called by them alone)
                G.host_group = tdist.new_group(list(range(world())), backend=hybrid, use_local_synchronization=True)
        return DeviceMesh.from_group(G.host_group, device.type)
    if not active():
        backend = "nccl" if device.type == "cuda" else "gloo"
        tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1,
                                 device_id=device if backend == "nccl" else None)
        G.own_group = True
    if G.trainers is not None:  # reserved rollout ranks: shard over the trainers only
        return DeviceMesh.from_group(G.trainers, device.type)
    return init_device_mesh(device.type, (world(),))


def _sequence_groups(size: int) -> None:
    """The sequence-parallel groups: the training ranks in consecutive runs of `size` (neighbours share a node, where
    the all-to-all is cheapest). Every rank of the job builds every group (new_group is collective), reserved
    rollout ranks too, so this happens here, once."""
    from evenrl.distributed.sequence import SequenceGroup

    trainers = world()
    if size < 1 or trainers % size:
        raise RunStopped(f"parallel.sequence_parallel_size {size} must divide the {trainers} training ranks")
    me = None if is_rollout_rank() else rank()
    group = None
    for start in range(0, trainers, size) if size > 1 else ():
        made = tdist.new_group(list(range(start, start + size)), timeout=G.wait)
        if me is not None and start <= me < start + size:
            group = made
    G.sequence = None if me is None else SequenceGroup(group, size, me % size)


def sequence_group():
    """This training rank's sequence-parallel group (a distributed.sequence.SequenceGroup; size 1 without
    sequence parallelism)."""
    if G.sequence is None:
        _sequence_groups(1)
    return G.sequence


def data_parallel() -> tuple[int, int]:
    """(this rank's data-parallel index, data-parallel groups): the step's schedule hands samples to groups of
    sequence-parallel ranks, which train them together."""
    size = G.sequence.size if G.sequence is not None else 1
    return rank() // size, world() // size


def shutdown() -> None:
    """Leave the process group `init` built (an adopted one stays) and forget `init`'s answer, so the next `init`
    reads the environment again."""
    if G.own_group and active():
        tdist.destroy_process_group()
    G.reset()


def rank() -> int:
    """This rank (global; a trainer's rank in the trainer group is the same number)."""
    return tdist.get_rank() if active() else 0


def world() -> int:
    """Ranks that train: what the step's schedule, gradients and per-sample views span."""
    return tdist.get_world_size() - G.rollout if active() else 1


def is_main() -> bool:
    return rank() == 0


def comm_device() -> torch.device:
    """Where tensors must be for the trainer group's backend: the current GPU under NCCL, else the host."""
    if "nccl" in str(tdist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
