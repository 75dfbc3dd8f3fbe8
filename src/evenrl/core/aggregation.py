"""Exact loss normalisation over a mini-batch split across micro-batches and ranks (pure functions).

A mode's value over the whole mini-batch is a sum divided by a global count. Each micro-batch contributes its
local sum divided by the GLOBAL count (`Denominators`: the trainer computes them from the step's all-gathered
lengths, `evenrl.train.update.minibatch_denominators`), so summing the shares of every micro-batch on every rank,
i.e. gradient accumulation followed by a SUM all-reduce of gradients, gives exactly the single-device value and
gradient, however unevenly the rows are spread. (Under DDP/FSDP, which average gradients over W, multiply the share by W.)

Modes; `m` is the response mask, a "sequence" is a row with >= 1 masked-in token (rows with an all-zero mask, e.g.
padding rows, are not counted). The first three are verl's `loss_agg_mode` of the same name:
  token-mean           sum_{i,t} m*x / sum_{i,t} m
  seq-mean-token-mean  mean_i ( sum_t m*x / sum_t m )
  seq-mean-token-sum   mean_i ( sum_t m*x )
  seq-mean-token-sum-norm  mean_i ( sum_t m*x ) / C   (C = `Denominators.norm_tokens`, a constant length: Dr. GRPO's
                       normaliser, arXiv:2503.20783; TRL loss_type=dr_grpo divides by rows x max_completion_length.
                       It differs from seq-mean-token-sum by the factor C only, which matters with gradient clipping
                       and for the learning rate.)
  token-sum-norm       sum_{i,t} m*x / C      (no mean over rows: what verl's agg_loss computes for its own
                       "seq-mean-token-sum-norm" at 0.8.0.dev, so its value grows with the mini-batch's rows. verl's
                       default actor then scales each micro-batch by 1 / its micro-batches per mini-batch and its
                       newer engine averages over data-parallel ranks: `--from verl` folds that count into C.)

`row_sums` gives per-row sums and token counts: the per-sequence numbers sequence-level quantities (GSPO's ratio,
sequence-level importance weights) are built from, so that they can be all-reduced where a row is split.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import Tensor

from evenrl.errors import bad

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
         "token-sum-norm")


@dataclass(frozen=True)
class Denominators:
    tokens: float  # masked-in tokens
    seqs: float    # rows with at least one masked-in token
    norm_tokens: float = 1.0  # the *-norm modes' constant length (algo.loss_norm_tokens)


def aggregate(per_token: Tensor, mask: Tensor, mode: str, denom: Denominators) -> Tensor:
    """This micro-batch's share of the mode's value over the whole mini-batch.

    per_token [B, T] (e.g. per-token loss), mask [B, T], denom: global counts of the mini-batch.
    Masked-out entries are ignored even if they hold inf/nan. An empty micro-batch (B == 0) gives 0.
    """
    if mode not in MODES:
        raise bad("loss_agg_mode", mode, "one of " + ", ".join(MODES))
    keep = mask.bool()
    x = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if mode == "token-mean":
        return x.sum() / max(denom.tokens, 1.0)
    if mode == "token-sum-norm":
        return x.sum() / denom.norm_tokens
    row_sum = x.sum(-1)
    if mode == "seq-mean-token-mean":
        row_sum = row_sum / keep.sum(-1).clamp(min=1).to(x.dtype)
    if mode == "seq-mean-token-sum-norm":
        return row_sum.sum() / (max(denom.seqs, 1.0) * denom.norm_tokens)
    return row_sum.sum() / max(denom.seqs, 1.0)


def row_sums(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of x over each row's masked tokens [B], the row's masked-token count [B], in x's dtype).

    A row here is a whole sequence (samples are never split over ranks). Where sequence parallelism splits one
    sequence over a group of ranks, each holds part of the row: summing both outputs over that group gives the
    whole sequence's, and every sequence-level quantity evenrl forms (a mean log-ratio, a product of ratios) is
    a function of these two numbers alone."""
    keep = mask.bool()
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1), keep.sum(-1).to(x.dtype)
