"""A model's dimensions, read from its Hugging Face config.json (and a vision-language model's
preprocessor_config.json) without torch: what the memory estimate, the step-time estimate and the reward models'
terms count with (evenrl.planner.memory, evenrl.planner.timing).

Decoder-only Llama/Qwen2/Qwen3/Mistral-like models (hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, vocab_size, tie_word_embeddings; a text_config inside a vision-language
config); mixture-of-experts and configs without these are refused with a one-line reason (ValueError).
Pure Python: never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from evenrl.models.vision_config import VisionDims, vision_dims_from_config

# Model types whose attention projections have biases when config.json does not say (Qwen2 and its VL text models).
QKV_BIAS_TYPES = ("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    max_positions: int | None
    vision: VisionDims | None = None  # a vision-language model's encoder (evenrl.planner.vision)
    # what evenrl's packed attention (sequence parallelism, a checkpointed model's packed rows) does not implement,
    # as config.json says it, e.g. "sliding_window=4096"; "" when nothing
    attention_extras: str = ""

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params + self.hidden

    @property
    def root_params(self) -> int:
        """What FSDP's root unit holds: the embeddings, the output head when untied, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def linear_params(self) -> int:
        """Weights that go through a matmul (what autocast copies): all but the norms and an untied input
        embedding (a lookup, not a matmul)."""
        norms = self.layers * (2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)) + self.hidden
        return self.params - norms - (0 if self.tied else self.vocab * self.hidden)

    @property
    def act_elems(self) -> int:
        """Saved activation elements per token per layer (module docstring)."""
        h = self.hidden
        return 4 * h + 2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim + 4 * self.intermediate


def dims_from_config(hf: dict, preprocessor: dict | None = None) -> ModelDims:
    """ModelDims from a config.json dict (and a vision-language model's preprocessor_config.json); ValueError
    names what is missing or unsupported."""
    if not isinstance(hf, dict):
        raise ValueError("config.json is not a JSON object")
    vision = vision_dims_from_config(hf, preprocessor)
    tied = hf.get("tie_word_embeddings", False)  # a vision-language config says it at the top
    hf = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    kind = str(hf.get("model_type", "unknown"))
    moe = [k for k in _MOE_KEYS if hf.get(k)]
    if moe:
        raise ValueError(f"model_type {kind!r} is a mixture-of-experts model ({moe[0]}); "
                         "the estimate covers dense decoder-only models")
    need = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    missing = [k for k in need if not isinstance(hf.get(k), int) or hf.get(k) <= 0]
    if missing:
        raise ValueError(f"model_type {kind!r}: config.json lacks {', '.join(missing)}; the estimate covers "
                         "Llama/Qwen2/Mistral-like decoder-only models")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return ModelDims(kind, hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], heads, int(kv),
                     int(head_dim), hf["vocab_size"], bool(hf.get("tie_word_embeddings", tied)),
                     bool(hf.get("attention_bias", kind in QKV_BIAS_TYPES)), kind in ("qwen3",),
                     hf.get("max_position_embeddings"), vision, _attention_extras(hf, kind))


def _attention_extras(hf: dict, kind: str) -> str:
    """Attention features transformers applies for this config that the packed attention does not: logit
    softcapping, or a sliding window where the model uses it (Qwen2/Qwen3: use_sliding_window from layer
    max_window_layers on, or sliding layers in layer_types; Mistral: whenever sliding_window is set)."""
    if hf.get("attn_logit_softcapping"):
        return f"attn_logit_softcapping={hf['attn_logit_softcapping']}"
    window, layers = hf.get("sliding_window"), hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if isinstance(types, list):
        sliding = "sliding_attention" in types
    elif kind.startswith(("qwen2", "qwen3")):
        sliding = bool(hf.get("use_sliding_window")) and (hf.get("max_window_layers") or 0) < layers
    else:
        sliding = kind == "mistral"
    return f"sliding_window={window}" if window and sliding else ""


def read_model_dims(model_path: str) -> ModelDims:
    """Dims from `<model_path>/config.json`; ValueError with a one-line reason otherwise."""
    p = Path(model_path).expanduser()
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file():
        raise ValueError(f"{cfg}: no such file")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
        pre = cfg.with_name("preprocessor_config.json")
        preprocessor = json.loads(pre.read_text(encoding="utf-8")) if pre.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg}: unreadable JSON ({e.__class__.__name__})") from None
    return dims_from_config(data, preprocessor if isinstance(preprocessor, dict) else None)
