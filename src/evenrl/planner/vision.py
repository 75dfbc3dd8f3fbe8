"""The plan's findings about a vision-language run: image settings on a text model, pixel bounds the wrong way
round, an engine or a critic that takes no images. (The encoder's dimensions and cost are
evenrl.models.vision_config; its memory, evenrl.planner.memory.) Pure Python: never imports torch.
"""

from __future__ import annotations

import importlib.util

from evenrl.models.files import VISION_TYPES
from evenrl.planner.types import Finding, Plan


def rule_vision(p: Plan) -> list[Finding]:
    """Image settings that cannot run: on a text model, pixel bounds the wrong way round, an engine or a critic that
    takes no images."""
    c, d, out = p.config, p.config.data, []
    asked = ([f"data.image_key={d.image_key}"] if d.image_key else []) + [
        f"{k}={v}" for k, v in (("model.freeze_vision_tower", "true" if c.model.freeze_vision_tower else None),
                                ("data.min_pixels", d.min_pixels), ("data.max_pixels", d.max_pixels)) if v]
    if asked and p.dims and p.dims.vision is None:
        out.append(Finding("error", "vision-settings", f"{', '.join(asked)} but model.path holds a text model "
                           f"({p.dims.model_type})", f"a vision-language model ({', '.join(VISION_TYPES)}); or no "
                                                     "image settings"))
    if d.min_pixels and d.max_pixels and d.min_pixels > d.max_pixels:
        out.append(Finding("error", "pixel-bounds", f"data.min_pixels={d.min_pixels:,} > data.max_pixels="
                           f"{d.max_pixels:,}", f"data.min_pixels<={d.max_pixels}"))
    if (p.dims and p.dims.vision and c.rollout.engine == "vllm" and p.layout.device == "cpu"
            and importlib.util.find_spec("torchvision") is None):  # the engine refuses it on any such machine
        out.append(Finding("error", "vllm-vision", "rollout.engine=vllm runs Qwen2-VL through torchvision, which is "
                           "not installed here (its CPU wheels break torch 2.13)", "rollout.engine=hf; or a GPU "
                                                                                 "machine with vllm and torchvision"))
    return out
