"""The pieces of a gradient step shared by `evenrl train` and `evenrl sft`.

Rows are stored pad-free in a Batch: `tokens` (ragged: prompt + response ids) and `response_len` ([N]).
A micro-batch is left-padded so every row's response sits at the right edge; only the last
`max(response_len)` positions go through the LM head (the logits tensor, tokens x vocab, is the usual
hidden memory peak). Per-token tensors are then [B, R] with each row's response right-aligned.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from evenrl import dist
from evenrl.aggregation import Denominators, aggregate
from evenrl.algos import entropy_from_logits, token_logprobs
from evenrl.batch import Batch


def response_logits(model, batch: Batch, pad_token_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Forward a micro-batch. Returns (logits [B, R, V] predicting each response token, targets [B, R],
    mask [B, R]) where R = longest response in the micro-batch."""
    tokens, attn = batch.padded("tokens", pad_token_id, side="left")
    tokens, attn = tokens.to(model.device), attn.to(model.device)
    resp_len = batch["response_len"].to(model.device)
    width = int(resp_len.max())
    # Explicit positions: HF models default to 0..L-1 regardless of left padding.
    position_ids = (attn.long().cumsum(-1) - 1).clamp_(min=0)
    out = model(input_ids=tokens, attention_mask=attn.long(), position_ids=position_ids,
                logits_to_keep=width + 1, use_cache=False)
    logits = out.logits[:, :-1]
    targets = tokens[:, -width:]
    mask = torch.arange(width, device=tokens.device)[None, :] >= (width - resp_len)[:, None]
    return logits, targets, mask


def ragged_to_right_aligned(batch: Batch, name: str, device) -> Tensor:
    """A per-response-token ragged column as [B, R], right-aligned like response_logits' outputs."""
    values, _ = batch.padded(name, 0.0, side="left")
    return values.to(device)


@torch.no_grad()
def compute_logprobs(model, batch: Batch, micro_rows: list[list[int]], *, temperature: float,
                     pad_token_id: int) -> list[Tensor]:
    """Per-row response log-probs (1-D tensors, in batch row order) computed micro-batch by micro-batch."""
    out: list[Tensor | None] = [None] * len(batch)
    was_training = model.training
    model.eval()
    for rows in micro_rows:
        if not rows:
            continue
        mb = batch.select(rows)
        logits, targets, mask = response_logits(model, mb, pad_token_id)
        logp = token_logprobs(logits, targets, temperature)
        for j, r in enumerate(rows):
            out[r] = logp[j][mask[j]].float().cpu()
    model.train(was_training)
    return out  # type: ignore[return-value]


def local_denominators(batch: Batch, micro_rows: list[list[int]]) -> Denominators:
    """This rank's share of a mini-batch's loss denominators (response tokens, sequences)."""
    rows = [r for mr in micro_rows for r in mr]
    lens = batch["response_len"][rows] if rows else torch.zeros(0)
    return Denominators(tokens=float(lens.sum()), seqs=float(len(rows)))


# loss_fn(logits, targets, mask, micro_batch) -> (per_token_loss [B, R], stats {name: (sum, count)})
LossFn = Callable[[Tensor, Tensor, Tensor, Batch], tuple[Tensor, dict]]


def minibatch_update(model, optimizer, lr_scheduler, batch: Batch, micro_rows: list[list[int]], *,
                     loss_fn: LossFn, stat_names: list[str], aggregation: str, max_grad_norm: float, pad_token_id: int) -> dict:
    """One optimizer step over this rank's micro-batches of one mini-batch, exact across ranks:
    losses are divided by the mini-batch's GLOBAL token/sequence counts and gradients are SUM-reduced,
    so the step equals the one a single device would take on the whole mini-batch."""
    denom = dist.global_denominators(local_denominators(batch, micro_rows))
    sums: dict[str, list[float]] = {}
    for rows in micro_rows:
        if not rows:  # zero-weight filler: nothing to forward; collectives happen once per mini-batch below
            continue
        mb = batch.select(rows)
        logits, targets, mask = response_logits(model, mb, pad_token_id)
        per_token, stats = loss_fn(logits, targets, mask, mb)
        aggregate(per_token, mask, aggregation, denom).backward()
        for k, (s, c) in stats.items():
            acc = sums.setdefault(k, [0.0, 0.0])
            acc[0] += float(s)
            acc[1] += float(c)
    params = [p for p in model.parameters() if p.requires_grad]
    dist.all_reduce_grads(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    optimizer.step()
    if lr_scheduler is not None:
        lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # stats are (sum, count) pairs so their global means are exact too; every rank reduces the same names
    flat = torch.tensor([v for k in stat_names for v in sums.get(k, [0.0, 0.0])], dtype=torch.float64)
    dist.all_reduce_sum(flat)
    means = {k: float(flat[2 * i] / max(float(flat[2 * i + 1]), 1.0)) for i, k in enumerate(stat_names)}
    means["grad_norm"] = float(grad_norm)
    return means


def entropy_stats(logits: Tensor, mask: Tensor, temperature: float) -> tuple[float, float]:
    """(sum, count) of the sampling distribution's entropy over response tokens, for the metrics."""
    with torch.no_grad():
        ent = entropy_from_logits(logits, temperature)
        return float((ent * mask).sum()), float(mask.sum())
