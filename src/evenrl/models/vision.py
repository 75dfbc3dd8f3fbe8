"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE; evenrl.models.files.VISION_TYPES): their
image processor, prompts with images as token ids and pixel inputs, the vision tower, and the multimodal (M-RoPE)
positions of a forward, padded or packed.

    processor = load_image_processor(path, min_pixels=262144, max_pixels=4194304)
    ids = encode_vision_prompt(tokenizer, processor, model.config, "<image>Find x.", [(640, 480)], True)
    inputs = image_inputs(processor, sources)        # ImageInputs(pixel_values [patches, D], grid [images, 3])

A prompt's token ids hold each image's placeholder expanded to its image tokens (grid t*h*w / merge^2), as the model
reads them, so every token count (length filter, partition, token cap, planner) already includes image tokens.
The image processor is always the PIL one: the torchvision one is not installed here (its CPU wheels break torch
2.13's), and picking it elsewhere would change the pixels. transformers' Qwen2VLProcessor is not used because it
cannot be built without torchvision (its video processor); what it does for images is the placeholder expansion
in encode_vision_prompt, a few lines (Qwen3VLProcessor expands images the same way, with the same tokens).

Qwen3-VL differs inside the model's own forward only: 16-pixel patches (one image token per 32 x 32 pixels), learned
position embeddings resampled to each image's grid, DeepStack features (mergers on some tower blocks whose outputs
are added to the first decoder layers' outputs at the image tokens) and interleaved M-RoPE sections; its
get_rope_index takes and returns what Qwen2-VL's does, so the padded path, the sampler's prefill and packed_images
run it unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from evenrl.core.batch import Batch, Ragged
from evenrl.data.images import IMAGE_PLACEHOLDER, Source, open_image
from evenrl.errors import UsageError, first_line
from evenrl.models.files import VISION_TYPES
from evenrl.models.loading import is_sharded

TOWER_PREFIX = "model.visual."  # the vision encoder and its merger, by state-dict name


class ImageInputs(NamedTuple):
    """One prompt's processed images: what the model's forward takes, and the images themselves (vLLM processes
    them on its own)."""

    pixel_values: Tensor  # [patches, channels x temporal_patch x patch x patch] float32
    grid: Tensor  # [images, 3] int64: (t, h, w) patches of each image
    images: list  # PIL images, RGB


def is_vision_model(model) -> bool:
    return getattr(model.config, "model_type", None) in VISION_TYPES


def load_image_processor(path: str, *, min_pixels: int | None, max_pixels: int | None):
    """The model directory's image processor (PIL backend), its pixel bounds set from data.min_pixels /
    data.max_pixels where given."""
    from transformers import AutoImageProcessor

    size = {}
    try:
        processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
        if min_pixels is not None or max_pixels is not None:
            size = {"shortest_edge": min_pixels or processor.size["shortest_edge"],
                    "longest_edge": max_pixels or processor.size["longest_edge"]}
            processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil", size=size)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UsageError(f"model path: could not load an image processor from {path!r}; {first_line(e)}") from None
    return processor


def image_tokens(processor, width: int, height: int) -> int:
    """Image tokens of a width x height image after the processor's resize: patches / merge^2."""
    return processor.get_number_of_image_patches(height, width, {}) // processor.merge_size ** 2


def pixel_dim(processor) -> int:
    """Values per patch in pixel_values: RGB x temporal_patch x patch^2."""
    return 3 * processor.temporal_patch_size * processor.patch_size ** 2


def image_inputs(processor, sources: Sequence[Source]) -> ImageInputs:
    """A prompt's images through the processor (resize, normalise, patchify)."""
    images = [open_image(s) for s in sources]
    out = processor(images=images, return_tensors="pt")
    return ImageInputs(out["pixel_values"].float(), out["image_grid_thw"].long(), images)


def prompt_image_inputs(processor, images: list[list[Source]], rows: Sequence[int]) -> list[ImageInputs | None] | None:
    """ImageInputs of the prompts at `rows` (None for one without images); None when there is no processor (a
    text model): what the engines' generate takes as `images`."""
    if processor is None:
        return None
    return [image_inputs(processor, images[r]) if images[r] else None for r in rows]


def as_messages(prompt, n_images: int) -> list:
    """A prompt as chat messages with image parts: messages as they are; text split at its <image> placeholders
    (EasyR1's layout), or with all images first when it has none."""
    if isinstance(prompt, list):
        return prompt
    pieces = prompt.split(IMAGE_PLACEHOLDER)
    if len(pieces) == 1:
        pieces = [""] * n_images + pieces
    parts: list[dict] = []
    for i, text in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def encode_vision_prompt(tokenizer, processor, config, prompt, sizes: list[tuple[int, int]],
                         use_chat_template: bool) -> list[int]:
    """Token ids of a prompt with images (`sizes`: (width, height) of each, in order), every image's placeholder
    expanded to its image tokens. With the chat template (always for chat messages) the image parts render as the
    template writes them; without it, text placeholders become <|vision_start|><|image_pad|><|vision_end|>."""
    start, pad, end = tokenizer.convert_ids_to_tokens([config.vision_start_token_id, config.image_token_id,
                                                       config.vision_end_token_id])
    messages = as_messages(prompt, len(sizes))
    if (use_chat_template or isinstance(prompt, list)) and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        special = False
    elif isinstance(prompt, list):
        raise UsageError("data: chat-message prompts need a chat template; the model's tokenizer has none")
    else:
        text = "".join(f"{start}{pad}{end}" if p["type"] == "image" else p["text"] for p in messages[0]["content"])
        special = True
    ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])
    slots = [i for i, t in enumerate(ids) if t == config.image_token_id]
    if len(slots) != len(sizes):
        raise UsageError(f"data: the prompt renders {len(slots)} image placeholders for {len(sizes)} images "
                         "(the chat template drops or repeats image parts)")
    out: list[int] = []
    last = 0
    for slot, (w, h) in zip(slots, sizes):
        out += ids[last:slot] + [config.image_token_id] * image_tokens(processor, w, h)
        last = slot + 1
    return out + ids[last:]


def freeze_tower(model) -> None:
    """model.freeze_vision_tower: no gradients for the vision encoder and its merger."""
    model.model.visual.requires_grad_(False)


def tower_parameters(model) -> list:
    """The vision tower's trainable parameters ([] for a text model or a frozen tower)."""
    return [p for p in model.model.visual.parameters() if p.requires_grad] if is_vision_model(model) else []


def images_in(batch, rows: list[int] | None = None) -> int:
    """Images the batch's rows (or those at `rows`) hold; 0 without the image columns."""
    if "image_grid_thw" not in batch:
        return 0
    grids = batch["image_grid_thw"]
    return int(grids.values.shape[0] if rows is None else grids.lengths[rows].sum())


def frozen_names(model, frozen: bool) -> frozenset[str]:
    """State-dict names a weight push leaves out: the tower's under model.freeze_vision_tower (`frozen`), none
    otherwise. An engine's copy of a frozen tower stays what it loaded, which is what the trainer holds."""
    if not (frozen and is_vision_model(model)):
        return frozenset()
    return frozenset(name for name in model.state_dict() if name.startswith(TOWER_PREFIX))


def mrope_positions(model, tokens: Tensor, attention_mask: Tensor, grid: Tensor | None) -> tuple[Tensor, Tensor]:
    """(positions [3, B, L], delta [B]): the model's own multimodal rotary positions of left-padded rows (text
    tokens count up, an image's tokens take (time, row, column) of its grid) and, per row, what a next token's
    position is beyond its length (0 for text-only rows)."""
    types = (tokens == model.config.image_token_id).int()
    pos, delta = model.model.get_rope_index(input_ids=tokens, mm_token_type_ids=types, image_grid_thw=grid,
                                            attention_mask=attention_mask)
    return pos, delta.reshape(-1)


@contextlib.contextmanager
def sampled_placeholders(model, tokens: Tensor, response_len: Tensor) -> Iterator[Tensor]:
    """Yields the tokens a training forward takes, in which image placeholders the policy sampled (in the last
    response_len[b] tokens of each left-padded row) are plain tokens, as the sampler fed them back: swapped for
    another id, so that the M-RoPE positions and the model's scatter of image features count only the prompt's
    images (else: a shape mismatch in get_rope_index), while a hook on the embedding layer, run inside the model's
    forward (so under FSDP too), puts back their own embedding: log-probs are those of the tokens sampled."""
    width = tokens.shape[1]
    starts = width - response_len.to(tokens.device)
    in_response = torch.arange(width, device=tokens.device)[None, :] >= starts[:, None]
    with _embedded_as_sampled(model, tokens, in_response) as tokens:
        yield tokens


@contextlib.contextmanager
def _embedded_as_sampled(model, tokens: Tensor, in_response: Tensor) -> Iterator[Tensor]:
    """sampled_placeholders for any layout of `tokens` ([rows, width]; `in_response` where responses are)."""
    image = model.config.image_token_id
    sampled = (tokens == image) & in_response
    if not bool(sampled.any()):
        yield tokens
        return

    def restore(module, args, output):
        # a blank image's extra row or position (with_blank_image, packed_images) is never a sampled one
        mask = F.pad(sampled, (0, output.shape[1] - sampled.shape[1], 0, output.shape[0] - sampled.shape[0]))
        return torch.where(mask[..., None], module.weight[image].to(output.dtype), output)

    handle = model.get_input_embeddings().register_forward_hook(restore)
    try:
        yield tokens.masked_fill(sampled, 0 if image != 0 else 1)
    finally:
        handle.remove()


class PackedImages(NamedTuple):
    """What a packed forward (evenrl.models.split_forward) of a vision-language model feeds it: the packed row's ids
    (sampled placeholders swapped, maybe a blank image appended), its M-RoPE positions [3, L] (each row's own,
    from 0) and the images' keyword arguments."""

    ids: Tensor
    positions: Tensor
    inputs: dict


@contextlib.contextmanager
def packed_images(model, batch, ids: Tensor, lengths: Tensor, response_len: Tensor) -> Iterator[PackedImages]:
    """The micro-batch's rows back to back in `ids` (its T real tokens, then padding) as a vision-language model's
    packed forward takes them: each row's M-RoPE positions as the model's own get_rope_index gives them for that row
    alone (text counts up from 0; an image's tokens take its grid's (time, row, column) from where the text is), the
    rows' images in order (their features and DeepStack features land on the image tokens, in order), placeholders
    the policy sampled kept as plain tokens (sampled_placeholders), and, for a sharded model whose rows hold no
    image, a blank image appended as a segment of its own (with_blank_image says why)."""
    device, T = ids.device, int(lengths.sum())
    ends = torch.cumsum(lengths, 0)
    at = torch.arange(len(ids), device=device)
    row = torch.searchsorted(ends, at, right=True)  # each packed position's row (len(lengths): the padding)
    in_response = (at < T) & (at >= (ends - response_len)[row.clamp(max=len(lengths) - 1)])
    with _embedded_as_sampled(model, ids[None], in_response[None]) as fed:
        fed = fed[0]
        pixels = grid = None
        if "image_grid_thw" in batch and batch["image_grid_thw"].values.shape[0]:
            pixels, grid = batch["pixel_values"].values.to(device), batch["image_grid_thw"].values.to(device)
        rows = Ragged(fed[:T], lengths.cpu())
        tokens, attn = Batch({"tokens": rows}).padded("tokens", 0, side="left")
        tokens, attn = tokens.to(device), attn.to(device).long()
        blank = grid is None and is_sharded(model)
        if blank:
            tokens, attn, pixels, grid = with_blank_image(model, tokens, attn)
            fed = torch.cat([fed, tokens.new_full((1,), model.config.image_token_id)])
        rope, _ = mrope_positions(model, tokens, attn, grid)
        positions = rope[:, attn.bool()]  # [3, T (+1)]: row after row, each from its own 0
        pad = torch.arange(len(ids) - T, device=device).expand(3, -1)
        positions = torch.cat([positions[:, :T], pad, positions[:, T:]], dim=1)
        yield PackedImages(fed, positions, {"pixel_values": pixels, "image_grid_thw": grid})


def with_blank_image(model, tokens: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(tokens, attention mask, pixel values, grid) with one more row: a single image token of a blank image of the
    smallest grid. A sharded (FSDP2) forward without images runs the vision tower on it, so that every rank gathers
    the tower's units and, in backward, reduces their gradients at the same point as a forward with images (the
    ranks' collectives must match in number and order); the caller drops the row's logits."""
    cfg = model.config.vision_config
    m = cfg.spatial_merge_size
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    row = torch.zeros_like(tokens[:1])
    row[0, -1] = model.config.image_token_id
    mask = torch.zeros_like(attention_mask[:1])
    mask[0, -1] = 1
    pixels = torch.zeros(m * m, dim, device=tokens.device)
    grid = torch.tensor([[1, m, m]], device=tokens.device)
    return torch.cat([tokens, row]), torch.cat([attention_mask, mask]), pixels, grid
