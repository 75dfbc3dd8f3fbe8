"""The shape of the job's device mesh, without torch: which rank does what along each parallel dimension. The
planner (`evenrl plan`) and `evenrl.distributed.mesh` (which builds the process groups, once) both read it here, so
the plan reasons over the same dimensions the run uses.

    MeshShape(world=8, rollout=0, sp=1, tp=2).coords(5) -> Coords(dp=2, sp=0, tp=1)

The training ranks are the first `world - rollout` ranks (the last `rollout` only generate), laid out as
dp x sp x tp with tp the fastest-varying (torchtitan's order): a tensor-parallel group is `tp` consecutive ranks,
on one node wherever tp <= processes per node, where its per-layer collectives are cheapest; a sequence-parallel
group strides by tp; a data-parallel index runs over the rest. The ranks of one dp index ("a replica": sp x tp
ranks) train the same samples together: the step's schedule has dp "ranks". Gradients are reduced over the `data`
groups (dp x sp ranks of one tp index), which is also the dimension FSDP2 shards over.

Expert parallelism (`parallel.expert_parallel_size` = ep, a mixture of experts) borrows training ranks, as
torchtitan's and prime-rl's meshes borrow data ranks: the training ranks are cut into `ep` groups of ep consecutive
ranks, each rank of one holding 1/ep of every MoE layer's experts (the tokens of all of them are dispatched there by
all-to-all), and the `edata` groups join the ranks of one ep index (the ranks holding the same experts: their
gradient reduction and FSDP2 shards). The dense layers keep the usual dimensions. With tensor parallelism an ep
group may hold ranks of one tp group: its ranks hold the same tokens, and each dispatches its own 1/tp of them
(distributed.expert_parallel), so every token meets its experts once (Megatron's expert-data-parallel layout with
expert tensor parallelism 1).

    MeshShape(world=4, ep=2).groups("ep") -> [[0, 1], [2, 3]];  .groups("edata") -> [[0, 2], [1, 3]]

Rollout engines over several devices (`rollout.tensor_parallel_size` = N, vLLM): colocated, an engine group is N
consecutive training ranks; reserved, N consecutive rollout ranks.

Every size is checked once (`problems`): one line each, naming the field, the value and what is allowed.
Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

DIMS = ("tp", "sp", "data", "replica", "engine", "ep", "edata")  # the groups `groups(dim)` lists
# The rollout.engine values whose engines can span rollout.tensor_parallel_size > 1 devices (an engine group, the
# `engine` dimension, driven together: vLLM's, engines.engine_group); the planner refuses the others above 1. The
# hf engine's tensor parallelism is the trainer's (parallel.tensor_parallel_size: a TP group samples from its split
# model), so it never appears here (distributed.lockstep says so in one line).
ENGINES_OVER_DEVICES: frozenset[str] = frozenset({"vllm"})


class Coords(NamedTuple):
    dp: int
    sp: int
    tp: int


@dataclass(frozen=True)
class MeshShape:
    world: int  # every process of the job
    rollout: int = 0  # the last this many ranks only generate (parallel.rollout_devices)
    sp: int = 1  # parallel.sequence_parallel_size
    tp: int = 1  # parallel.tensor_parallel_size
    engine_tp: int = 1  # rollout.tensor_parallel_size: devices per rollout engine
    ep: int = 1  # parallel.expert_parallel_size: ranks of a data group that split the experts

    @property
    def trainers(self) -> int:
        return self.world - self.rollout

    @property
    def replica(self) -> int:
        """Ranks that train the same samples together (sp x tp)."""
        return self.sp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the step schedule's ranks."""
        return max(self.trainers // self.replica, 1)

    @property
    def data(self) -> int:
        """Ranks that see different tokens (dp x sp): the gradient reduction's and FSDP2's group size."""
        return self.dp * self.sp

    def problems(self) -> list[str]:
        """What makes this shape impossible, one line each (empty: it can be built)."""
        out = []
        if self.world < 1:
            out.append(f"world size: got {self.world}; needs at least 1 process")
            return out
        if not 0 <= self.rollout < self.world:
            out.append(f"parallel.rollout_devices: got {self.rollout}; needs at least one training rank among the "
                       f"{self.world} processes (0 <= rollout devices < {self.world})")
            return out
        for name, v in (("parallel.sequence_parallel_size", self.sp), ("parallel.tensor_parallel_size", self.tp),
                        ("rollout.tensor_parallel_size", self.engine_tp),
                        ("parallel.expert_parallel_size", self.ep)):
            if v < 1:
                out.append(f"{name}: got {v}; needs >= 1")
        if out:
            return out
        if self.trainers % self.replica:
            what = " x ".join(f"{n} {v}" for n, v in (("parallel.sequence_parallel_size", self.sp),
                                                       ("parallel.tensor_parallel_size", self.tp)) if v > 1)
            out.append(f"{what} = {self.replica} ranks per replica must divide the {self.trainers} training ranks "
                       f"(allowed: a divisor of {self.trainers})")
        elif self.ep > 1 and self.trainers % self.ep:
            out.append(f"parallel.expert_parallel_size: got {self.ep}; it must divide the {self.trainers} training "
                       f"ranks, which it borrows (allowed: a divisor of {self.trainers})")
        engines_on = self.rollout or self.trainers
        if self.engine_tp > 1 and engines_on % self.engine_tp:
            where = f"{self.rollout} rollout devices" if self.rollout else f"{self.trainers} training ranks"
            out.append(f"rollout.tensor_parallel_size: got {self.engine_tp}; each engine spans that many of the "
                       f"{where}, so it must divide {engines_on}")
        return out

    def experts_problem(self, experts: int) -> str | None:
        """What makes expert parallelism impossible for a model of `experts` routed experts per MoE layer (0: a dense
        model), in one line; None when it can be built (or is off)."""
        if self.ep == 1:
            return None
        if not experts:
            return (f"parallel.expert_parallel_size: got {self.ep}, but model.path is not a mixture of experts (no "
                    "experts to split); use 1")
        if experts % self.ep:
            fits = [d for d in range(1, self.trainers + 1) if not self.trainers % d and not experts % d]
            return (f"parallel.expert_parallel_size: got {self.ep}, which does not divide the model's {experts} "
                    f"experts; each rank of an ep group holds experts / ep of them (allowed: "
                    f"{', '.join(map(str, fits))})")
        return None

    def coords(self, rank: int) -> Coords | None:
        """(dp, sp, tp) of a training rank; None for a reserved rollout rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        if rank >= self.trainers:
            return None
        return Coords(rank // self.replica, (rank // self.tp) % self.sp, rank % self.tp)

    def rank_of(self, c: Coords) -> int:
        return (c.dp * self.sp + c.sp) * self.tp + c.tp

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of a dimension, as global ranks in order (each rank in exactly one group of the dimension,
        except that rollout ranks are in no training group and training ranks in no reserved engine group):
        tp: one per (dp, sp); sp: one per (dp, tp); data: one per tp (dp x sp ranks: gradient reduction and the
        FSDP2 shards); replica: one per dp (sp x tp ranks: the same samples); engine: rollout engines; ep: the
        training ranks cut into groups of ep consecutive ranks (each holds 1/ep of the experts); edata: the ranks at
        one ep index (they hold the same experts)."""
        r = lambda dp, sp, tp: self.rank_of(Coords(dp, sp, tp))  # noqa: E731
        if dim == "tp":
            return [[r(d, s, t) for t in range(self.tp)] for d in range(self.dp) for s in range(self.sp)]
        if dim == "sp":
            return [[r(d, s, t) for s in range(self.sp)] for d in range(self.dp) for t in range(self.tp)]
        if dim == "data":
            return [[r(d, s, t) for d in range(self.dp) for s in range(self.sp)] for t in range(self.tp)]
        if dim == "replica":
            return [[r(d, s, t) for s in range(self.sp) for t in range(self.tp)] for d in range(self.dp)]
        if dim in ("ep", "edata"):
            if dim == "ep":
                return [list(range(i, i + self.ep)) for i in range(0, self.trainers, self.ep)]
            return [list(range(e, self.trainers, self.ep)) for e in range(self.ep)]
        if dim == "engine":
            first, n = (self.trainers, self.rollout) if self.rollout else (0, self.trainers)
            return [list(range(first + i, first + i + self.engine_tp)) for i in range(0, n, self.engine_tp)]
        raise ValueError(f"unknown mesh dimension {dim!r}; one of {', '.join(DIMS)}")

    def group_of(self, dim: str, rank: int) -> list[int] | None:
        """The group of `dim` that holds `rank` (None: it is in none)."""
        return next((g for g in self.groups(dim) if rank in g), None)

    def describe(self) -> str:
        """'dp 2 x sp 1 x tp 2 = 4 training ranks (+ 1 rollout)'."""
        extra = f" (+ {self.rollout} rollout)" if self.rollout else ""
        engine = f"; engines of {self.engine_tp} devices" if self.engine_tp > 1 else ""
        experts = f"; experts over ep {self.ep} x edata {self.trainers // self.ep}" if self.ep > 1 else ""
        return f"dp {self.dp} x sp {self.sp} x tp {self.tp} = {self.trainers} training ranks{extra}{experts}{engine}"
