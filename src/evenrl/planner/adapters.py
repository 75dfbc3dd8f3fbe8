"""The size of LoRA adapters (model.lora) for the plan's estimates: the memory they hold (planner.memory) and what a
push sends (planner.timing). From a config.json's dims (planner.dims.ModelDims), by the Llama/Qwen2 projection
names, and with model.lora.experts a mixture's routed experts (evenrl.models.expert_lora: a pair per expert on its
fused gate_up_proj and down_proj, whose folded weights an MoE layer holds from its forward to its backward).
Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import replace

from evenrl.config import RunConfig


def adapted_projections(dims, targets: list[str]) -> dict[str, tuple[int, int]]:
    """(in, out) features of the decoder-block projections LoRA adapts (dims: a planner.dims.ModelDims), by their
    Llama/Qwen2 names: model.lora.target_modules, or all seven when it is empty; other names are not sized."""
    h, q, kv, i = dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.intermediate
    every = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
             "up_proj": (h, i), "down_proj": (i, h)}
    return {k: v for k, v in every.items() if not targets or k in targets}


def adapter_params(dims, rank: int, targets: list[str], tp: int = 1, experts: bool = False) -> int:
    """LoRA's parameters: rank x (in + out) per adapted projection per layer; `tp`: one rank's under tensor
    parallelism, which splits B (rank x out) with its base layer and keeps A (rank x in) whole; `experts`: the
    routed experts' adapters too (every expert's: expert parallelism divides them, planner.memory). A mixture's MoE
    layers have gate/up/down projections only in their shared experts (of their own width), if any."""
    def size(projections: dict) -> int:
        return sum(rank * (a + b // tp) for a, b in projections.values())

    every = adapted_projections(dims, targets)
    mlp = {k: v for k, v in every.items() if k in ("gate_proj", "up_proj", "down_proj")}
    moe = dims.moe_layers
    shared = adapted_projections(replace(dims, intermediate=dims.shared_intermediate), list(mlp)) \
        if moe and mlp and dims.shared_intermediate else {}
    return (dims.layers * (size(every) - size(mlp)) + (dims.layers - moe) * size(mlp) + moe * size(shared)
            + (expert_adapter_params(dims, rank) if experts else 0))


def expert_adapter_params(dims, rank: int) -> int:
    """model.lora.experts: rank x (in + out) for each routed expert's gate_up_proj (hidden -> 2 x its width) and
    down_proj (width -> hidden), in every MoE layer."""
    h, i = dims.hidden, dims.expert_intermediate
    return dims.moe_layers * dims.experts * rank * ((h + 2 * i) + (i + h))


def folded_expert_bytes(dims, c: int, ep: int) -> int:
    """model.lora.experts: one MoE layer's experts with their adapters folded in (E / EP of them, in the compute
    dtype c bytes): what the layer's forward makes and its backward reads."""
    return c * (dims.experts // max(ep, 1)) * 3 * dims.hidden * dims.expert_intermediate


def lora_note(cfg: RunConfig, adapters: int, shards: int) -> str:
    """The memory estimate's first assumption with model.lora."""
    return (f"LoRA rank {cfg.model.lora.rank}: {adapters / 1e6:,.2f} M adapter parameters"
            + (" (the routed experts' included)" if cfg.model.lora.experts else "")
            + f" at 16 bytes each (fp32 weights, gradients, AdamW's 2 moments) over the frozen base in {cfg.model.dtype}"
            + (f", sharded over {shards} ranks" if shards > 1 else "")
            + "; the KL reference is the base with the adapters off: no copy")
