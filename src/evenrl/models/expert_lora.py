"""LoRA on a mixture of experts' fused expert weights (model.lora.experts): one low-rank pair per expert on each
experts module's 3-D `gate_up_proj` and `down_proj`, trained with the attention's peft adapters (evenrl.models.lora).

    add_expert_adapters(model, rank, alpha)    # every experts module gets `.adapters`: A [E, r, in], B [E, out, r]
    experts.adapters.fold_into(tensors)        # the weights it computes with (the experts backends)
    to_peft(name, tensor)                      # an adapter tensor's name and layout in PEFT's files

The arithmetic is peft's `ParamWrapper` (its `target_parameters`): in each forward every expert's weight becomes
W + (alpha / r) B A, one batched product folded into W (peft's `torch.baddbmm`, the factors in W's dtype), and the
experts run on that weight through transformers' grouped_mm backend. What is saved is peft's format (adapter_config's
`target_parameters`, lora_A [r E, in] and lora_B [out, r E] per fused tensor): peft loads it (`PeftModel`) and so does
vLLM (its 3-D MoE LoRA). The adapters are not peft's own modules, because peft's cannot be split by expert: its
ParamWrapper folds the update into the whole fused parameter around the experts' forward, outside evenrl's
expert-parallel backend (under EP that mixes the split DTensor with whole adapter tensors: torch refuses the
baddbmm), and its B [out, r E] interleaves the experts (expert e's column for rank index j is j E + e), so no
contiguous shard holds one expert's. Here both factors are laid out by expert on dim 0, like the weights: expert parallelism splits them
with the experts (evenrl.distributed.expert_parallel), FSDP2 shards them in the experts' unit, DCP saves them by
global shape, and each rank folds only its own experts' update.

Memory: the folded weights of an MoE layer (its experts in the compute dtype, E/EP of them under EP) live from the
layer's forward to its backward, as with peft; with activation checkpointing one layer's at a time. The planner
counts them (planner.adapters).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

TARGETS = ("gate_up_proj", "down_proj")  # every family's fused expert weights (transformers' experts modules)
# peft's target_parameters for them; peft nests its wrappers in the module's parameter order, so in its files the
# inner one (`experts.base_layer`) is gate_up_proj and the outer one (`experts`) down_proj, as vLLM reads them
PEFT_TARGETS = [f"experts.{t}" for t in TARGETS]
BACKEND = "evenrl_lora"  # the experts implementation a model with expert adapters runs (without expert parallelism)


def fused_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of a mixture (transformers' `use_experts_implementation` classes: fused 3-D weights, a
    forward through the ExpertsInterface); [] for a dense model."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


class ExpertAdapters(torch.nn.Module):
    """One experts module's adapters, by target: lora_A [E, r, in], lora_B [E, out, r] (fp32), so that expert e's
    update is (alpha / r) B[e] A[e] in the weight's own layout ([out, in]; transposed for gpt-oss's [in, out])."""

    def __init__(self, experts: torch.nn.Module, rank: int, alpha: float):
        super().__init__()
        self.scaling = alpha / rank
        self.transposed = bool(getattr(experts, "is_transposed", False))
        self.enabled = True  # off: the base experts (the KL reference, models.lora.adapters_disabled)
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for t in TARGETS:
            w = getattr(experts, t)
            n, (out, inn) = w.shape[0], (w.shape[2], w.shape[1]) if self.transposed else w.shape[1:]
            a = torch.empty(n * rank, inn, device=w.device, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's draw for a lora_A (an nn.Linear's)
            self.lora_A[t] = torch.nn.Parameter(a.view(n, rank, inn))
            self.lora_B[t] = torch.nn.Parameter(torch.zeros(n, out, rank, device=w.device, dtype=torch.float32))

    def fold_into(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """The weights the experts module computes with, from its tensors by parameter name (its own, this rank's
        shard under expert parallelism, or every expert gathered: distributed.expert_parallel calls this): each
        target folded with its adapters while they are enabled; the tensors as given otherwise."""
        if not self.enabled:
            return tensors
        out = dict(tensors)
        for t in TARGETS:
            out[t] = self.fold(tensors[t], tensors[f"adapters.lora_A.{t}"], tensors[f"adapters.lora_B.{t}"])
        return out

    def fold(self, w: Tensor, a: Tensor, b: Tensor) -> Tensor:
        """w + scaling B A per expert, as peft's ParamWrapper computes it (its _LoraFactorsProxy): one baddbmm in w's
        dtype, outside autocast."""
        a, b = a.to(w.dtype), b.to(w.dtype)
        with torch.autocast(device_type=w.device.type, enabled=False):
            if self.transposed:
                return torch.baddbmm(w, a.transpose(-2, -1), b.transpose(-2, -1), alpha=self.scaling)
            return torch.baddbmm(w, b, a, alpha=self.scaling)


def adapters_of(experts: torch.nn.Module) -> ExpertAdapters | None:
    found = getattr(experts, "adapters", None)
    return found if isinstance(found, ExpertAdapters) else None


def add_expert_adapters(model: torch.nn.Module, rank: int, alpha: float) -> int:
    """Adapters on every experts module of `model` (drawn from the torch RNG: A as peft draws it, B zero, so the model
    starts as the base), and the model's experts implementation set to one that applies them. Returns how many
    experts modules got them (0: not a mixture with fused experts)."""
    from transformers.integrations.moe import ExpertsInterface

    modules = fused_experts(model)
    for m in modules:
        m.adapters = ExpertAdapters(m, rank, alpha)
    if modules:
        ExpertsInterface.register(BACKEND, experts_forward)
        model.set_experts_implementation(BACKEND)
    return len(modules)


def set_enabled(model: torch.nn.Module, on: bool) -> None:
    for m in fused_experts(model):
        if (adapters := adapters_of(m)) is not None:
            adapters.enabled = on


class _Folded:
    """An experts module as transformers' grouped_mm backend reads it, its targets folded (the backend reads the
    weights from the object it is given, all else from the module). distributed.expert_parallel has its own view,
    for split experts: layers beside each other import nothing from each other."""

    def __init__(self, module: torch.nn.Module):
        self.__dict__.update(module.adapters.fold_into(dict(module.named_parameters())))
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def experts_forward(module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The "evenrl_lora" experts backend: transformers' grouped_mm on the folded weights."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(_Folded(module), hidden, top_k_index, top_k_weights)


def expert_targets(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Each adapted expert weight by its state-dict name (`...experts.gate_up_proj`): (its experts module, target)."""
    return {f"{name}.{t}": (m, t) for name, m in model.named_modules() if adapters_of(m) is not None for t in TARGETS}


def merged(experts: torch.nn.Module, target: str, weight: Tensor) -> Tensor:
    """`weight` (the target's base weight, whole) with its adapters folded in as the forward folds them (so a model
    given the merged weights computes what the adapted one does); a new tensor. Under expert parallelism the adapters
    are gathered here: a collective every rank of the ep group makes in the same order."""
    adapters = adapters_of(experts)
    whole = [getattr(adapters, f"lora_{k}")[target] for k in "AB"]
    whole = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in whole]
    with torch.no_grad():
        return adapters.fold(weight.detach(), *whole)


def is_expert_adapter(name: str) -> bool:
    return ".adapters.lora_" in name


def to_peft(name: str, t: Tensor) -> tuple[str, Tensor]:
    """An expert adapter tensor (`...experts.adapters.lora_A.gate_up_proj`, [E, r, in]) as peft's state dict holds
    it: `...experts.base_layer.lora_A.default.weight` [r E, in] (lora_B: [out, r E], column r_i E + e); any other
    name and tensor as given."""
    if not is_expert_adapter(name):
        return name, t
    owner, _, rest = name.partition(".adapters.")
    kind, target = rest.split(".")
    inner = ".base_layer" if target == TARGETS[0] else ""
    n, x, y = t.shape
    flat = t.reshape(n * x, y) if kind == "lora_A" else t.permute(1, 2, 0).reshape(x, y * n)
    return f"{owner}{inner}.{kind}.default.weight", flat
