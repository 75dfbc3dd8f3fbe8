"""The training forward: a micro-batch of prompt + response rows -> what predicts each response token.

Rows are stored pad-free in a Batch: `tokens` (ragged: prompt + response ids) and `response_len` ([N]).
`response_logits` forwards a micro-batch by one of four paths, each through the model's own forward:

  packed   the rows back to back in one row, attention within each (models.split_forward), split over a
           sequence-parallel group or on one rank: every model whose attention goes through transformers' interface
           with rotary positions (models.split_forward.packs: Qwen2/2.5/3, Llama, Mistral, Gemma 3, ...), the
           vision-language ones with their images and each row's M-RoPE positions (models.vision.packed_images),
           any text model with activation checkpointing, tensor parallelism or experts, as
           evenrl.train.parallelize.split_sequences gives them the group;
  shared   each distinct prompt run once and its keys/values copied to its samples, where that saves enough and
           runs fewer tokens than the packed rows would (a GRPO group with a long prompt: 4 prompts of 96 tokens x 8
           samples, 2.1x faster than packed on CPU for a Qwen3, benchmarks/forward_paths.py); text models only;
  vision   a vision-language model's own left-padded forward with its images and M-RoPE positions: the reference
           the tests compare the packed path with (a model nothing was applied to);
  masked   the model's own left-padded masked forward: a model that cannot pack (GPT-2, OPT: learned absolute
           positions; Gemma 2: attention softcap), and the reference the tests compare with.

Two more paths went (issue 43, benchmarks/forward_paths.py): a hand-written packed Qwen2/Llama forward (norms,
projections and MLP on the real tokens, attention on right-padded rows) and the model's forward on right-padded
rows. On this CPU (fp32, 1 thread, the fastest of 27) the packed path through the model's own forward took 0.061 s
against 0.054 (hand-written) and 0.053 (right-padded) for 32 equal rows of 20 tokens, 0.148 against 0.155 and 0.212
for 16 rows of 28-140, 0.365 against 0.557 and 1.018 for a 32-row long tail (67% padding); on one H200 (bf16, 32
long-tail rows) 0.566 s against 0.674 and 0.824. Neither was clearly faster (the packed path runs rows of about one
length in one attention call, evenrl.distributed.sequence, without which 32 equal rows took 0.088 s), and the
model's own forward keeps LoRA, checkpointing, FSDP2 and any family's modules working without a second
implementation. tests/test_golden.py's numbers held (within 1e-6). Issue 53 let every family above pack (it was plain
Qwen2/Llama and Qwen3-VL-MoE): on this CPU (fp32, 1 thread, busy: the fastest of 5) a tiny Qwen3 (hidden 128, 4
layers) took 0.93 s packed against 1.14 masked for 32 equal rows, 1.19 against 1.85 for 16 mixed rows, 3.99 against
14.1 for the long tail (benchmarks/forward_paths.py --arch qwen3); a Qwen2-VL of that size 1.22 s against 1.68 for
its left-padded forward, 16 rows with images (38% padding).

Only the positions that predict response tokens go through the output layer. `response_logprobs` takes the same
paths but has the output layer compute log-probs and entropies straight from the hidden states (core.fused_head),
so the logits tensor, tokens x vocabulary and the usual memory peak, never exists. Per-token tensors are then
[B, R], R = the longest response, with each row's response right-aligned.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor

from evenrl.core.batch import Batch, response_mask
from evenrl.core.model_plan import plan_of
from evenrl.models.loading import autocast, compute_device, is_checkpointing, is_sharded
from evenrl.models.output_head import computes_head
from evenrl.models.routing import is_moe
from evenrl.models.split_forward import split_forward
from evenrl.models.vision import is_vision_model, mrope_positions, sampled_placeholders, with_blank_image


# head(output layer, hidden [B, P, H], targets [B, P]) -> [B, P, k]: what the output layer computes instead of logits
Head = Callable[[torch.nn.Module, Tensor, Tensor], Tensor]


def response_logits(model, batch: Batch, pad_token_id: int, head: Head | None = None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Forward a micro-batch. Returns (logits [B, R, V] predicting each response token, targets [B, R],
    mask [B, R]) where R = longest response in the micro-batch; with `head`, its output [B, R, k] in place of the
    logits (the output layer's weights are the live ones, also under FSDP2: it runs inside the model's forward).
    A sharded (FSDP2) model always takes the model's own single forward: its parameters are gathered by hooks on
    that forward (the packed path reads them directly), and every rank must make the same number of forward calls
    (the shared-prefix path makes two where it pays, one where it does not)."""
    with autocast(model):
        return _response_logits(model, batch, pad_token_id, head)


def response_logprobs(model, batch: Batch, pad_token_id: int, *, temperature: float = 1.0, entropy: bool = False,
                      entropy_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob of each response token under softmax(logits / temperature) and, with `entropy`, the distribution's
    entropy, as [B, R, 1 or 2]; targets; mask), computed by the output layer chunk by chunk from the hidden states
    (core.fused_head). The entropy is a measurement unless entropy_grad (an entropy bonus in the loss)."""
    def head(layer, hidden, targets):  # layer.logprobs: models.output_head (a vocabulary split under TP)
        logp, ent = layer.logprobs(hidden, targets, temperature, entropy=entropy, entropy_grad=entropy_grad)
        return torch.stack([logp, ent] if entropy else [logp], dim=-1)  # a new tensor: FSDP2 hooks its outputs

    return response_logits(model, batch, pad_token_id, head)


def _response_logits(model, batch: Batch, pad_token_id: int, head: Head | None) -> tuple[Tensor, Tensor, Tensor]:
    sp = plan_of(model).sequence  # evenrl.train.parallelize (packing, sequence parallelism)
    if sp is not None and (sp.size > 1 or is_sharded(model)):  # one forward call on every rank of a group
        return split_forward(model, batch, head, _output_layer_computes)
    if is_vision_model(model) and sp is None:  # the reference: a model nothing packed (parallelize packs them)
        return _response_logits_vision(model, batch, pad_token_id, head)
    if is_sharded(model):
        return _response_logits_model(model, batch, pad_token_id, head)
    shared = _shared_prefixes(model, batch, packed=sp is not None)
    if shared is not None:
        return _response_logits_shared(model, batch, pad_token_id, head, *shared)
    if sp is not None:
        return split_forward(model, batch, head, _output_layer_computes)
    return _response_logits_model(model, batch, pad_token_id, head)


@contextlib.contextmanager
def _output_layer_computes(model, head: Head | None, targets: Tensor):
    """Within the block, the model's own forward has its output layer compute `head` on the hidden states it is
    given (targets: one per position it will see) instead of logits. Inside the forward, so that a sharded output
    layer is gathered by FSDP2's hooks as usual (models.output_head, installed once)."""
    if head is None:
        yield
        return
    with computes_head(model).computing(lambda layer, hidden: head(layer, hidden, targets)):
        yield


def _response_logits_model(model, batch: Batch, pad_token_id: int, head: Head | None
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """The model's own left-padded masked forward: any causal LM, sharded or not (the reference path)."""
    tokens, attn = batch.padded("tokens", pad_token_id, side="left")
    device = compute_device(model)  # not model.device: under CPU offload that is the host
    tokens, attn = tokens.to(device), attn.to(device)
    resp_len = batch["response_len"].to(device)
    width = int(resp_len.max())
    # Explicit positions: HF models default to 0..L-1 regardless of left padding.
    position_ids = (attn.long().cumsum(-1) - 1).clamp_(min=0)
    targets = tokens[:, -width:]
    with _output_layer_computes(model, head, _with_last(targets)):
        out = model(input_ids=tokens, attention_mask=attn.long(), position_ids=position_ids,
                    logits_to_keep=width + 1, use_cache=False)
    logits = out.logits[:, :-1]
    return logits, targets, response_mask(resp_len, width)


def _with_last(targets: Tensor) -> Tensor:
    """Targets for width + 1 positions: the last position predicts nothing we keep (a dummy id 0 stands in)."""
    return torch.cat([targets, targets.new_zeros(targets.shape[0], 1)], dim=1)


def _response_logits_vision(model, batch: Batch, pad_token_id: int, head: Head | None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """A vision-language model's own left-padded forward: the micro-batch's images (the pixel_values and
    image_grid_thw columns, rows in order) through its vision tower, and its multimodal (M-RoPE) positions."""
    tokens, attn = batch.padded("tokens", pad_token_id, side="left")
    device = compute_device(model)
    tokens, attn = tokens.to(device), attn.to(device).long()
    resp_len = batch["response_len"].to(device)
    width = int(resp_len.max())
    rows, targets = len(tokens), tokens[:, -width:]
    pixels = grid = None
    with sampled_placeholders(model, tokens, resp_len) as tokens:
        if "image_grid_thw" in batch and batch["image_grid_thw"].values.shape[0]:
            pixels, grid = batch["pixel_values"].values.to(device), batch["image_grid_thw"].values.to(device)
        elif is_sharded(model):
            tokens, attn, pixels, grid = with_blank_image(model, tokens, attn)
        positions, _ = mrope_positions(model, tokens, attn, grid)
        every = _with_last(torch.cat([targets, targets.new_zeros(len(tokens) - rows, width)]))  # the blank row's too
        with _output_layer_computes(model, head, every):
            out = model(input_ids=tokens, attention_mask=attn, position_ids=positions, pixel_values=pixels,
                        image_grid_thw=grid, logits_to_keep=width + 1, use_cache=False)
    return out.logits[:rows, :-1], targets, response_mask(resp_len, width)


# A shared prefix pays for a second forward call and a key/value copy per row; below this many saved tokens per
# row it does not pay on CPU (measured: 3 saved tokens of 20 per row was a wash for a 2.4 M-parameter Qwen2).
_MIN_SAVED_PER_ROW = 4


def _shared_prefixes(model, batch: Batch, packed: bool = False):
    """(prefixes, prefix of each row) when rows repeat a prompt (the samples of a GRPO group) and running each
    distinct prompt once saves enough; else None. A row's prefix is its prompt minus the last token: that token's
    logits predict the first response token, so it runs with the response. Only where it runs fewer tokens than
    the path it stands in for (the rows back to back when `packed`, else padded to the longest), and never for a
    checkpointed model (its
    layers drop the cache), a mixture of experts (routes are recorded and replayed by packed position) or a
    tensor-parallel one: they train packed only; nor for a vision-language model (a prompt's images would have to
    run with its prefix)."""
    if (is_checkpointing(model) or is_moe(model) or plan_of(model).tensor_parallel is not None
            or is_vision_model(model)):
        return None
    tok = batch["tokens"]
    seqs = torch.split(tok.values, tok.lengths.tolist())
    resp = batch["response_len"].tolist()
    prefixes: dict[tuple, int] = {}
    of_row = []
    for seq, n in zip(seqs, resp):
        prefix = tuple(seq[: len(seq) - n - 1].tolist())
        if not prefix:
            return None
        of_row.append(prefixes.setdefault(prefix, len(prefixes)))
    saved = sum(len(seq) - n - 1 for seq, n in zip(seqs, resp)) - sum(len(p) for p in prefixes)
    if saved < _MIN_SAVED_PER_ROW * len(seqs):
        return None
    run = len(prefixes) * max(map(len, prefixes)) + len(seqs) * (max(resp) + 1)  # both parts padded
    if run > (sum(map(len, seqs)) if packed else len(seqs) * max(map(len, seqs))):
        return None
    return list(prefixes), of_row, seqs


def _response_logits_shared(model, batch: Batch, pad_token_id: int, head: Head | None, prefixes: list[tuple],
                            of_row: list[int], seqs: list[Tensor]):
    """response_logits with each distinct prefix run once: its keys/values (with their autograd history) are
    copied to the rows that share it, so forward and backward of the prompt cost one row per group, not one per
    sample. Same numbers as the plain path up to float rounding (tests compare both)."""
    from transformers import DynamicCache

    device = model.device
    p_ids, p_attn = _left_padded([torch.tensor(p, dtype=torch.long) for p in prefixes], pad_token_id, device)
    width_p = p_ids.shape[1]
    cache = DynamicCache(config=model.config)
    model(input_ids=p_ids, attention_mask=p_attn, position_ids=(p_attn.cumsum(-1) - 1).clamp_(min=0),
          past_key_values=cache, use_cache=True, logits_to_keep=1)
    row_index = torch.tensor(of_row, dtype=torch.long, device=device)
    cache.batch_select_indices(row_index)  # differentiable gather: gradients of all rows sum into the prefix

    # The rest of each row: last prompt token + response, left-padded so responses end at the right edge.
    resp_len = batch["response_len"].to(device)
    width = int(resp_len.max())
    t_ids, t_attn = _left_padded([seq[len(seq) - n - 1:] for seq, n in zip(seqs, batch["response_len"].tolist())],
                                 pad_token_id, device)
    attn = torch.cat([p_attn[row_index], t_attn], dim=1)
    position_ids = (attn.cumsum(-1) - 1).clamp_(min=0)[:, width_p:]
    targets = t_ids[:, 1:]
    with _output_layer_computes(model, head, _with_last(targets)):
        out = model(input_ids=t_ids, attention_mask=attn, position_ids=position_ids, past_key_values=cache,
                    use_cache=True, logits_to_keep=width + 1)
    logits = out.logits[:, :-1]
    return logits, targets, response_mask(resp_len, width)


def _left_padded(rows: list[Tensor], pad_token_id: int, device) -> tuple[Tensor, Tensor]:
    """Token rows left-padded to the longest: (ids [B, L], attention mask [B, L] long)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        attn[i, width - len(r):] = 1
    return ids.to(device), attn.to(device)
