"""A model's dimensions, read from its Hugging Face config.json (and a vision-language model's
preprocessor_config.json) without torch: what the memory estimate, the step-time estimate and the reward models'
terms count with (evenrl.planner.memory, evenrl.planner.timing).

Decoder-only Llama/Qwen2/Qwen3/Mistral-like models (hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, vocab_size, tie_word_embeddings; a text_config inside a vision-language
config), and their mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss: routed experts
of their own width, top-k per token, shared experts, dense layers among the MoE ones), counted by total parameters
(what memory holds) and active ones (what a token computes); configs without these are refused with a one-line
reason (ValueError). DeepSeek-V3's latent attention (MLA) is counted by its low-rank projections.
Pure Python: never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from evenrl.models.files import routed_experts
from evenrl.models.vision_config import VisionDims, vision_dims_from_config

# Model types whose attention projections have biases when config.json does not say (Qwen2 and its VL text models).
QKV_BIAS_TYPES = ("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text", "qwen2_moe")
# Families whose experts are as wide as intermediate_size (the others: moe_intermediate_size)
_EXPERT_WIDTH_IS_INTERMEDIATE = ("mixtral", "olmoe", "gpt_oss")
# Routers balanced without a loss: sigmoid scores with correction biases the checkpoint fixes (DeepSeek-V3's)
AUX_FREE_TYPES = ("deepseek_v3", "glm4_moe", "kimi_k2")
# Mixtures of experts whose routers evenrl.models.routing knows (record, replay, the load-balancing loss); a
# vision-language model by its text_config's model_type
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe_text")
# Qwen3's q/k norms (one RMSNorm of head_dim each per layer)
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text")


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
    # what evenrl's packed attention (sequence parallelism, a checkpointed model's or a mixture of experts' packed
    # rows) does not implement, as config.json says it, e.g. "attn_logit_softcapping=50"; "" when nothing
    attention_extras: str = ""
    # a mixture of experts: routed experts per MoE layer (0: dense), chosen per token, each expert's width, the
    # shared experts' width (0: none), MoE layers (the others dense), expert biases (gpt-oss)
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    moe_layers: int = 0
    expert_bias: bool = False
    # multi-head latent attention (DeepSeek-V3): (q_lora_rank or 0, kv_lora_rank, qk_nope, qk_rope, v head dims)
    mla: tuple[int, ...] = ()

    @property
    def attention_params(self) -> int:
        """An attention block's parameters with the block's two norms."""
        h = self.hidden
        if self.mla:
            q_rank, kv_rank, nope, rope, v = self.mla
            H = self.heads
            q = (h * q_rank + q_rank + q_rank * H * (nope + rope)) if q_rank else h * H * (nope + rope)
            return q + h * (kv_rank + rope) + kv_rank + kv_rank * H * (nope + v) + H * v * h + 2 * h
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def expert_params(self) -> int:
        """One routed expert: gate, up and down projections (and their biases)."""
        h, i = self.hidden, self.expert_intermediate
        return 3 * h * i + ((2 * i + h) if self.expert_bias else 0)

    @property
    def moe_mlp_params(self) -> int:
        """An MoE layer's MLP: the routed experts, the router, the shared experts."""
        h, e = self.hidden, self.experts
        shared = 3 * h * self.shared_intermediate + (h if self.shared_intermediate and self.model_type == "qwen2_moe"
                                                     else 0)  # Qwen2-MoE gates its shared expert
        return e * self.expert_params + e * h + (e if self.expert_bias else 0) + shared

    @property
    def layer_params(self) -> int:
        """The largest decoder block's parameters (an MoE block when there is one): an FSDP unit."""
        mlp = self.moe_mlp_params if self.moe_layers else 3 * self.hidden * self.intermediate
        return self.attention_params + mlp

    @property
    def experts_total(self) -> int:
        """Every routed expert's parameters: what expert parallelism divides."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def idle_expert_params(self) -> int:
        """Routed experts' parameters a token does not compute with (E - k per MoE layer)."""
        return self.moe_layers * (self.experts - self.top_k) * self.expert_params

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        dense = (self.layers - self.moe_layers) * (self.attention_params + 3 * self.hidden * self.intermediate)
        moe = self.moe_layers * (self.attention_params + self.moe_mlp_params)
        return embed * (1 if self.tied else 2) + dense + moe + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: all but the routed experts it is not sent to."""
        return self.params - self.idle_expert_params

    @property
    def active_layer_params(self) -> int:
        """A token's work per layer, in multiply-adds (averaged over dense and MoE layers)."""
        return (self.active_params - self.root_params) // max(self.layers, 1)

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
    def active_linear_params(self) -> int:
        """linear_params a token multiplies by: the FLOPs per token are 2x this."""
        return self.linear_params - self.idle_expert_params

    @property
    def act_elems(self) -> int:
        """Saved activation elements per token per layer (module docstring; planner.memory). An MoE layer keeps, per
        chosen expert, the token's gathered input, its gate/up output, their product and the weighted output
        (k x (3h + 4i), the dispatch buffers of the grouped GEMM), the shared experts' intermediates and the router's
        logits and probabilities (2E); averaged over the dense and MoE layers."""
        h = self.hidden
        attn = 4 * h + 2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim
        if not self.moe_layers:
            return attn + 4 * self.intermediate
        moe = self.top_k * (3 * h + 4 * self.expert_intermediate) + 4 * self.shared_intermediate + 2 * self.experts
        dense = 4 * self.intermediate
        return attn + -(-(self.moe_layers * moe + (self.layers - self.moe_layers) * dense) // self.layers)


def dims_from_config(hf: dict, preprocessor: dict | None = None) -> ModelDims:
    """ModelDims from a config.json dict (and a vision-language model's preprocessor_config.json); ValueError
    names what is missing or unsupported."""
    if not isinstance(hf, dict):
        raise ValueError("config.json is not a JSON object")
    vision = vision_dims_from_config(hf, preprocessor)
    tied = hf.get("tie_word_embeddings", False)  # a vision-language config says it at the top
    kind = str(hf.get("model_type", "unknown"))
    if isinstance(hf.get("text_config"), dict):  # transformers names it <model_type>_text where the file does not
        hf = hf["text_config"]
        kind = str(hf.get("model_type", f"{kind}_text"))
    need = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
    missing = [k for k in need if not isinstance(hf.get(k), int) or hf.get(k) <= 0]
    if missing:
        raise ValueError(f"model_type {kind!r}: config.json lacks {', '.join(missing)}; the estimate covers "
                         "Llama/Qwen2/Mistral-like decoder-only models")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf.get("qk_nope_head_dim", 0) + hf.get("qk_rope_head_dim", 0) \
        or hf["hidden_size"] // heads
    return ModelDims(kind, hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], heads, int(kv),
                     int(head_dim), hf["vocab_size"], bool(hf.get("tie_word_embeddings", tied)),
                     bool(hf.get("attention_bias", kind in QKV_BIAS_TYPES)), kind in QK_NORM_TYPES,
                     hf.get("max_position_embeddings"), vision, _attention_extras(hf), **_experts(hf, kind))


def _experts(hf: dict, kind: str) -> dict:
    """A mixture of experts' ModelDims fields from its config.json ({} for a dense model)."""
    experts = routed_experts(hf)
    if not experts:
        return {}
    layers = hf["num_hidden_layers"]
    width = hf["intermediate_size"] if kind in _EXPERT_WIDTH_IS_INTERMEDIATE else \
        hf.get("moe_intermediate_size") or hf["intermediate_size"]
    shared = hf.get("shared_expert_intermediate_size") or (hf.get("n_shared_experts") or 0) * width
    if "first_k_dense_replace" in hf:  # DeepSeek-V3: its first k layers dense
        moe_layers = layers - min(int(hf["first_k_dense_replace"] or 0), layers)
    else:  # Qwen-MoE: every decoder_sparse_step-th layer not in mlp_only_layers
        step, only = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or [])
        moe_layers = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    mla = ()
    if isinstance(hf.get("kv_lora_rank"), int):
        mla = tuple(int(hf.get(k) or 0) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                  "qk_rope_head_dim", "v_head_dim"))
    return dict(experts=int(experts), top_k=int(hf.get("num_experts_per_tok") or 1), expert_intermediate=int(width),
                shared_intermediate=int(shared), moe_layers=moe_layers, expert_bias=kind == "gpt_oss", mla=mla)


def _attention_extras(hf: dict) -> str:
    """Attention features transformers applies for this config that the packed attention does not: logit
    softcapping (sliding windows and sinks it implements: evenrl.distributed.sequence)."""
    if hf.get("attn_logit_softcapping"):
        return f"attn_logit_softcapping={hf['attn_logit_softcapping']}"
    return ""


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
