"""A vision-language model's encoder read from config.json without torch (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
Qwen3-VL-MoE): its dimensions,
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
# Qwen3-VL's tower (transformers' Qwen3VLVisionConfig defaults where config.json is silent): LayerNorm blocks with a
# plain MLP of intermediate_size, a patch embedding with a bias, learned position embeddings, and a merger per
# DeepStack layer (a LayerNorm over the merged width, then the merger's two layers) besides the final one
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True)
class VisionDims:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision encoder from config.json's vision_config: `width`-wide blocks
    (LayerNorm and a plain MLP in Qwen2-VL and Qwen3-VL; RMSNorm and a gated MLP in Qwen2.5-VL), a patch embedding
    of in_channels x temporal_patch x patch^2 values per patch, and a merger that turns merge^2 patches into one
    image token of the language model's width (Qwen3-VL: also learned positions and a merger per DeepStack
    layer, whose outputs are added to the first decoder layers' outputs at the image tokens)."""

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
    positions: int = 0  # learned position embeddings (Qwen3-VL: num_position_embeddings), 0 for none
    deepstack: int = 0  # Qwen3-VL's DeepStack mergers (deepstack_visual_indexes)

    @property
    def block_params(self) -> int:
        w, i = self.width, self.mlp
        mlp = 3 * w * i + 2 * i + w if self.gated else 2 * w * i + i + w
        return 4 * w * w + 4 * w + mlp + (2 if self.gated else 4) * w

    @property
    def params(self) -> int:
        embed = self.in_channels * self.temporal_patch * self.patch ** 2 * self.width
        if self.positions:  # Qwen3-VL: the patch embedding's bias, the learned positions
            embed += self.width + self.positions * self.width
        merged = self.width * self.merge ** 2
        linears = merged * merged + merged + merged * self.out + self.out
        merger = (1 if self.gated else 2) * self.width + linears
        return self.depth * self.block_params + embed + merger + self.deepstack * (2 * merged + linears)

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
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    if hf.get("model_type") in QWEN3_VL_TYPES:
        width = int(v.get("hidden_size", 1152))
        return VisionDims(int(v.get("depth", 27)), width, int(v.get("intermediate_size", 4304)), False,
                          int(v.get("patch_size", 16)), int(v.get("temporal_patch_size", 2)),
                          int(v.get("spatial_merge_size", 2)), int(v.get("in_channels", 3)),
                          int(v.get("out_hidden_size", text.get("hidden_size", width))), _max_pixels(preprocessor or {}),
                          int(v.get("num_position_embeddings", 2304)),
                          len(v.get("deepstack_visual_indexes", (8, 16, 24))))
    gated = "intermediate_size" in v
    width = v.get("hidden_size") if gated else v.get("embed_dim")
    if not isinstance(width, int) or width <= 0:
        raise ValueError(f"model_type {hf.get('model_type')!r}: vision_config lacks its width "
                         f"({'hidden_size' if gated else 'embed_dim'})")
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
    over the language model's `layers` x `layer_params` (a token's parameters per layer: a mixture of experts'
    active ones, ModelDims.active_layer_params; each a multiply-add per token or patch; attention over the sequence
    and the mergers left out). Qwen2.5-VL-7B: ~0.1, so an image of n image tokens (4n patches) adds ~0.4n to the n
    its placeholders already count; Qwen3-VL-30B-A3B: ~0.15 (its 3.3 B active parameters, not its 30 B)."""
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
