"""The job's one mesh: who this process is and every process group evenrl uses, built once by `init` from the
launch environment and the config's parallel sizes (`evenrl.distributed.mesh_shape.MeshShape`: dp x sp x tp over
the training ranks, reserved rollout ranks after them, rollout engines over several devices). No other module
builds a process group: the gradient reduction and FSDP2's shards (`data`), Ulysses (`sp`), tensor parallelism
(`tp`), the ranks that train the same samples (`replica`), rollout engines (`engine`), expert parallelism (`ep`:
the ranks that split a mixture's experts; `edata`: those holding the same experts), the reserved ranks' push and
sample groups, and the torch DeviceMeshes FSDP2 and DTensor need (`device_mesh`, `expert_mesh`) all come from here.

Launch (see evenrl.train.launch): `torchrun --nproc-per-node 3 -m evenrl.cli train CONFIG`, or under Slurm
`srun -N2 --ntasks-per-node 8 evenrl train CONFIG`. `init` reads the rank, world, node and master from
torchrun's or Slurm's variables by the rules of `evenrl.distributed.env`, and joins a process group only when
that environment launched this process as one of several ranks. Start Slurm ranks with srun: a batch script
run without srun is one process. The store is built here, prefixed by the restart count, because a restarted
gloo group otherwise trips over keys left in the shared store by the failed attempt (pytorch#135712).

Reserved rollout ranks (`rollout_devices` R > 0, the last R ranks only generate): every training collective runs on
the trainer group (ranks 0..T-1, so a trainer's rank in it is its global rank, and `world()` is T). Two more groups
meet the rollout ranks: the push group (trainer 0 + the rollout ranks: the weight push,
evenrl.distributed.rollout_link) and a gloo group over the whole world for the samples (point to point, so a rollout
rank can run ahead of the trainers by rollout.max_staleness steps without waiting for them).
With R = 0 the trainer group is the default group.

Every rank builds every group in the same order (`new_group` is collective over the default group), reserved
rollout ranks too; a dimension of size 1 builds none.

The mesh is one object (`Mesh`, torchtitan's ParallelDims is the model): `from_config(cfg)` builds it once from the
config's parallel sizes and the launch, and returns it; whoever needs a group or a size is handed it (the trainer
keeps it as `Trainer.mesh`, `evenrl.train.parallelize` applies a model's plan over it) and asks it, never the
config again. The process has one (a process group is per process too); the module's functions (`rank()`,
`size(dim)`, ...: what `evenrl.distributed.collectives` re-exports) are that object's answers, for the collectives
of code that is handed no mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from evenrl.distributed.env import LaunchEnv, read_env
from evenrl.distributed.mesh_shape import MeshShape
from evenrl.errors import UsageError

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
class Mesh:
    """This process's place in the job, built by `init` (`from_config`) and forgotten by `shutdown`: the mesh's shape,
    every process group (a handle per dimension this rank belongs to; None where the dimension has size 1 for this
    rank), the training ranks' configured capacity weights, and the state of this rank's collectives. Its sizes
    (`tp`, `sp`, `ep`, `dp`, `replica`, `trainers`) are the run's answer to "is tensor parallelism on?"."""

    info: DistInfo | None = None
    shape: MeshShape = field(default_factory=lambda: MeshShape(1))
    capacity: list[float] | None = None  # parallel.capacity_weights given as numbers (None: equal, or measured)
    # parallel.capacity_weights' mode: 'fixed' (numbers, `capacity`), 'auto' (the run measures the ranks and
    # rebalances: evenrl.train.balance) or 'none' (equal ranks, nothing measured)
    capacity_mode: str = "none"
    own_group: bool = False  # init (or device_mesh) built the default group, so shutdown destroys it
    store: Any = None  # the group's store; each rank leaves its current phase there (guard.mark)
    phase: str = "start"  # where this rank last said it was (guard.mark)
    trainers: Any = None  # the trainer group when some ranks only generate; None: the default group
    push: Any = None  # trainer 0 + the rollout ranks: the weight push
    samples: Any = None  # gloo group over the whole world: rollouts travel from the rollout ranks to the trainers
    host_group: Any = None  # the data group with gloo beside NCCL: FSDP2's mesh under CPU offload
    dims: dict = field(default_factory=dict)  # MeshShape dimension -> this rank's group handle
    mesh_groups: dict = field(default_factory=dict)  # DeviceMesh dims ("data"/"tp", "edata"/"ep"), of one rank too
    meshes: dict = field(default_factory=dict)  # the torch DeviceMesh objects, made once (device_mesh)
    wait: timedelta = field(default_factory=lambda: timedelta(minutes=10))  # the collective timeout, for p2p waits
    sending: list = field(default_factory=list)  # a rollout rank's sends in flight: (work, buffer) kept alive
    sequence: Any = None  # this rank's sequence-parallel group (SequenceGroup), size 1 without Ulysses
    closers: list = field(default_factory=list)  # called by shutdown before the groups go (before_shutdown)

    def reset(self) -> None:
        self.__dict__.update(Mesh().__dict__)

    # the sizes of the mesh's dimensions (MeshShape's, 1 before init: one process)
    @property
    def tp(self) -> int:
        return self.shape.tp

    @property
    def sp(self) -> int:
        return self.shape.sp

    @property
    def ep(self) -> int:
        return self.shape.ep

    @property
    def dp(self) -> int:
        return self.shape.dp

    @property
    def replica(self) -> int:
        """Ranks that train each sample together (sp x tp): the step sends every sample to all of them."""
        return self.shape.replica

    @property
    def device(self) -> torch.device:
        """This rank's device (the host before init)."""
        return self.info.device if self.info is not None else torch.device("cpu")

    def rank(self) -> int:
        """This rank (global; a trainer's rank in the trainer group is the same number)."""
        return tdist.get_rank() if active() else 0

    def world(self) -> int:
        """Ranks that train: what the step's schedule, gradients and per-sample views span."""
        return tdist.get_world_size() - self.shape.rollout if active() else 1

    def is_main(self) -> bool:
        return self.rank() == 0

    def group(self, dim: str):
        """This rank's process group along `dim` ("trainers" or a MeshShape dimension), for torch's collectives
        (None: the default group; `size(dim)` says whether there is anything to reduce)."""
        if dim == "trainers":
            return self.trainers
        if dim not in self.dims:
            raise ValueError(f"mesh: no {dim!r} dimension ({self.shape.describe()})")
        return self.dims[dim]

    def size(self, dim: str) -> int:
        """How many ranks this rank's `dim` group holds (1: no collective is needed)."""
        if dim == "trainers":
            return self.world()
        members = self.shape.group_of(dim, self.rank())
        return len(members) if members else 1

    def coords(self):
        """This rank's (dp, sp, tp) (None on a reserved rollout rank)."""
        return self.shape.coords(self.rank())

    def rollout_ranks(self) -> list[int]:
        """Global ranks that only generate ([] when every rank trains)."""
        return list(range(self.shape.trainers, self.shape.world)) if self.shape.rollout else []

    def is_rollout_rank(self) -> bool:
        return bool(self.shape.rollout) and self.rank() >= self.shape.trainers

    def engine_members(self) -> list[int]:
        """The ranks of this rank's rollout engine (rollout.tensor_parallel_size of them: the `engine` dimension;
        [rank] for an engine of one device)."""
        return self.shape.group_of("engine", self.rank()) or [self.rank()]

    def check_engine_blocks(self, size: int) -> None:
        """vLLM's external_launcher makes its tensor-parallel groups over the default group itself, as consecutive
        blocks of `size` ranks; they must be the mesh's engine groups, or its workers would pair with ranks of
        another engine."""
        blocks = [list(range(i, i + size)) for i in range(0, self.shape.world, size)]
        if size != self.shape.engine_tp or blocks != self.shape.groups("engine"):
            raise ValueError(f"mesh: vLLM's engine groups {blocks} are not the mesh's {self.shape.groups('engine')} "
                             f"({self.shape.describe()})")

    def device_mesh(self, device: torch.device, *, host_collectives: bool = False):
        """The torch DeviceMesh over the training ranks that FSDP2 and DTensor work on, made once: one dimension,
        "data" (the ranks FSDP2 shards over: every training rank when tp is 1), or two, ("data", "tp"), with tensor
        parallelism; take `mesh["data"]` or `mesh["tp"]`. It is made from the mesh's own groups, so the reserved rollout
        ranks (in no training group) need not take part. One process has no group of its own (see init), so one is
        made here: FSDP2 needs a group even to shard over a single rank, and the sharded code path is then the same at
        every world size.
        host_collectives: the mesh's group reduces CPU tensors too (gloo beside NCCL). FSDP2's CPU offload needs it: its
        sharded parameters and gradients live on the host, and the gradient norm and the whole-tensor gathers of such
        DTensors are collectives on CPU tensors, which NCCL refuses ("No backend type associated with device type cpu",
        pytorch#148532)."""
        from torch.distributed.device_mesh import DeviceMesh

        key = ("host" if host_collectives else "device", device.type)
        if key in self.meshes:
            return self.meshes[key]
        # (offload beside tensor or expert parallelism was refused before anything loaded: config.compatibility)
        if host_collectives and device.type != "cpu":
            if self.host_group is None:
                hybrid = f"cpu:gloo,{device.type}:nccl"
                if not active():  # one process: the default group itself gets both backends
                    tdist.init_process_group(hybrid, store=tdist.HashStore(), rank=0, world_size=1)
                    self.own_group, self.host_group = True, tdist.group.WORLD
                else:  # the training ranks 0..T-1 again (new_group called by them alone)
                    self.host_group = tdist.new_group(list(range(self.world())), backend=hybrid,
                                                      use_local_synchronization=True)
            self.meshes[key] = DeviceMesh.from_group(self.host_group, device.type, mesh_dim_names=("data",))
            return self.meshes[key]
        if not active():
            backend = "nccl" if device.type == "cuda" else "gloo"
            tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1,
                                     device_id=device if backend == "nccl" else None)
            self.own_group = True
        s = self.shape
        if s.tp == 1:
            group = self.trainers if self.trainers is not None else tdist.group.WORLD
            self.meshes[key] = DeviceMesh.from_group(group, device.type, mesh_dim_names=("data",))
        else:
            ranks = torch.arange(s.trainers).view(s.trainers // s.tp, s.tp)  # row: a data index, column: a tp index
            self.meshes[key] = DeviceMesh.from_group([self.mesh_groups["data"], self.mesh_groups["tp"]], device.type,
                                                  mesh=ranks, mesh_dim_names=("data", "tp"))
        return self.meshes[key]

    def expert_mesh(self, device: torch.device):
        """The 2-D torch DeviceMesh ("edata", "ep") over the training ranks, made once, with expert parallelism
        (parallel.expert_parallel_size > 1): a mixture's expert weights are DTensors sharded on "ep" and FSDP2 shards
        them over "edata"; row i of the mesh is the i-th ep group (consecutive ranks), column j the ranks holding the
        j-th slice of the experts."""
        from torch.distributed.device_mesh import DeviceMesh

        s = self.shape
        if s.ep == 1:
            raise ValueError("mesh: expert_mesh without expert parallelism (parallel.expert_parallel_size is 1)")
        key = ("experts", device.type)
        if key not in self.meshes:
            ranks = torch.tensor(s.groups("ep")).view(s.trainers // s.ep, s.ep)
            self.meshes[key] = DeviceMesh.from_group([self.mesh_groups["edata"], self.mesh_groups["ep"]], device.type,
                                                  mesh=ranks, mesh_dim_names=("edata", "ep"))
        return self.meshes[key]

    def sequence_group(self):
        """This training rank's sequence-parallel group (a distributed.sequence.SequenceGroup; size 1 without
        sequence parallelism)."""
        if self.sequence is None:
            from evenrl.distributed.sequence import SequenceGroup

            return SequenceGroup(None, 1, 0)
        return self.sequence

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, data-parallel replicas): the step's schedule hands samples to replicas of
        sp x tp ranks, which train them together."""
        c = self.coords()
        return (0 if c is None else c.dp), self.shape.dp

    def rollout_unit(self, split: bool = True) -> tuple[int, int, bool]:
        """(this rank's rollout unit, how many there are, whether this rank keeps its unit's samples): the ranks that
        generate together. With tensor parallelism a tp group samples from the split model together and its first rank
        keeps the samples, so the step holds one copy of each; otherwise every training rank is a unit of its own.
        split: False where the engine holds a copy of its own (vLLM, whose engine groups gather their members' requests
        themselves: engines.engine_group): every training rank is then a unit, whatever the trainer's tp."""
        c = self.coords()
        if c is None:
            return 0, 1, False
        tp = self.shape.tp if split else 1
        return self.rank() // tp, self.shape.trainers // tp, self.rank() % tp == 0

    def per_trainer(self, unit_items: list) -> list:
        """Each training rank's part of a list with one entry per rollout unit: the unit's entry for the rank that keeps
        its samples, an empty list for the others."""
        tp = self.shape.tp
        return [unit_items[r // tp] if r % tp == 0 else [] for r in range(self.shape.trainers)]

    def unit_weights(self, weights: list[float] | None, split: bool = True) -> list[float] | None:
        """Per-rank capacity weights as per-unit ones (`split` as in rollout_unit): a unit is as fast as its slowest
        rank."""
        tp = self.shape.tp if split else 1
        return None if weights is None or tp == 1 else [min(weights[u:u + tp]) for u in range(0, len(weights), tp)]

    def counts_rows(self) -> bool:
        """Whether this rank counts its replica's rows in a sum over the training ranks (its replica's first rank: the
        sp x tp ranks of a replica hold the same rows after the exchange)."""
        c = self.coords()
        return c is not None and c.sp == 0 and c.tp == 0

    def before_shutdown(self, close) -> None:
        """Have `shutdown` call `close()` first, while the groups still stand: what made groups of its own on the mesh's
        ranks (a vLLM engine over an engine group) tears them down there, not at the interpreter's exit after them."""
        self.closers.append(close)

    def shutdown(self) -> None:
        """Leave the process group `init` built (an adopted one stays) and forget `init`'s answer, so the next `init`
        reads the environment again."""
        for close in reversed(self.closers):
            close()
        if self.own_group and active():
            tdist.destroy_process_group()
        self.reset()


G = Mesh()  # the process's one mesh (a process group is per process too)

def active() -> bool:
    """Whether a process group exists in this process (built by init, device_mesh or someone else)."""
    return tdist.is_available() and tdist.is_initialized()


def from_config(cfg, *, rollout: bool = True) -> Mesh:
    """The mesh of a run of `cfg` (a RunConfig), built once: the config's parallel sizes and collective timeout over
    the launch's ranks (`rollout`: False for a command without rollouts, evenrl sft: no reserved rollout ranks, no
    engine groups)."""
    p = cfg.parallel
    init(timeout=p.collective_timeout_s, rollout_devices=p.rollout_devices if rollout else 0,
         sequence_parallel=p.sequence_parallel_size, tensor_parallel=p.tensor_parallel_size,
         expert_parallel=p.expert_parallel_size,
         engine_tensor_parallel=cfg.rollout.tensor_parallel_size if rollout and cfg.rollout.engine == "vllm" else 1)
    G.capacity = p.fixed_capacity_weights()
    G.capacity_mode = "none" if p.capacity_weights is None else "auto" if p.capacity_weights == "auto" else "fixed"
    return G


def init(backend: str | None = None, *, timeout: float | None = None, rollout_devices: int = 0,
         sequence_parallel: int = 1, tensor_parallel: int = 1, engine_tensor_parallel: int = 1,
         expert_parallel: int = 1) -> Mesh:
    """Join the process group described by the environment and build the mesh (idempotent). backend None: NCCL with
    CUDA (one GPU per process), else gloo.
    timeout: seconds the rendezvous and each collective may wait before failing (default 10 minutes).
    rollout_devices: the last this many ranks only generate (reserved placement).
    sequence_parallel, tensor_parallel: parallel.sequence_parallel_size and parallel.tensor_parallel_size;
    engine_tensor_parallel: rollout.tensor_parallel_size; expert_parallel: parallel.expert_parallel_size (whether
    it divides the model's experts is checked where the model is: distributed.expert_parallel). A shape that cannot
    be built (MeshShape.problems) is one line, UsageError, before any group is joined; `evenrl plan` says the same
    before a run starts. Returns the mesh (`G`: the process's one)."""
    if G.info is not None:
        return G
    env = read_env()
    lay = env if env.launched else LaunchEnv()  # not one of several launched ranks: one plain process
    shape = MeshShape(lay.world, rollout_devices if lay.world > 1 else 0, sequence_parallel, tensor_parallel,
                      engine_tensor_parallel, expert_parallel)
    wrong = shape.problems()
    if wrong:
        raise UsageError(wrong[0])
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", lay.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if active():  # someone else built the group: adopt it
        G.info = DistInfo(tdist.get_rank(), tdist.get_world_size(), lay.local_rank, lay.local_world,
                         lay.node_rank, device, str(tdist.get_backend()))
        _build_groups(shape)
        return G
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
    else:
        backend = None
    G.info = DistInfo(lay.rank, lay.world, lay.local_rank, lay.local_world, lay.node_rank, device, backend)
    _build_groups(shape)
    return G


def _build_groups(shape: MeshShape) -> None:
    """Every group of the mesh, in one fixed order on every rank (new_group is collective over the default group),
    reserved rollout ranks too. A group of one rank builds nothing (None); one of every training rank is the trainer
    group."""
    from evenrl.distributed.sequence import SequenceGroup

    G.shape = shape
    if shape.rollout:
        G.trainers = tdist.new_group(list(range(shape.trainers)), timeout=G.wait)
        G.push = tdist.new_group([0, *range(shape.trainers, shape.world)], timeout=G.wait)
        # samples are host-side token ids and log-probs: gloo whatever the training backend
        G.samples = tdist.new_group(list(range(shape.world)), timeout=G.wait, backend="gloo")
    me = G.rank()
    for dim in ("tp", "sp", "data", "replica", "engine", "ep", "edata"):
        G.dims[dim] = None
        if dim in ("ep", "edata") and shape.ep == 1:  # no expert parallelism: no groups (edata would be data's)
            continue
        # a DeviceMesh dimension needs a group even of one rank
        mesh_dim = (shape.tp > 1 and dim in ("data", "tp")) or (shape.ep > 1 and dim in ("ep", "edata"))
        for ranks in shape.groups(dim):
            if len(ranks) == 1 and not mesh_dim:
                continue
            made = G.trainers if ranks == list(range(shape.trainers)) else tdist.new_group(ranks, timeout=G.wait)
            if me in ranks:
                G.dims[dim] = made if len(ranks) > 1 else None
                if mesh_dim:
                    G.mesh_groups[dim] = made if made is not None else tdist.group.WORLD
    c = shape.coords(me)
    G.sequence = None if c is None else SequenceGroup(G.dims["sp"], shape.sp, c.sp)


# The process's mesh's answers, for code that is handed no mesh (what collectives re-exports): the one object's
# bound methods (`G` is never replaced: shutdown resets it in place).
rank, world, is_main, group, size, coords = G.rank, G.world, G.is_main, G.group, G.size, G.coords
rollout_ranks, is_rollout_rank, device_mesh = G.rollout_ranks, G.is_rollout_rank, G.device_mesh
expert_mesh, sequence_group, data_parallel = G.expert_mesh, G.sequence_group, G.data_parallel
rollout_unit, per_trainer, check_engine_blocks = G.rollout_unit, G.per_trainer, G.check_engine_blocks
unit_weights, counts_rows, before_shutdown, shutdown = G.unit_weights, G.counts_rows, G.before_shutdown, G.shutdown


def shape() -> MeshShape:
    """The mesh's sizes (MeshShape(1) before init: one process)."""
    return G.shape


def trainer_group():
    """The process group of the training ranks (None: the default group, when no rank is reserved for rollout)."""
    return G.trainers


def replica_size() -> int:
    return G.replica


def capacity() -> list[float] | None:
    """The training ranks' configured capacity weights (parallel.capacity_weights as numbers; None: equal or
    measured)."""
    return G.capacity


def comm_device() -> torch.device:
    """Where tensors must be for the trainer group's backend: the current GPU under NCCL, else the host."""
    if "nccl" in str(tdist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
