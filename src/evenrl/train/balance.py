"""Where a step's rows run on mixed devices: each training rank's token cap per micro-batch and the capacity
weights the schedule and the rollout split balance by (docs/heterogeneous.md).

    evenrl train CONFIG parallel.capacity_weights=auto --nproc-per-node 3

Both come from the plan evenrl train makes after gathering every rank's device (evenrl.planner.groups): a device
with less memory than the others gets a lower token cap; the weights are parallel.capacity_weights as given, or with
`auto` where the plan starts them (the devices' datasheet ratios, else equal). With capacity weights set (numbers
or `auto`) every rank measures itself on every step: the tokens of its forward and backward passes of the update
over the seconds they took (`Busy`, stopped before the gradient reduction, where ranks wait for each other), and,
where the trainers generate, the tokens of its rollout over the rollout phase's seconds. `rebalance` gathers the
four numbers of every rank (one small all-gather at the end of the step) and logs each rank's busy seconds
(load/busy_s/<rank>: what it computed in this step, waits excluded; the weights given can be checked against them).
With `auto` it also smooths the rates into the next step's weights (evenrl.core.capacity.smoothed_weights), the
same on every rank, and logs what this step balanced by: load/capacity_weight/<rank> (the update's) and
load/rollout_weight/<rank> (generation's). With reserved rollout ranks the trainers generate nothing, so the rollout
split stays the configured one (the rollout ranks compute it too). Without capacity weights nothing is measured and
no collective is added.

Exactness and resume: weights only move rows between ranks; the update is the same on any placement (global loss
denominators, summed gradients) up to the order floating-point sums are taken in (<= 1e-5 in fp32, tested). So two
`auto` runs of one config train the same model within that, not bit for bit: measured time decides where rows run.
The smoothed weights are saved with the trainer's state, so a resumed run places its first step as the
uninterrupted one would have; later steps follow what it measures. For bit-identical reruns fix the weights
(parallel.capacity_weights: [...], e.g. the last ones an auto run logged).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from evenrl.config import RunConfig
from evenrl.core.capacity import smoothed_weights
from evenrl.distributed import collectives as dist
from evenrl.distributed.mesh import Mesh


@dataclass
class Busy:
    """Seconds and tokens of one rank's own compute, waits for other ranks left out."""
    seconds: float = 0.0
    tokens: int = 0

    def add(self, since: float, tokens: int) -> None:
        """The work since perf_counter() read `since`, of `tokens` tokens (on CUDA once the device is done)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - since
        self.tokens += tokens

    def take(self) -> tuple[int, float]:
        out = (self.tokens, self.seconds)
        self.seconds, self.tokens = 0.0, 0
        return out


@dataclass
class Balance:
    token_caps: list[int] | None = None  # per training rank where devices differ in memory (None: the config's)
    update: list[float] | None = None  # capacity weights of the update schedule (None: equal)
    rollout: list[float] | None = None  # of the split of generation over the training ranks
    measured: bool = False  # capacity weights set: every rank's busy time is gathered and logged each step
    auto: bool = False  # parallel.capacity_weights=auto: and rebalanced by after every step
    colocated: bool = True  # the training ranks generate (no reserved rollout ranks)
    busy: Busy = field(default_factory=Busy)  # the update's forward and backward passes, this step

    def token_cap(self, cfg: RunConfig, rank: int) -> int:
        return self.token_caps[rank] if self.token_caps else cfg.train.token_cap_per_micro_batch

    def schedule_caps(self, cfg: RunConfig) -> int | list[int]:
        """What make_schedule takes: one cap, or one per training rank."""
        return self.token_caps or cfg.train.token_cap_per_micro_batch

    def state_dict(self) -> dict:
        return {"update": self.update, "rollout": self.rollout}

    def load_state_dict(self, state: dict | None) -> None:
        """The saved weights, when the run measures and they fit this run's ranks (a resume on another number of
        ranks starts from the plan's)."""
        if not self.auto or not state:
            return
        for name in ("update", "rollout"):
            saved = state.get(name)
            if saved is not None and len(saved) == dist.world() and (name == "update" or self.colocated):
                setattr(self, name, [float(x) for x in saved])


def make_balance(mesh: Mesh, plan, *, colocated: bool) -> Balance:
    """The plan's token caps and starting weights (evenrl.planner.plan: made on the gathered devices), measured and
    rebalanced as the mesh's capacity mode says (parallel.capacity_weights, read once where the mesh is built)."""
    weights = plan.weights
    # reserved rollout ranks split each step by the configured weights alone: they never see the trainers' measures
    rollout = weights if colocated else mesh.capacity
    return Balance(token_caps=plan.token_caps, update=weights, rollout=rollout, auto=mesh.capacity_mode == "auto",
                   colocated=colocated, measured=mesh.capacity_mode != "none")


def rebalance(balance: Balance, timer, local) -> dict:
    """With capacity weights set: every rank's measures of this step, gathered, and with auto the next step's
    weights from them; returns this step's load metrics. Otherwise nothing (no collective)."""
    if not balance.measured:
        return {}
    with timer("balance"):
        tokens, seconds = balance.busy.take()
        generated = int(local["tokens"].lengths.sum()) if balance.colocated else 0
        mine = torch.tensor([tokens, seconds, generated, timer.seconds.get("rollout", 0.0) if generated else 0.0],
                            dtype=torch.float64)
        rows = [p["m"].tolist() for p in dist.all_gather_tensors({"m": mine})]
    world = len(rows)
    out = {f"load/busy_s/{r}": row[1] + row[3] for r, row in enumerate(rows)}
    if not balance.auto:
        return out
    out.update({f"load/capacity_weight/{r}": w for r, w in enumerate(balance.update or [1.0] * world)})
    if balance.colocated:
        out.update({f"load/rollout_weight/{r}": w for r, w in enumerate(balance.rollout or [1.0] * world)})
        balance.rollout = smoothed_weights(balance.rollout, [x[2] for x in rows], [x[3] for x in rows])
    balance.update = smoothed_weights(balance.update, [x[0] for x in rows], [x[1] for x in rows])
    return out
