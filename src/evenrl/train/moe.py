"""A mixture of experts in the RL step (docs/moe.md): the routes a step's forwards record and replay
(rollout.router_replay), the load-balancing loss of each update (algo.router_aux_loss_coef) and the routing
metrics. The hooks that do the routing are evenrl.models.routing's; the arithmetic is evenrl.core.moe's.

Who routes which forward:
  off      every forward by its own router.
  engine   the hf engine records each sample's routes (the `routes` column, from rollout.generate.rollout); every
           trainer forward replays them. `probe` measures, with one forward without gradient per step, how the
           trainer's own routing would differ (per layer and in any layer) and the log-prob mismatch it would have had.
  trainer  the step's first forward of the policy (old log-probs, or the reward KL's) records the routes
           (`record_routes` into the `routes` column) and the later forwards replay them (R2).
With algo.router_aux_loss_coef > 0 each mini-batch's expert counts must be known before its first backward: they
come from the routes column, or from a recording forward without gradient over the mini-batch whose routes the
update then replays (the same routing it would choose itself: the weights do not move within a mini-batch).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from evenrl.config import RunConfig
from evenrl.core.batch import Batch, Ragged
from evenrl.core.model_plan import plan_of
from evenrl.core.moe import balance_loss, load_metrics, mismatch_metrics
from evenrl.distributed import collectives as dist
from evenrl.distributed.exact import canonical_sum
from evenrl.errors import UsageError
from evenrl.models import routing
from evenrl.train.update import compute_logprobs


def check(cfg: RunConfig, model) -> None:
    """Refuse what the model's routers cannot do, before a step runs (the plan names the same from config.json;
    replay beside an agent or vLLM is config.compatibility's, refused before anything loaded)."""
    state = routing.routing(model)
    replay = cfg.rollout.router_replay
    if state is None:
        unknown = routing.unknown_routers(model)
        if unknown and (replay != "off" or cfg.algo.router_aux_loss_coef > 0):
            raise UsageError(f"rollout.router_replay / algo.router_aux_loss_coef: {type(model).__name__} routes "
                             f"through {unknown[0]}, a router evenrl does not know (evenrl.models.routing.FAMILIES); "
                             "use router_replay=off and router_aux_loss_coef=0")
        if replay != "off":
            raise UsageError(f"rollout.router_replay: got {replay!r}, but model.path is not a mixture of experts "
                             "(no routers to replay); use 'off'")
        if cfg.algo.router_aux_loss_coef > 0:
            raise UsageError(f"algo.router_aux_loss_coef: got {cfg.algo.router_aux_loss_coef}, but model.path is not "
                             "a mixture of experts; use 0")
        return
    if cfg.algo.router_aux_loss_coef > 0 and any(f.balance_probs is None for f in state.families):
        raise UsageError(f"algo.router_aux_loss_coef: got {cfg.algo.router_aux_loss_coef}, but "
                         f"{type(model).__name__}'s router is aux-loss-free (sigmoid scores balanced by the "
                         "checkpoint's correction biases); use 0")


def global_counts(t: Tensor, over: str = "data") -> Tensor:
    """Expert counts summed over the ranks that see different tokens (the mesh's `data` dimension: every training
    rank but a tensor-parallel group's copies), every token of the mini-batch once."""
    return dist.all_reduce_sum(t, over=over)


def _collect(state: routing.Routing, into: dict[int, Tensor]):
    """after(rows) for compute_logprobs: each row's recorded routes into `into` by batch row."""
    def after(rows: list[int]) -> None:
        got = state.plan.rows
        into.update(zip(rows, torch.split(got.values, got.lengths.tolist())))
    return after


def record_routes(model, batch: Batch, micro_rows: list[list[int]], *, temperature: float, pad_token_id: int
                  ) -> tuple[list[Tensor], Ragged]:
    """(per-row response log-probs, the rows' routes as a column): one forward without gradient that routes live
    and records (the R2 pass, or the count pass of the load-balancing loss)."""
    state = routing.routing(model)
    got: dict[int, Tensor] = {}
    with routing.options(model, record=True, replay=False):
        logps = compute_logprobs(model, batch, micro_rows, temperature=temperature, pad_token_id=pad_token_id,
                                 after=_collect(state, got))
    if len(got) != len(batch):
        raise RuntimeError(f"record_routes: {len(got)} of {len(batch)} rows ran; every row must")
    return logps, Ragged.of([got[i] for i in range(len(batch))], state.dtype)


def probe(model, batch: Batch, micro_rows: list[list[int]], *, temperature: float, pad_token_id: int,
          bitwise: bool = False) -> dict:
    """router_replay=engine: the step's rows through the trainer's own routing (no replay, no gradient), compared
    with the engine's routes (the share of routed tokens whose top-k set differs, per layer and in any layer) and
    its log-probs (|engine - trainer| over the sampled tokens: the mismatch replay removes). A collective.
    bitwise: the rows' |engine - trainer| sums added in sample order (distributed.exact.canonical_sum); the counts
    are integers, exact in any order."""
    state = routing.routing(model)
    sp = plan_of(model).sequence
    L = state.layers
    sums = torch.zeros(L + 4, dtype=torch.float64)  # per-layer differs, any layer, routed tokens, |diff|, tokens
    keyed: list[tuple[int, list[float]]] = []  # (sample, its sum of |diff|) of the rows this rank counts

    def after(rows: list[int]) -> None:
        plan = state.plan
        differs = plan.stacked("differs")  # [L, n]: this rank's slice of the packed rows
        sums[:L] += differs.sum(dim=1)
        sums[L] += differs.any(dim=0).sum()
        sums[L + 1] += plan.replayed.sum()

    with routing.options(model, replay=False, stats=True):
        logps = compute_logprobs(model, batch, micro_rows, temperature=temperature, pad_token_id=pad_token_id,
                                 after=after)
    if sp is None or sp.index == 0:  # the group's ranks share the rows' log-probs: its first counts them
        engine = torch.split(batch["engine_logp"].values, batch["engine_logp"].lengths.tolist())
        sampled = (torch.split(batch["loss_mask"].values, batch["loss_mask"].lengths.tolist())
                   if "loss_mask" in batch else [None] * len(batch))
        for row, (mine, theirs, keep) in enumerate(zip(logps, engine, sampled)):
            if mine is None:
                continue
            diff = (mine - theirs).abs()
            diff = diff if keep is None else diff[keep]
            keyed.append((int(batch["sample_index"][row]) if bitwise else row, [float(diff.double().sum())]))
            sums[L + 3] += diff.numel()
    if not bitwise:
        sums[L + 2] = sum(v for _, [v] in keyed)  # this rank's rows in order, then over ranks with the counts
    global_counts(sums)
    if bitwise:  # every rank's rows, in sample order: the total on every rank
        sums[L + 2] = canonical_sum([k for k, _ in keyed], [v for _, v in keyed], 1)[0]
    out = mismatch_metrics(sums[:L], int(sums[L]), int(sums[L + 1]))
    out["moe/logprob_mismatch_without_replay"] = float(sums[L + 2] / max(float(sums[L + 3]), 1.0))
    return out


class Experts:
    """The policy's mixture-of-experts terms over one RL step's updates (evenrl.train.update.minibatch_update's
    `experts`): per mini-batch the global expert counts (begin), per micro-batch the options of its forward, its
    share of the load-balancing loss and its expert load; the step's metrics at the end (a collective)."""

    def __init__(self, cfg: RunConfig, model, pad_token_id: int):
        self.state = routing.routing(model)
        self.coef, self.pad_id = cfg.algo.router_aux_loss_coef, pad_token_id
        self.sp = plan_of(model).sequence
        self.loads = torch.zeros((self.state.layers, self.state.experts), dtype=torch.long)
        # replayed tokens whose live top-k set differs, per layer and in any layer, and the replayed tokens: how far
        # the update's replay departs from the routing the model would choose at its current weights
        self.differs = torch.zeros(self.state.layers + 2, dtype=torch.float64)
        self.aux, self.minibatches = 0.0, 0
        # bitwise: each micro-batch's share of the load-balancing loss under its canonical key (mini-batch, first
        # sample), added in that order in metrics (its fp64 sum over ranks would follow the layout)
        self.bitwise, self.keyed_aux, self.key = cfg.train.reproducibility == "bitwise", [], 0
        self.counts, self.routed = None, 0.0
        self.recorded: dict[int, Tensor] = {}

    def begin(self, model, batch: Batch, micro_rows: list[list[int]]) -> None:
        """The mini-batch's expert counts and routed tokens over every rank (the load-balancing loss needs them
        before its first backward): from the batch's routes, else recorded now and replayed by the update."""
        self.minibatches += 1
        if not self.coef:
            return
        self.recorded = {}
        if "routes" not in batch:
            got: dict[int, Tensor] = {}
            with routing.options(model, record=True, replay=False):
                compute_logprobs(model, batch, micro_rows, temperature=1.0, pad_token_id=self.pad_id,
                                 after=_collect(self.state, got))
            self.recorded = got
        rows = [r for m in micro_rows for r in m]
        every = self.recorded or dict(enumerate(torch.split(batch["routes"].values,
                                                            batch["routes"].lengths.tolist())))
        routes = [every[r] for r in rows]
        E = self.state.experts
        local = torch.zeros(E + 1, dtype=torch.float64)
        if routes and (self.sp is None or self.sp.index == 0):  # the group's ranks hold the same whole rows
            ids = torch.cat(routes)
            local[:E] = torch.bincount(ids.flatten().long(), minlength=E).double()
            local[E] = ids.shape[0] * ids.shape[1]  # tokens x MoE layers
        global_counts(local)
        self.counts, self.routed = local[:E], float(local[E])

    @contextlib.contextmanager
    def forward(self, model, mb: Batch, rows: list[int]):
        """A micro-batch's forward: the routes recorded by begin replayed, the loads kept, the probability sums
        kept for the load-balancing loss."""
        if self.bitwise:
            self.key = (self.minibatches << 40) + int(mb["sample_index"][0])
        if self.recorded:
            mb["routes"] = Ragged.of([self.recorded[r] for r in rows], self.state.dtype)
        with routing.options(model, stats=True, balance=self.coef > 0):
            yield
        plan = self.state.plan
        self.loads += plan.stacked("loads")
        if plan.differs:  # each rank of a sequence group compares its own slice of the rows: summed in metrics
            differs = plan.stacked("differs")  # [L, n]
            self.differs[:-2] += differs.sum(dim=1)
            self.differs[-2] += differs.any(dim=0).sum()
            self.differs[-1] += plan.replayed.sum()

    def balance_loss(self, model) -> Tensor | float:
        """The last forward's share of its mini-batch's load-balancing loss, weighted (0.0 when off)."""
        if not self.coef:
            return 0.0
        prob_sums = sum(self.state.plan.prob_sums.values())
        aux = balance_loss(prob_sums, self.counts.to(prob_sums.device), self.routed, self.state.experts)
        self.aux += float(aux.detach())
        if self.sp is None or self.sp.index == 0:  # a sequence group's ranks compute the same share: one counts it
            self.keyed_aux.append((self.key, [float(aux.detach())]))
        return self.coef * aux

    def metrics(self) -> dict:
        """Expert load per layer, the load-balancing loss (its mean over the step's optimizer steps) and, where the
        update replayed routes, the share of them the model's own routing would have changed (`moe/update_*`: with
        replayed sampling-time routes, the later mini-batches' weights route some tokens elsewhere), summed over
        ranks: a collective every training rank joins."""
        n = self.loads.numel()
        flat = global_counts(torch.cat([self.loads.flatten().double(), self.differs,
                                        torch.tensor([self.aux], dtype=torch.float64)]))
        out = load_metrics(flat[:n].view_as(self.loads))
        differs = flat[n:-1]
        if differs[-1] > 0:
            out.update(mismatch_metrics(differs[:-2], int(differs[-2]), int(differs[-1]), prefix="moe/update_"))
        if self.coef:
            total = (canonical_sum([k for k, _ in self.keyed_aux], [v for _, v in self.keyed_aux], 1)[0]
                     if self.bitwise else float(flat[-1]))
            out["moe/aux_loss"] = total / max(self.minibatches, 1)
        return out
