"""The pieces of a gradient step shared by `evenrl train` and `evenrl sft`.

Rows are stored pad-free in a Batch: `tokens` (ragged: prompt + response ids) and `response_len` ([N]).
A forward (evenrl.models.forward: `response_logprobs` for a policy, `response_logits` for a critic's values) runs a
micro-batch by the cheapest exact path the model allows; per-token tensors are then [B, R], R = the longest
response, with each row's response right-aligned.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from torch import Tensor

from evenrl.core.aggregation import Denominators, aggregate
from evenrl.core.batch import Batch, Ragged, ragged_to_right_aligned
from evenrl.distributed import collectives as dist
from evenrl.errors import NonFinite
from evenrl.models.forward import response_logits, response_logprobs
from evenrl.models.loading import forwards_meet
from evenrl.models.vision import images_in, tower_parameters
from evenrl.train.reduction import Reduction, reduction_of


# forward(model, micro_batch) -> (outputs [B, R, k], targets [B, R], mask [B, R]): response_logprobs, response_logits
Forward = Callable[[torch.nn.Module, Batch], tuple[Tensor, Tensor, Tensor]]


def compute_logprobs(model, batch: Batch, micro_rows: list[list[int]], *, temperature: float,
                     pad_token_id: int, after: Callable[[list[int]], None] | None = None) -> list[Tensor]:
    """Per-row response log-probs (1-D tensors, in batch row order) computed micro-batch by micro-batch;
    after(rows) runs after each micro-batch's forward (a mixture of experts' routes are read there)."""
    return _per_response_token(model, batch, micro_rows, pad_token_id,
                               lambda m, mb: response_logprobs(m, mb, pad_token_id, temperature=temperature), after)


def filler_row(pad_token_id: int) -> Batch:
    """A one-row micro-batch (two pad tokens, one counted as response) for a sharded model's zero-weight passes."""
    return Batch({"tokens": Ragged.of([torch.tensor([pad_token_id, pad_token_id])], torch.long),
                  "response_len": torch.tensor([1], dtype=torch.long)})


def compute_values(critic, batch: Batch, micro_rows: list[list[int]], *, pad_token_id: int) -> list[Tensor]:
    """Per-row values of each response token's state under a value model (a causal LM whose head outputs one
    number, evenrl.models.loading.with_value_head), 1-D float32 tensors in batch row order."""
    return _per_response_token(critic, batch, micro_rows, pad_token_id,
                               lambda m, mb: response_logits(m, mb, pad_token_id))


@torch.no_grad()
def _per_response_token(model, batch: Batch, micro_rows: list[list[int]], pad_token_id: int,
                        forward: Forward, after: Callable[[list[int]], None] | None = None) -> list[Tensor]:
    """The first output per token (a log-prob, a value) of forward(model, micro_batch) -> (outputs [B, R, k],
    targets, mask) for each micro-batch, cut to each row's response tokens: 1-D float32 tensors in batch row order.
    A model whose forwards are collectives (FSDP2, expert parallelism) runs a filler forward for an empty
    micro-batch (every rank the same number of forwards)."""
    out: list[Tensor | None] = [None] * len(batch)
    was_training = model.training
    model.eval()
    meet = forwards_meet(model)
    for rows in micro_rows:
        if not rows:
            if meet:
                response_logits(model, filler_row(pad_token_id), pad_token_id)
            continue
        outputs, _, mask = forward(model, batch.select(rows))
        if after is not None:
            after(rows)
        per_token = outputs[..., 0]
        for j, r in enumerate(rows):
            out[r] = per_token[j][mask[j]].float().cpu()
    model.train(was_training)
    return out  # type: ignore[return-value]


def minibatch_denominators(response_len, rows, norm_tokens: float = 1.0) -> Denominators:
    """A mini-batch's loss denominators (response tokens, sequences with >= 1 response token, and the constant
    length of seq-mean-token-sum-norm, algo.loss_norm_tokens) over ALL its rows,
    from the step's global per-sample lengths: every rank computes the same numbers without a collective, and
    rows that no rank runs (inert, zero gradient) still count, as they would on one device."""
    lens = torch.as_tensor(response_len)[torch.as_tensor(list(rows), dtype=torch.long)]
    return Denominators(tokens=float(lens.sum()), seqs=float((lens > 0).sum()), norm_tokens=float(norm_tokens))


# loss_fn(outputs, targets, mask, micro_batch) -> (per_token_loss [B, R], stats {name: (sum, count)})
LossFn = Callable[[Tensor, Tensor, Tensor, Batch], tuple[Tensor, dict]]


def minibatch_update(model, optimizer, lr_scheduler, batch: Batch, micro_rows: list[list[int]], denom: Denominators,
                     *, forward: Forward, loss_fn: LossFn, stat_names: list[str], aggregation: str,
                     max_grad_norm: float, pad_token_id: int, busy=None, experts=None, seed: int = 0,
                     reduction: Reduction | None = None) -> dict:
    """One optimizer step over this rank's micro-batches of one mini-batch, exact across ranks:
    losses are divided by the mini-batch's GLOBAL token/sequence counts (`denom`, from minibatch_denominators)
    and gradients are SUM-reduced, so the step equals the one a single device would take on the whole mini-batch.
    Under sequence parallelism every rank of a group runs the group's micro-batches (each its slice of the tokens)
    and computes the same loss and statistics: its first rank alone counts them.
    busy: an evenrl.train.balance.Busy that gets the time and tokens of the forward and backward passes (the
    rank's own work, before it waits for the others in the gradient reduction).
    experts: a mixture of experts' evenrl.train.moe.Experts: the mini-batch's expert counts gathered first (a
    collective), then each micro-batch's share of the load-balancing loss and its expert load.
    reduction: how gradients and statistics are summed over micro-batches and ranks (train.reduction: float or exact,
    replicated or sharded), the one parallelize chose for the model (reduction_of; the default); `seed` is the
    mini-batch's, from which an exact one seeds each micro-batch's dropout."""
    started = time.perf_counter()
    reduce = reduction or reduction_of(model)
    meet = forwards_meet(model)
    c = dist.coords()  # the sequence group's first rank counts what all of its ranks computed (every tensor-parallel
    counts = c is None or c.sp == 0  # rank does: the statistics are summed over the data group only)
    reduce.begin([p for p in model.parameters() if p.requires_grad], seed)
    if experts is not None:
        experts.begin(model, batch, micro_rows)
    for rows in micro_rows:
        if not rows:
            if meet:  # zero-weight filler: FSDP's gathers and reduce-scatters, EP's all-to-alls meet on every rank
                logits, _, _ = response_logits(model, filler_row(pad_token_id), pad_token_id)
                (logits.sum() * 0.0).backward()
                reduce.backward_done()
            continue  # replicated: nothing to forward; collectives happen once per mini-batch below
        mb = batch.select(rows)
        reduce.micro_batch(mb)
        with experts.forward(model, mb, rows) if experts is not None else contextlib.nullcontext():
            outputs, targets, mask = forward(model, mb)
        if "loss_mask" in mb:  # a trajectory's environment tokens: no loss, no statistic, no count
            mask = mask & ragged_to_right_aligned(mb, "loss_mask", mask.device)
        per_token, stats = loss_fn(outputs, targets, mask, mb)
        loss = aggregate(per_token, mask, aggregation, denom)
        (loss if experts is None else loss + experts.balance_loss(model)).backward()
        reduce.backward_done()
        if counts:  # stats are (sum, count) pairs so their global means are exact too; every rank the same names
            reduce.add([float(v) for k in stat_names for v in stats.get(k, (0, 0))] + [float(images_in(mb)), 1.0])
    if busy is not None:
        busy.add(started, int(sum(batch["tokens"].lengths[rows].sum() for rows in micro_rows if rows)))
    # the parameters again, as they are now: FSDP2's registered parameters before the first forward need not be the
    # objects that hold the gradients after the backward (a critic under FSDP2 on 2 ranks clipped by a norm of 2.095
    # for the 1-process 2.233 when the list taken above was used here)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = reduce.finish(params, 2 * len(stat_names) + 2, denom.seqs)  # ... + [images, micro-batches run]
    if flat[-2] == 0:  # no image in the whole mini-batch: one device leaves its vision tower without gradients
        for p in tower_parameters(model):  # (AdamW skips it), where FSDP2's blank images gave it zeros
            p.grad = None
    if denom.seqs > 0 and all(p.grad is None for p in params):
        # Every row was skipped as zero-gradient: one device running them would step AdamW on zero gradients
        # (momentum and weight decay still move the weights), so do exactly that.
        for p in params:
            p.grad = torch.zeros_like(p)
    grad_norm = reduce.clip(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # sharded: a DTensor
    # Both numbers are global (summed over ranks above), so every rank stops here together, before the optimizer
    # could write a NaN into the weights.
    if not torch.isfinite(flat).all() or not torch.isfinite(grad_norm):
        bad = [k for i, k in enumerate(stat_names) if not torch.isfinite(flat[2 * i])]
        what = f"loss statistic {bad[0]}" if bad else "gradient norm"
        value = float(flat[2 * stat_names.index(bad[0])]) if bad else float(grad_norm)
        raise NonFinite(f"non-finite {what} ({value}); this optimizer step was not taken and nothing of the step "
                         "is saved")
    optimizer.step()
    if lr_scheduler is not None:
        lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    means = {k: float(flat[2 * i] / max(float(flat[2 * i + 1]), 1.0)) for i, k in enumerate(stat_names)}
    means["grad_norm"] = float(grad_norm)
    return means
