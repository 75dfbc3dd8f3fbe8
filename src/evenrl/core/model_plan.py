"""What was applied to a model from outside it, as one typed record per model: the `ModelPlan` that
`evenrl.train.parallelize` returns, read where a forward or a step must know it (the packed or split forward, the
fused head's tensor-parallel path, the forwards every rank must meet, the precision context). It replaces the
attributes the appliers used to set on the model object (`evenrl_sequence_group`, `evenrl_tensor_parallel`, ...),
which no import showed.

    plan = plan_of(model)          # what was applied (an empty plan for a plain model)
    plan.sequence                  # the packed forward's group (size 1: one rank's rows back to back)

Each applier records its part as it applies it (`record(model)`: distributed.sequence, distributed.tensor_parallel,
distributed.expert_parallel, models.loading.set_autocast), so a test that applies one of them alone sees the same
plan the run does. The record is kept beside the model, not on it (a weak map: it goes with the model).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ModelPlan:
    role: str = "policy"  # policy, critic, reference or scorer (a reward model): what parallelize applied for
    sequence: Any = None  # distributed.sequence.SequenceGroup: trained packed (size 1) or split over Ulysses ranks
    tensor_parallel: Any = None  # the tp DeviceMesh its layers are split over (distributed.tensor_parallel)
    expert_parallel: int = 1  # ranks its experts are split over (distributed.expert_parallel)
    sharded: bool = False  # FSDP2 shards it (parallel.sharding=fsdp)
    autocast: torch.dtype | None = None  # a replicated model's forwards run under torch.autocast(this)
    reduction: Any = None  # a trained model's gradient reduction (train.reduction), chosen by train.parallelize

    @property
    def split(self) -> bool:
        """Its parameters are split over a tensor- or expert-parallel group (DTensors of their own meshes)."""
        return self.tensor_parallel is not None or self.expert_parallel > 1

    @property
    def meets(self) -> bool:
        """Every forward is a collective over the data ranks (FSDP2 gathers its units, expert parallelism exchanges
        tokens), so every rank must run as many forwards and backwards, a filler where it has no rows."""
        return self.sharded or self.expert_parallel > 1


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_of(model) -> ModelPlan:
    """The plan applied to `model` (an empty one, not kept, for a model nothing was applied to)."""
    return _PLANS.get(model) or ModelPlan()


def record(model) -> ModelPlan:
    """`model`'s plan, to fill in as something is applied (made on first use)."""
    plan = _PLANS.get(model)
    if plan is None:
        plan = _PLANS[model] = ModelPlan()
    return plan
