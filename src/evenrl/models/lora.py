"""LoRA adapters on a loaded causal LM, through peft (model.lora): added in place, so the model stays its own
Hugging Face class (transformers' adapter support: `add_adapter`, `disable_adapters`, `save_pretrained` in PEFT's
format) and every forward path, sharding and the sampler take it as they take any model.

    model, tok = load_policy(path, dtype="bfloat16")     # the frozen base, in model.dtype
    add_adapters(model, cfg.model.lora)                   # fp32 adapters, the only trainable parameters
    with adapters_disabled(model): ...                    # the base model: the KL reference, on the same weights

Adapters go on the linear layers of the decoder blocks only (the output layer computes log-probs from its plain
weight, chunk by chunk: core.fused_head), and with model.lora.experts on a mixture's fused experts too
(evenrl.models.expert_lora: grouped per expert, saved as peft's target_parameters). An adapter tensor keeps its state-dict name
(`...q_proj.lora_A.default.weight`): what the trainer pushes to an engine's own copy and what checkpoints hold.
`merged(layer, weight)` is a base weight with its adapter's update added by peft (`get_delta_weight`), for engines
that cannot load adapters and for evenrl's lean sampler (`effective_weight`).
"""

from __future__ import annotations

import contextlib

import torch

from evenrl.config.schema import LoraConfig
from evenrl.errors import UsageError, first_line
from evenrl.models.expert_lora import PEFT_TARGETS, add_expert_adapters, set_enabled, to_peft

ADAPTER = "default"  # peft's name for a model's single adapter


def _blocks(model) -> torch.nn.Module | None:
    """The decoder blocks (`get_decoder().layers`), None for a model without a decoder to find."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return getattr(decoder, "layers", decoder)


def default_targets(model) -> list[str]:
    """The names of the linear layers inside the decoder blocks (the attention and MLP projections), as peft's
    target_modules: every leaf name of an nn.Linear there, so the output head and the embeddings are never
    adapted. A name peft would map onto a mixture of experts' fused expert weights (its conversion of the
    transformers 4 names, e.g. DeepSeek-V3's down_proj, which its shared experts share) is left out: the experts get
    evenrl's own adapters with model.lora.experts (see add_adapters)."""
    blocks = _blocks(model)
    names = sorted({name.rsplit(".", 1)[-1] for name, m in (blocks.named_modules() if blocks is not None else [])
                    if isinstance(m, torch.nn.Linear)})
    names = [n for n in names if n not in _onto_experts(model, names)]
    if not names:
        raise UsageError(f"model.lora.target_modules: {type(model).__name__} has no linear layers inside a decoder "
                         "to find; name them, e.g. model.lora.target_modules=[q_proj,v_proj]")
    return names


def _onto_experts(model, names: list[str]) -> set[str]:
    """The target names peft would move onto the model's fused expert weights (its transformers-5 conversion)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    probe = PeftLoraConfig(r=1, target_modules=list(names), task_type="CAUSAL_LM")
    try:
        convert_peft_config_for_transformers(probe, model, None)
    except ValueError:  # a fused pair named in part: peft refuses it itself when the adapter is added
        return set()
    return set(names) - set(probe.target_modules or ())


def add_adapters(model, lora: LoraConfig) -> None:
    """Add LoRA adapters (model.lora) to `model` in place: the base parameters are frozen, the adapters are drawn from
    the torch RNG (lora_A; lora_B starts at zero, so the model starts as the base) and held in fp32 whatever the
    base's dtype. With lora.experts a mixture's fused experts get theirs (models.expert_lora), and the peft config
    names them as peft's target_parameters, so the saved adapter_config.json does."""
    from peft import LoraConfig as PeftLoraConfig
    from peft.tuners.lora import Linear, LoraLayer
    from peft.tuners.tuners_utils import cast_adapter_dtype

    targets = list(lora.target_modules) or default_targets(model)
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                            task_type="CAUSAL_LM")
    try:
        model.add_adapter(config, adapter_name=ADAPTER)
    except ValueError as e:  # peft: a target module the model does not have
        raise UsageError(f"model.lora.target_modules: got {targets}; {first_line(e)}") from None
    # the output layer computes log-probs from its plain weight, chunk by chunk (core.fused_head), and the lean
    # sampler merges linear adapters only: adapters elsewhere would be skipped there
    blocks = _blocks(model)
    inside = {id(m) for m in blocks.modules()} if blocks is not None else set()
    outside = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
               if isinstance(m, LoraLayer) and (id(m) not in inside or not isinstance(m, Linear))}
    if any(type(m).__name__ == "ParamWrapper" for m in model.modules()):
        raise UsageError(f"model.lora.target_modules: got {targets}; peft maps "
                         f"{', '.join(sorted(_onto_experts(model, targets))) or 'some of them'} onto "
                         f"{model.config.model_type}'s fused expert weights, where its adapters cannot be split by "
                         "expert; name the attention projections (e.g. q_proj, v_proj) or leave the list empty, and "
                         "set model.lora.experts=true for adapters on the experts (docs/moe.md)")
    if outside:
        raise UsageError(f"model.lora.target_modules: got {targets}; {', '.join(sorted(outside))}: not a linear "
                         "layer of the decoder blocks, the only layers evenrl adapts; name those (e.g. q_proj, "
                         "v_proj) or leave the list empty for all of them")
    cast_adapter_dtype(model, ADAPTER)  # fp32, as peft's get_peft_model does
    if lora.experts:
        if not add_expert_adapters(model, lora.rank, lora.alpha):
            raise UsageError(f"model.lora.experts: true, but {model.config.model_type} has no fused experts (not a "
                             "mixture of experts); use model.lora.experts=false")
        config.target_parameters = list(PEFT_TARGETS)


def has_adapters(model) -> bool:
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def adapter_config(model):
    """The peft LoraConfig of the model's adapter (what PEFT's adapter_config.json holds), None without adapters."""
    return model.peft_config[ADAPTER] if has_adapters(model) else None


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter tensor."""
    return ".lora_A." in name or ".lora_B." in name


def peft_name(name: str) -> str:
    """An adapter tensor's name in PEFT's files (`base_model.model.` + the name without the adapter's own), as
    transformers' save_pretrained writes it and vLLM reads it."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def save_adapter(config, named, out) -> None:
    """PEFT's files in directory `out` for the adapter tensors `named` ((state-dict name, whole tensor) pairs):
    adapter_model.safetensors under PEFT's names (the experts' in peft's target_parameters layout:
    models.expert_lora.to_peft) and `config`'s adapter_config.json, as peft's save_pretrained writes them (which
    keeps only tensors of peft's own layers), so peft and vLLM load them."""
    from safetensors.torch import save_file

    tensors = {peft_name(n): t.detach().to("cpu", copy=True).contiguous()
               for n, t in (to_peft(name, t) for name, t in named)}
    save_file(tensors, f"{out}/adapter_model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(str(out))


@contextlib.contextmanager
def adapters_disabled(model):
    """Within the block `model` computes as its base: the adapters are skipped by every adapted layer."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.disable_adapters()
    set_enabled(model, False)  # the experts' adapters (models.expert_lora)
    # peft also freezes the adapters it disables; they stay trainable here: FSDP2 fixes a unit's gradient dtypes from
    # the parameters that require grad at its first forward, which may be this one (then bf16 gradients for fp32
    # adapters, refused at the reduce-scatter)
    for p in trainable:
        p.requires_grad_(True)
    try:
        yield model
    finally:
        model.enable_adapters()
        set_enabled(model, True)


def adapted_layers(model) -> dict[str, torch.nn.Module]:
    """Each adapted layer by the state-dict name of its base weight (`...q_proj.base_layer.weight`)."""
    from peft.tuners.lora import LoraLayer

    return {f"{name}.base_layer.weight": m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_name(name: str) -> str:
    """The Hugging Face name of a state-dict name once the adapters are merged (`q_proj.base_layer.weight` ->
    `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def effective_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The weight a linear layer applies: its own, or an adapted layer's base weight with the adapter's update added
    (while its adapter is enabled)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    return base.weight if linear.disable_adapters else merged(linear, base.weight)


def merged(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (the layer's base weight, whole) plus the update its adapter makes (peft's get_delta_weight, on the
    layer's adapter tensors, which must be whole too), in the weight's dtype; a new tensor, the base is untouched."""
    with torch.no_grad():
        return (weight + layer.get_delta_weight(ADAPTER).to(weight.device)).to(weight.dtype)
