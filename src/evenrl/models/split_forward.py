"""The training forward of a micro-batch whose rows are packed back to back into one row and, under sequence
parallelism, split over a group of ranks: each rank runs the model's own forward on its contiguous slice of the
packed tokens (positions restarting at each row), the attention registered by evenrl.distributed.sequence joins the
slices (all-to-all) and keeps each row causal within itself, and the output layer computes only the positions of
this slice that predict response tokens. Those per-token outputs (log-probs and entropies, or values) are then
gathered to every rank of the group, so each returns the same [B, R, k] as evenrl.models.forward's other paths.

No rank holds a row padded to the longest sample: the only padding is at the packed row's end, up to a multiple of
the group size. The model's own forward keeps activation checkpointing, LoRA and FSDP2 working; with a group of one
this is the packed path of a checkpointed model.

A vision-language mixture of experts (Qwen3-VL-MoE) packs its rows with their images, on one rank (sequence
parallelism is refused for images): each row's own M-RoPE positions, the images' features and DeepStack features on
their tokens (evenrl.models.vision.packed_images); its logits and gradients are the model's own padded forward's.

A mixture of experts' routers get the plan of this call (evenrl.models.routing.packed_plan): the micro-batch's
recorded routes replayed at this slice's positions, and with recording on, the routes used gathered back to whole
rows.

The group (the model's plan's `sequence`, core.model_plan, recorded by evenrl.distributed.sequence.sequence_parallel) is
used through
`size`, `index`, `attention_kwargs(bounds)` and `gather_outputs(x, counts)`.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor

from evenrl.core.batch import Batch, response_mask
from evenrl.core.model_plan import plan_of
from evenrl.models.loading import compute_device
from evenrl.models.routing import packed_plan, route_rows
from evenrl.models.vision import is_vision_model, packed_images

# A 4-D mask is passed through transformers' mask builders untouched: the attention masks by segment itself, so no
# [L, L] mask is built for a long packed row.
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def packs(model) -> bool:
    """Whether the packed forward runs `model` as its own padded forward would: its attention goes through
    transformers' attention interface (`_supports_attention_backend`: the packed attention is registered there,
    evenrl.distributed.sequence), its positions are rotary ones taken from position_ids (so each row's restart at 0
    is that row's own; a learned absolute table read from the attention mask, OPT's, would not), and its attention
    has no logit softcap (Gemma 2's, which the packed attention does not implement). Qwen2/2.5/3, Llama, Mistral,
    Gemma 3, OLMo, Phi-3 and the dense and mixture vision-language models here pack; GPT-2, OPT and Gemma 2 train by
    the model's own masked forward."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    text = model.config.get_text_config()
    return (bool(getattr(model, "_supports_attention_backend", False)) and hasattr(decoder, "rotary_emb")
            and getattr(text, "attn_logit_softcapping", None) is None)


def split_forward(model, batch: Batch, head: Callable | None, output_layer_computes) -> tuple[Tensor, Tensor, Tensor]:
    """(outputs [B, R, k], targets [B, R], mask [B, R]) as evenrl.models.forward.response_logits returns them.
    output_layer_computes(model, head, targets): forward's context that has the output layer compute `head`."""
    sp = plan_of(model).sequence
    device = compute_device(model)
    tok = batch["tokens"]
    ids, lengths = tok.values.to(device), tok.lengths.to(device)
    resp_len = batch["response_len"].to(device)
    width, T, S = int(resp_len.max()), len(ids), sp.size
    ends = torch.cumsum(lengths, 0)
    target_at = torch.maximum(ends[:, None] - width + torch.arange(width, device=device)[None, :],
                              (ends - lengths + 1)[:, None]).clamp_(max=T - 1)
    mask = response_mask(resp_len, width)
    targets = ids[target_at]

    per_rank = -(-T // S)  # each rank's slice of the packed row, padded at the end to S slices
    padded = per_rank * S
    pos = torch.arange(T, device=device) - torch.repeat_interleave(ends - lengths, lengths, output_size=T)
    ids = torch.cat([ids, ids.new_zeros(padded - T)])
    pos = torch.cat([pos, torch.arange(padded - T, device=device)])
    fed = ids
    with _images(model, batch, ids, lengths, resp_len, S) as images:
        if images is not None:  # one rank holds the whole row: M-RoPE positions, the images, maybe a blank image
            fed, pos = images.ids, images.positions
            padded = per_rank = len(fed)
        predicting = (target_at - 1)[mask]  # packed positions whose output predicts a response token, in order
        counts = torch.bincount(predicting // per_rank, minlength=S).tolist()
        lo = sp.index * per_rank
        mine = predicting[(predicting >= lo) & (predicting < lo + per_rank)]
        bounds = [0, *ends.tolist()] + ([padded] if padded > T else [])
        plan = packed_plan(model, batch, lo, per_rank, padded)  # a mixture of experts' routes (None: dense)
        with output_layer_computes(model, head, ids[mine + 1][None]):
            out = model(input_ids=fed[None, lo:lo + per_rank], position_ids=pos[..., None, lo:lo + per_rank],
                        attention_mask=_NO_MASK.to(device), logits_to_keep=mine - lo, use_cache=False,
                        **({} if images is None else images.inputs), **sp.attention_kwargs(bounds))
    if plan is not None and plan.record:  # every rank of the group gets the routes of the whole rows
        plan.rows = route_rows(sp.gather_outputs(plan.stacked("used"), [per_rank] * S).cpu(), tok.lengths.cpu())
    gathered = sp.gather_outputs(out.logits[0], counts)  # [response tokens of the micro-batch, k]
    outputs = gathered.new_zeros(len(lengths), width, gathered.shape[-1])
    outputs[mask] = gathered
    return outputs, targets, mask


@contextlib.contextmanager
def _images(model, batch: Batch, ids: Tensor, lengths: Tensor, response_len: Tensor, size: int):
    """A vision-language model's PackedImages (evenrl.models.vision.packed_images); None for a text model."""
    if not is_vision_model(model):
        yield None
        return
    if size > 1:  # the plan and the run refuse it first (config.compatibility: sequence-parallel-vision)
        raise RuntimeError("a vision-language model's packed row cannot be split over a sequence-parallel group")
    with packed_images(model, batch, ids, lengths, response_len) as images:
        yield images
