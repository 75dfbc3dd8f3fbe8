"""Ulysses sequence parallelism, applied to a model from outside it: each sample's tokens are split over a group of
S training ranks (`parallel.sequence_parallel_size`); the model's norms, projections and MLP run on the rank's own
slice, and attention switches from sequence-sharded to head-sharded with one all-to-all and back with another.

The attention is registered through transformers' `AttentionInterface` (`sequence_parallel(model, group)` sets it on
the model), so any model whose attention calls the interface (Qwen2, Qwen2.5, Qwen3, Llama) runs unchanged; the
model's own forward does everything else, with activation checkpointing, LoRA and FSDP2 as usual. A forward without
the `evenrl_segments` keyword (generation, a plain padded forward) falls through to transformers' SDPA attention.

Sliding-window layers and attention sinks (gpt-oss) run as the model defines them, within each row; a model whose
own attention is eager (no SDPA: gpt-oss) keeps its eager attention for the forwards that are not split
(generation), under a second registered name whose masks are eager ones.

What evenrl.models.forward hands the attention (`Segments`): the micro-batch's rows packed back to back into one
row, padded at the end to a multiple of S, cut into S contiguous slices; and the packed row's segment bounds, so
that attention after the all-to-all (the whole sequence, H/S heads) runs causal within each row only — no rank ever
holds a row padded to the longest sample. KV heads not divisible by S are repeated to lcm(KV heads, S) first.

Exactness: the all-to-all is its own adjoint (the backward moves gradients back with the inverse all-to-all), so
the parameter gradients summed over the group are the unsplit ones; the per-token outputs (log-probs, entropies,
values: a few numbers per token, never logits) are gathered to every rank of the group (`gather_outputs`), whose
backward hands each rank the gradient of its own slice only. Every rank of a group then computes the same loss from
the same outputs, and its backward reaches each token once. Tested against the unsplit computation on gloo
(tests/test_sequence_parallel.py). gloo writes a wrong layout into non-contiguous buffers (../shared FIELD_NOTES):
every buffer here is made contiguous first.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import Tensor

from evenrl.core.model_plan import record
from evenrl.errors import UsageError

NAME = "evenrl_ulysses"  # the attention implementation's name in transformers' registries
NAME_EAGER = "evenrl_ulysses_eager"  # the same for a model whose own attention is eager: eager masks and fall-through


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: `size` ranks (global ranks start..start+size-1), this one `index`-th."""

    group: object | None  # the process group; None when size is 1
    size: int
    index: int

    def gather_outputs(self, x: Tensor, counts: list[int]) -> Tensor:
        """Every rank's [counts[r], ...] rows concatenated in rank order, on every rank of the group; the backward
        returns this rank's rows of the gradient (every rank computes the same function of the result)."""
        if self.size == 1:
            return x
        return _GatherReplicated.apply(x, counts, self)

    def attention_kwargs(self, bounds: list[int]) -> dict:
        """The keyword the model's forward passes down to `ulysses_attention`: the packed row's segment bounds."""
        return {"evenrl_segments": Segments(self, tuple(bounds))}


@dataclass(frozen=True)
class Segments:
    """What the attention of a packed, sequence-split forward needs: the group and the packed row's segment bounds
    (global positions, the last one = the padded length)."""

    sp: SequenceGroup
    bounds: tuple[int, ...]


def _all_to_all(x: Tensor, sp: SequenceGroup) -> Tensor:
    """x [S, ...] (chunk j goes to rank j) -> [S, ...] (chunk i came from rank i)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    tdist.all_to_all_single(out, x, group=sp.group)
    return out


def _seq_to_heads(x: Tensor, sp: SequenceGroup) -> Tensor:
    """[h, Ls, D] (all heads, this rank's slice) -> [h/S, S*Ls, D] (this rank's heads, the whole sequence)."""
    S, (h, ls, d) = sp.size, x.shape
    got = _all_to_all(x.reshape(S, h // S, ls, d), sp)  # [S: source slice, h/S, Ls, D]
    return got.transpose(0, 1).reshape(h // S, S * ls, d)


def _heads_to_seq(x: Tensor, sp: SequenceGroup) -> Tensor:
    """The inverse: [h/S, S*Ls, D] -> [h, Ls, D]."""
    S, (hs, L, d) = sp.size, x.shape
    got = _all_to_all(x.reshape(hs, S, L // S, d).transpose(0, 1), sp)  # [S: source heads, h/S, Ls, D]
    return got.reshape(S * hs, L // S, d)


class _AllToAll(torch.autograd.Function):
    """Sequence-sharded to head-sharded (to_heads) or back; the backward is the other direction."""

    @staticmethod
    def forward(ctx, x, sp, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return _seq_to_heads(x, sp) if to_heads else _heads_to_seq(x, sp)

    @staticmethod
    def backward(ctx, g):
        return (_heads_to_seq(g, ctx.sp) if ctx.to_heads else _seq_to_heads(g, ctx.sp)), None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, sp):
        width = max(counts)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = [torch.empty_like(padded) for _ in range(sp.size)]
        tdist.all_gather(out, padded, group=sp.group)
        ctx.start, ctx.n = sum(counts[: sp.index]), x.shape[0]
        return torch.cat([out[r][:n] for r, n in enumerate(counts)])

    @staticmethod
    def backward(ctx, g):
        return g[ctx.start: ctx.start + ctx.n], None, None


def ulysses_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *, dropout: float = 0.0,
                      scaling: float | None = None, evenrl_segments: Segments | None = None, **kwargs):
    """transformers' attention signature: query [1, H, Ls, D], key/value [1, Hk, Ls, D] of this rank's slice ->
    ([1, Ls, H, D], None). Without `evenrl_segments`: SDPA attention, as the model would run it."""
    if evenrl_segments is None:
        if getattr(getattr(module, "config", None), "_attn_implementation", None) == NAME_EAGER:
            # the model family's own eager attention (gpt-oss: with its sinks), as the model would run it
            eager = sys.modules[type(module).__module__].eager_attention_forward
            return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None:  # silently plain attention would train a different model
        raise UsageError("parallel.sequence_parallel_size: this model's attention uses softcap, which the "
                         "sequence-parallel attention does not implement; use parallel.sequence_parallel_size=1 and "
                         "model.gradient_checkpointing=false")
    window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
    seg, sp = evenrl_segments, evenrl_segments.sp
    H, Hk = query.shape[1], key.shape[1]
    if Hk % sp.size:  # the plan says so: each rank needs whole KV heads for its query heads
        repeat = math.lcm(Hk, sp.size) // Hk  # divides H / Hk, since SP divides the query heads
        key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
        Hk *= repeat
    q, k, v = query[0], key[0], value[0]
    if sp.size > 1:
        q, k, v = (_AllToAll.apply(t, sp, True) for t in (q, k, v))
    if sinks is not None:  # this rank's heads' sinks
        sinks = sinks.reshape(-1)[sp.index * q.shape[0]:(sp.index + 1) * q.shape[0]]
    spans = [(a, b) for a, b in zip(seg.bounds[:-1], seg.bounds[1:]) if b > a]
    if window is None and sinks is None:
        o = _rows_attention(q, k, v, spans, scaling, dropout)
    else:
        o = torch.cat([_segment_attention(q[:, a:b], k[:, a:b], v[:, a:b], scaling, dropout, window, sinks)
                       for a, b in spans], dim=1)  # [H/S, L, D]
    if sp.size > 1:
        o = _AllToAll.apply(o, sp, False)
    return o.transpose(0, 1)[None].contiguous(), None


def _rows_attention(q: Tensor, k: Tensor, v: Tensor, spans: list[tuple[int, int]], scaling: float | None,
                    dropout: float) -> Tensor:
    """Causal attention within each row [a, b) of the packed q [h, L, D], k/v [hk, L, D] -> [h, L, Dv], rows of
    about one length in one SDPA call: right-padded to the bucket's longest (causal attention never lets a real
    token see the pads after it), a bucket taking rows, longest first, while its padded work (rows x longest^2) is at
    most twice its rows' own. One call per row cost ~0.5 ms per row and layer on CPU, so many short rows (GRPO
    groups) were 1.6x slower than a padded forward (benchmarks/forward_paths.py)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][0] - spans[i][1])  # longest first
    buckets: list[list[int]] = []
    work = 0
    for i in order:
        n = spans[i][1] - spans[i][0]
        if buckets:
            top = spans[buckets[-1][0]][1] - spans[buckets[-1][0]][0]
            if (len(buckets[-1]) + 1) * top * top <= 2 * (work + n * n):
                buckets[-1].append(i)
                work += n * n
                continue
        buckets.append([i])
        work = n * n
    gqa = q.shape[0] != k.shape[0]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for rows in buckets:
        if len(rows) == 1:
            a, b = spans[rows[0]]
            o = F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], is_causal=True,
                                               dropout_p=dropout, scale=scaling, enable_gqa=gqa)[0]
            out = out.index_copy(1, torch.arange(a, b, device=q.device), o)
            continue
        width = spans[rows[0]][1] - spans[rows[0]][0]
        at = torch.cat([torch.arange(*spans[r], device=q.device) for r in rows])  # packed positions
        slot = torch.cat([j * width + torch.arange(spans[r][1] - spans[r][0], device=q.device)
                          for j, r in enumerate(rows)])  # their places in the [rows, width] block

        def block(t: Tensor) -> Tensor:  # [heads, L, D] -> [rows, heads, width, D], right-padded
            return t.new_zeros(t.shape[0], len(rows) * width, t.shape[-1]).index_copy(1, slot, t[:, at]) \
                .unflatten(1, (len(rows), width)).transpose(0, 1)
        o = F.scaled_dot_product_attention(block(q), block(k), block(v), is_causal=True, dropout_p=dropout,
                                           scale=scaling, enable_gqa=gqa)  # [rows, h, width, Dv]
        out = out.index_copy(1, at, o.transpose(0, 1).flatten(1, 2)[:, slot])
    return out


def _segment_attention(q: Tensor, k: Tensor, v: Tensor, scaling: float | None, dropout: float, window: int | None,
                       sinks: Tensor | None) -> Tensor:
    """Causal attention within one row: q [h, n, D], k/v [hk, n, D] -> [h, n, Dv]. A sliding window lets a query see
    the last `window` keys (itself included), as transformers' sliding_window_overlay; sinks (one logit per head)
    join each softmax as an extra column that is then dropped, computed as the model's eager attention computes
    them."""
    if window is None and sinks is None:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, dropout_p=dropout,
                                              scale=scaling, enable_gqa=q.shape[0] != k.shape[0])[0]
    n = q.shape[1]
    i = torch.arange(n, device=q.device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    if sinks is None:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed, dropout_p=dropout,
                                              scale=scaling, enable_gqa=q.shape[0] != k.shape[0])[0]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    scores = torch.cat([scores, sinks.reshape(-1, 1, 1).expand(-1, n, 1).to(scores.dtype)], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs.to(v.dtype), v)


def register() -> None:
    """Make NAME a valid attention implementation (and its mask transformers' SDPA mask, for the fall-through)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    from transformers.masking_utils import eager_mask

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, ulysses_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        AttentionInterface.register(NAME_EAGER, ulysses_attention)
        AttentionMaskInterface.register(NAME_EAGER, eager_mask)


def sequence_parallel(model, sp: SequenceGroup) -> None:
    """Apply sequence parallelism to `model` in place: its attention becomes `ulysses_attention` and the training
    forward (evenrl.models.forward) finds the group in the model's plan (`core.model_plan`: `plan.sequence`). Size 1 is the packed forward
    of one rank (rows back to back, attention within each row): what activation checkpointing uses."""
    register()
    tower = getattr(model.config, "vision_config", None)
    own = tower._attn_implementation if tower is not None else None
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        if config._attn_implementation not in (NAME, NAME_EAGER):
            config._attn_implementation = NAME_EAGER if config._attn_implementation == "eager" else NAME
    if tower is not None:  # a vision tower keeps its own attention within each image (a top config's setting
        tower._attn_implementation = own  # reaches its sub-configs); it ignores the segments it is passed
    record(model).sequence = sp
