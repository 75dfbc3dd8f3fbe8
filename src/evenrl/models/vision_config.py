"""A vision-language model's encoder read from config.json without torch (Qwen2-VL, Qwen2.5-VL): its dimensions,
what a patch through it costs in language-model tokens, and the worst-case image work of a sample. The trainer's
schedule (evenrl.train.trainer: vision_token_weight) and the planner (evenrl.planner.memory) use the same numbers.

A sample's token count already holds its image tokens (each image's placeholder expanded: pixels / (patch x
merge)^2 after the processor's resize), so lengths, the token cap and the KV cache count them as text. What is
added here is the encoder itself: merge^2 patches per image token, each costing vision_token_weight language-model
tokens of compute (the schedule adds them to a sample's cost and to its micro-batch's tokens), and the encoder's
parameters and activations for the memory estimate.
Worst case, as for text: every sample's prompt is max_prompt_tokens long and as much of it is image as the pixel
bound and data.max_images_per_prompt allow.
Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from evenrl.config import RunConfig

QWEN_MAX_PIXELS = 12_845_056  # Qwen2-VL's image processor default (16384 image tokens)


@dataclass(frozen=True)
class VisionDims:
    """A Qwen2-VL / Qwen2.5-VL vision encoder from config.json's vision_config: `width`-wide blocks (LayerNorm and
    a plain MLP in Qwen2-VL; RMSNorm and a gated MLP in Qwen2.5-VL), a patch embedding of
    in_channels x temporal_patch x patch^2 values per patch, and a merger that turns merge^2 patches into one
    image token of the language model's width."""

    depth: int
    width: int
    mlp: int
    gated: bool
    patch: int
    temporal_patch: int
    merge: int
    in_channels: int
    out: int
    max_pixels: int = QWEN_MAX_PIXELS  # the processor's bound (preprocessor_config.json), unless data.max_pixels

    @property
    def block_params(self) -> int:
        w, i = self.width, self.mlp
        mlp = 3 * w * i + 2 * i + w if self.gated else 2 * w * i + i + w
        return 4 * w * w + 4 * w + mlp + (2 if self.gated else 4) * w

    @property
    def params(self) -> int:
        embed = self.in_channels * self.temporal_patch * self.patch ** 2 * self.width
        merged = self.width * self.merge ** 2
        merger = (1 if self.gated else 2) * self.width + merged * merged + merged + merged * self.out + self.out
        return self.depth * self.block_params + embed + merger

    @property
    def act_elems(self) -> int:
        """Saved activation elements per patch per block, counted as ModelDims.act_elems counts a layer's (plain
        MLP: its input and activation, 2i; gated: 4i)."""
        return 8 * self.width + (4 if self.gated else 2) * self.mlp

    def image_tokens(self, pixels: int) -> int:
        """Image tokens of an image of `pixels` pixels after the processor's resize (patch^2 merge^2 each)."""
        return max(1, pixels // (self.patch * self.merge) ** 2)


def vision_dims_from_config(hf: dict, preprocessor: dict | None = None) -> VisionDims | None:
    """VisionDims of a config.json dict with a vision_config (None without one); `preprocessor`, the model's
    preprocessor_config.json, gives the pixel bound."""
    v = hf.get("vision_config") if isinstance(hf, dict) else None
    if not isinstance(v, dict):
        return None
    gated = "intermediate_size" in v
    width = v.get("hidden_size") if gated else v.get("embed_dim")
    if not isinstance(width, int) or width <= 0:
        raise ValueError(f"model_type {hf.get('model_type')!r}: vision_config lacks its width "
                         f"({'hidden_size' if gated else 'embed_dim'})")
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    return VisionDims(int(v.get("depth", 32)), width,
                      int(v["intermediate_size"]) if gated else int(width * v.get("mlp_ratio", 4)), gated,
                      int(v.get("patch_size", 14)), int(v.get("temporal_patch_size", 2)),
                      int(v.get("spatial_merge_size", 2)), int(v.get("in_chans", v.get("in_channels", 3))),
                      int(v.get("out_hidden_size", text.get("hidden_size", width)) if gated
                          else v.get("hidden_size", text.get("hidden_size", width))),
                      _max_pixels(preprocessor or {}))


def _max_pixels(pre: dict) -> int:
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    value = pre.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
    return value if isinstance(value, int) and value > 0 else QWEN_MAX_PIXELS


def vision_token_weight(layers: int, layer_params: int, vision: VisionDims) -> float:
    """What one patch through the vision encoder costs, in language-model tokens: the encoder's block parameters
    over the language model's `layers` x `layer_params` (each a multiply-add per token or patch; attention over
    the sequence and the merger left out). Qwen2.5-VL-7B: ~0.1, so an image of n image tokens (4n patches) adds
    ~0.4n to the n its placeholders already count."""
    return vision.depth * vision.block_params / (layers * layer_params)


def worst_image_tokens(cfg: RunConfig, vision: VisionDims) -> int:
    """Image tokens of the most image-heavy sample: its images at the pixel bound, at most max_prompt_tokens."""
    per_image = vision.image_tokens(cfg.data.max_pixels or vision.max_pixels)
    n = cfg.data.max_images_per_prompt
    return min(cfg.data.max_prompt_tokens, n * per_image) if n else cfg.data.max_prompt_tokens


def worst_vision_tokens(cfg: RunConfig, layers: int, layer_params: int, vision: VisionDims | None) -> int:
    """The encoder's work on that sample, in language-model tokens (what the schedule adds to its cost)."""
    if vision is None:
        return 0
    patches = worst_image_tokens(cfg, vision) * vision.merge ** 2
    return round(patches * vision_token_weight(layers, layer_params, vision))
