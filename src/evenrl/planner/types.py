"""What a plan is: the numbers derived from (config, layout), one row per training rank, and the findings. Built
by evenrl.planner.plan.make_plan, judged by evenrl.planner.rules, printed by evenrl.planner.render; this module
imports none of them. Never imports torch.

Plan.to_dict(), schema "evenrl.plan/1" (what --json prints):
  schema, runnable (bool), counts {error, warning, note},
  layout {nnodes, nproc_per_node, device, device_memory_gib, capacity_weights, rollout_devices, source,
          world, training_ranks, devices null | [{ranks[], kind, model, memory_gib, threads, role}]},
  step {prompts_per_step, samples_per_prompt, samples_per_step, minibatches_per_step, minibatch_sizes[],
        epochs_per_step, sample_tokens, token_cap, min_rows, simulated},
  ranks {training, sequence_parallel, tensor_parallel, dp_groups (training / (sequence_parallel x tensor_parallel)),
         per_rank[{rank, samples, tokens, micro_steps, idle_minibatches}] (with SP x TP = R > 1: one per replica
         of R consecutive ranks, `rank` its index, ranks rank*R .. rank*R+R-1; tokens the replica's), samples{min,mean,max},
         tokens{min,mean,max}, micro_steps_per_minibatch[], idle[], imbalance (busiest / even split),
         bound_ratio (busiest / partition lower bound), oversize_samples,
         capacity_weights null | [per training rank] (simulated with: given, or where auto starts),
         device_groups [{label, ranks[], model, memory_gib, threads, token_cap, lowered, peak_gib, fits, fixes[]}]
           (the training ranks by device: one group unless devices differ, each with its token cap)},
  optimizer_steps {per_step, total, dataset_rows, steps_per_epoch, per_epoch}  (unknown: null),
  memory null | {breakdown_gib{...}, phases_gib{rollout, reward (with reward models or judges), log-probs, update}
                 (each with the resident part; total_gib is the largest), total_gib, capacity_gib, fits, params,
                 micro_tokens, rollout_samples_per_rank, host_gib, assumptions[], fixes[{settings, total_gib, fits,
                 why}]},
  overlap null | (rollout devices reserved and model dimensions known; estimates, evenrl.planner.timing)
          {estimate: true, rates{device_tflops, device_gbps, link_gbps, forward_floor_s, basis}, max_staleness,
           passes{update, ...}, planned{split}, best_split{split}, step_s (synchronous at max_staleness 0, else
           overlapped), weights_gib, checkpoint_extra_gib}
          split = {rollout_devices, training_ranks, samples_per_replica, training_tokens_per_rank, generation_s,
                   prefill_s, decode_s, training_s, push_s, sync_step_s, overlapped_step_s, saved_s},
  findings [{level, rule, message, fix}]   (errors first)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from evenrl.config import RunConfig
from evenrl.distributed.devices import DeviceGroup
from evenrl.distributed.mesh_shape import MeshShape
from evenrl.planner.layout import Layout
from evenrl.planner.dims import ModelDims
from evenrl.planner.memory import MemoryEstimate
from evenrl.planner.memory_fixes import MemoryFix
from evenrl.planner.timing import Overlap, RateFlags


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning", "note"]
    rule: str  # stable id, e.g. "idle-ranks"
    message: str  # what is wrong, with the numbers
    fix: str = ""  # nearest valid settings; alternatives separated by "; "

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RankRow:
    rank: int
    samples: int
    tokens: int  # padded tokens over the step (worst case)
    micro_steps: int  # same on every rank (short ranks run zero-weight filler steps)
    idle_minibatches: int  # mini-batches in which this rank has no rows


@dataclass(frozen=True)
class GroupPlan:
    """One device group of the training ranks: its memory estimate at its own token cap per micro-batch."""
    group: DeviceGroup
    token_cap: int  # train.token_cap_per_micro_batch, or lower on a device with less memory than the others'
    memory: MemoryEstimate | None  # at token_cap; None when the model's dimensions are unknown
    lowered: bool = False  # token_cap was lowered to fit this group's memory
    fixes: tuple[MemoryFix, ...] = ()  # when it does not fit

    @property
    def fits(self) -> bool | None:
        return None if self.memory is None else self.memory.fits

    def to_dict(self) -> dict:
        d = self.group.device
        return {"label": self.group.label, "ranks": list(self.group.ranks), "model": d.model,
                "memory_gib": round(d.memory_gib, 3), "threads": d.threads, "token_cap": self.token_cap,
                "lowered": self.lowered, "peak_gib": None if self.memory is None else round(self.memory.total_gib, 3),
                "fits": self.fits, "fixes": [asdict(f) for f in self.fixes]}


@dataclass
class Plan:
    config: RunConfig
    layout: Layout
    sample_tokens: int
    minibatch_sizes: list[int] = field(default_factory=list)
    micro_steps: list[int] = field(default_factory=list)
    ranks: list[RankRow] = field(default_factory=list)
    imbalance: float | None = None  # busiest rank's load / an even (weighted) split, summed over mini-batches
    bound_ratio: float | None = None  # busiest rank's load / the partition lower bound (1.0: nothing better exists)
    oversize: int = 0
    simulated: bool = True
    schedule_error: str | None = None
    dataset_rows: int | None = None
    dims: ModelDims | None = None
    dims_error: str | None = None
    vision_tokens: int = 0  # a vision-language sample's encoder work in tokens, worst case (planner.vision)
    memory: MemoryEstimate | None = None
    memory_fixes: list[MemoryFix] = field(default_factory=list)
    rates: RateFlags | None = None  # the rates the user gave (--fit re-plans with them)
    weights: list[float] | None = None  # capacity weights the step was simulated with (None: equal)
    groups: list[GroupPlan] = field(default_factory=list)  # the training ranks by device, each with its token cap
    overlap: Overlap | None = None  # also without reserved devices when max_staleness >= 1 (its best split)
    findings: list[Finding] = field(default_factory=list)
    resumed: dict | None = None  # evenrl train --resume: the checkpoint's recorded settings (planner.reproducibility)

    @property
    def runnable(self) -> bool:
        return not any(f.level == "error" for f in self.findings)

    @property
    def token_caps(self) -> list[int] | None:
        """Each training rank's token cap per micro-batch where device groups differ in it (None: one for all)."""
        caps = {r: g.token_cap for g in self.groups for r in g.group.ranks}
        if len(set(caps.values())) <= 1:
            return None
        return [caps[r] for r in range(len(caps))]

    @property
    def tensor_parallel(self) -> int:
        """parallel.tensor_parallel_size as planned: at most the training ranks (rule_tensor_parallel says when
        it does not divide them; the plan then counts the whole replicas)."""
        return max(1, min(self.config.parallel.tensor_parallel_size, self.layout.training_ranks))

    @property
    def sequence_parallel(self) -> int:
        """parallel.sequence_parallel_size as planned: at most the training ranks left over TP
        (rule_sequence_parallel says when it does not divide them; the plan then counts the whole groups)."""
        return max(1, min(self.config.parallel.sequence_parallel_size,
                          self.layout.training_ranks // self.tensor_parallel))

    @property
    def replica(self) -> int:
        """Consecutive training ranks that train the same samples: SP x TP (evenrl.distributed.mesh_shape)."""
        return self.sequence_parallel * self.tensor_parallel

    @property
    def mesh(self) -> MeshShape:
        """The run's mesh as planned (the object evenrl.distributed.mesh builds its groups from): dp x sp x tp over
        the training ranks, tp fastest, the reserved rollout ranks last, the vLLM engines' groups, and the ep x
        edata groups of a mixture's experts."""
        lay, c = self.layout, self.config
        engine = c.rollout.tensor_parallel_size if c.rollout.engine == "vllm" else 1
        return MeshShape(max(lay.world, 1), min(lay.rollout_devices, max(lay.world - 1, 0)), self.sequence_parallel,
                         self.tensor_parallel, engine, c.parallel.expert_parallel_size)

    @property
    def dp_size(self) -> int:
        """Data-parallel units the step is balanced over: the training ranks, or with SP or TP > 1 the replicas of
        SP x TP ranks (each row of `ranks` is one)."""
        return self.mesh.dp

    @property
    def unit(self) -> str:
        """What a row of `ranks` is, for messages: 'training rank', 'SP group', 'TP group' or 'replica' (both)."""
        sp, tp = self.sequence_parallel > 1, self.tensor_parallel > 1
        return "replica" if sp and tp else "SP group" if sp else "TP group" if tp else "training rank"

    @property
    def idle(self) -> list[int]:
        return [r.rank for r in self.ranks if r.idle_minibatches]

    @property
    def optimizer_steps_per_step(self) -> int:
        return len(self.minibatch_sizes) * self.config.algo.epochs_per_step

    @property
    def steps_per_epoch(self) -> float | None:
        return self.dataset_rows / self.config.data.prompts_per_step if self.dataset_rows else None

    def counts(self) -> dict[str, int]:
        return {lv: sum(f.level == lv for f in self.findings) for lv in ("error", "warning", "note")}

    def to_dict(self) -> dict:
        c, t = self.config, self.layout.training_ranks
        spe = self.steps_per_epoch
        mem = None
        if self.memory:
            mem = self.memory.to_dict()
            mem["fixes"] = [asdict(f) for f in self.memory_fixes]
        return {
            "schema": "evenrl.plan/1", "runnable": self.runnable, "counts": self.counts(),
            "layout": self.layout.to_dict(),
            "step": {"prompts_per_step": c.data.prompts_per_step, "samples_per_prompt": c.rollout.samples_per_prompt,
                     "samples_per_step": c.samples_per_step(), "minibatches_per_step": c.algo.minibatches_per_step,
                     "minibatch_sizes": self.minibatch_sizes, "epochs_per_step": c.algo.epochs_per_step,
                     "sample_tokens": self.sample_tokens, "token_cap": c.train.token_cap_per_micro_batch,
                     "min_rows": c.train.min_rows_per_micro_batch, "simulated": self.simulated},
            "ranks": {"training": t, "sequence_parallel": self.sequence_parallel,
                      "tensor_parallel": self.tensor_parallel, "dp_groups": self.dp_size,
                      "per_rank": [asdict(r) for r in self.ranks],
                      "samples": _stats([r.samples for r in self.ranks]),
                      "tokens": _stats([r.tokens for r in self.ranks]),
                      "micro_steps_per_minibatch": self.micro_steps, "idle": self.idle,
                      "imbalance": None if self.imbalance is None else round(self.imbalance, 4),
                      "bound_ratio": None if self.bound_ratio is None else round(self.bound_ratio, 4),
                      "oversize_samples": self.oversize, "capacity_weights": self.weights,
                      "device_groups": [g.to_dict() for g in self.groups]},
            "optimizer_steps": {"per_step": self.optimizer_steps_per_step,
                                "total": self.optimizer_steps_per_step * c.train.steps,
                                "dataset_rows": self.dataset_rows,
                                "steps_per_epoch": None if spe is None else round(spe, 3),
                                "per_epoch": None if spe is None else round(spe * self.optimizer_steps_per_step, 3)},
            "memory": mem,
            "overlap": self.overlap.to_dict() if self.overlap and self.overlap.at else None,
            "findings": [f.to_dict() for f in self.findings],
        }


def _stats(xs: list[int]) -> dict | None:
    return {"min": min(xs), "mean": round(sum(xs) / len(xs), 3), "max": max(xs)} if xs else None
