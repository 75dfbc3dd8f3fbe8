"""ForwardDecoder: incremental decoding of any Hugging Face causal LM through its own forward and a DynamicCache,
the sampler's reference path beside LeanDecoder (evenrl.models.decoder), and the one that prefills images."""

from __future__ import annotations

import inspect

import torch

_KEEP_ARG: dict[type, bool] = {}


def _keeps_logits(model) -> bool:
    cls = type(model)
    if cls not in _KEEP_ARG:
        _KEEP_ARG[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
    return _KEEP_ARG[cls]


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 has no config argument
        return DynamicCache()


class ForwardDecoder:
    """Any Hugging Face causal LM through its own forward and a DynamicCache (the reference path)."""

    def __init__(self, model):
        self.model = model
        self.cache = _new_cache(model)
        self.attn = None

    def prefill(self, input_ids, attn, position_ids):
        extra = {"logits_to_keep": 1} if _keeps_logits(self.model) else {}
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, **extra)
        self.cache, self.attn = out.past_key_values, attn
        return out.logits[:, -1, :]

    def prefill_images(self, input_ids, attn, images):
        """prefill for prompts with images (ImageInputs or None per prompt): their pixels through the vision tower
        and the model's multimodal positions; returns (logits, per prompt the shift of its next positions)."""
        from evenrl.models.vision import mrope_positions

        present = [x for x in images if x is not None]
        device = input_ids.device
        pixels = torch.cat([x.pixel_values for x in present]).to(device)
        grid = torch.cat([x.grid for x in present]).to(device)
        positions, shift = mrope_positions(self.model, input_ids, attn, grid)
        extra = {"logits_to_keep": 1} if _keeps_logits(self.model) else {}
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=positions, pixel_values=pixels,
                         image_grid_thw=grid, past_key_values=self.cache, use_cache=True, **extra)
        self.cache, self.attn = out.past_key_values, attn
        return out.logits[:, -1, :], shift.tolist()

    def repeat_rows(self, index):
        self.cache.batch_select_indices(index)
        self.attn = self.attn[index]

    def select_rows(self, keep):
        self.cache.batch_select_indices(keep)
        self.attn = self.attn[keep]

    def step(self, tok, pos):
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.attn.shape[0], 1))], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=pos[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1, :]
