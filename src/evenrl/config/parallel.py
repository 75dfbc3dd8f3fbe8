"""The `parallel` section: how the training ranks split the work (sharding, offload, sequence, tensor and expert
parallelism), capacity weights of mixed devices, and how long a rank waits for its peers. Pure Python (the planner
reads it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from evenrl.config.section import MAX_COUNT, Section

# Relative speeds a capacity weight may have (--capacity-weights, parallel.capacity_weights): a range no mix of
# devices leaves, checked before any arithmetic (1e308 would overflow a sum).
MIN_CAPACITY_WEIGHT, MAX_CAPACITY_WEIGHT = 1e-6, 1e6


class ParallelConfig(Section):
    sharding: Literal["replicated", "fsdp"] = Field(
        "replicated", description="'replicated': every training rank holds the whole model, its gradients and optimizer "
                                  "state. 'fsdp': PyTorch FSDP2 shards parameters, gradients and optimizer state over the "
                                  "training ranks (each decoder block and the root); the update stays exact.")
    cpu_offload: Literal["none", "full"] = Field(
        "none", description="'full' (needs sharding=fsdp and an accelerator): FSDP2's offload policy keeps the sharded "
                            "parameters, gradients and optimizer state in host memory and runs the optimizer step "
                            "there. There is no optimizer-only value: FSDP2 offloads the three together, and a "
                            "replicated model's optimizer on the host would be a slow CPU AdamW over the whole model.")
    capacity_weights: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] | Literal["auto"] | None = Field(
        None, description="Relative speed of each training rank (mixed GPU models); rank i gets work ~ weight i. "
                          "'auto': measured on every step (tokens per busy second of each rank's update, and of its "
                          "generation where the trainers generate), smoothed, and balanced by from the next step "
                          "(docs/heterogeneous.md); starts from the devices' datasheet speeds where evenrl knows "
                          "them, else equal. Either way only where rows run changes, not the update.")
    rollout_devices: int = Field(
        0, ge=0, le=MAX_COUNT,
        description="Reserved placement: the last this many processes only generate (each one engine replica, the "
                    "step's prompts balanced over them by cost) and get the trainers' weights after every optimizer "
                    "step; the others only train. 0: every process trains and generates. Also the flag "
                    "--rollout-devices of evenrl train.")
    sequence_parallel_size: int = Field(
        1, ge=1, le=1024,
        description="Ulysses sequence parallelism: each sample's tokens are split over a group of this many "
                    "training ranks (attention exchanges heads for tokens with an all-to-all), data parallel across "
                    "the groups; it must divide the training ranks (verl/EasyR1 ulysses_sequence_parallel_size). "
                    "1: off. docs/long-context.md.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=1024,
        description="Tensor parallelism in the trainer: each layer's weights are split over a group of this many "
                    "consecutive training ranks (attention heads, MLP width and the vocabulary), which train the "
                    "same samples together; data parallel (replicated or FSDP2 over parallel.sharding) across the "
                    "groups; a mixture of experts' routed experts are split by expert_parallel_size instead, "
                    "which must then be > 1. It must divide the attention and KV heads, the MLP width and the "
                    "vocabulary, and "
                    "sequence_parallel_size x tensor_parallel_size must divide the training ranks (verl "
                    "actor fsdp tensor_parallel_size, Megatron tensor_model_parallel_size). The hf engine samples "
                    "from the split model itself. 1: off. docs/parallelism.md.")
    expert_parallel_size: int = Field(
        1, ge=1, le=1024,
        description="Expert parallelism for a mixture of experts: each MoE layer's experts are split over a group "
                    "of this many consecutive training ranks (each holds experts / this many; every token goes to "
                    "its experts' ranks and back by all-to-all), and the ranks holding the same experts reduce (or, "
                    "with sharding=fsdp, shard) them; the dense layers are data parallel as before. With "
                    "tensor_parallel_size > 1 the attention and dense layers are split by it and the experts by "
                    "this (Megatron's layout with expert tensor parallelism 1); a mixture needs this > 1 there. It "
                    "must divide the training ranks and the experts (verl/Megatron expert_model_parallel_size, "
                    "transformers ep_size). 1: off. docs/moe.md.")
    collective_timeout_s: float = Field(
        600.0, gt=0.0, le=86400.0,
        description="How long a rank waits in one collective for a stopped peer before the job ends with one line "
                    "naming the phase and the ranks that did not arrive (a dead peer ends it at once). Also the "
                    "flag --collective-timeout-s of evenrl train/sft. Raise it when one step's generation can take "
                    "longer on some rank than on others.")
    liveness_timeout_s: float = Field(
        60.0, ge=0.0, le=86400.0,
        description="Under evenrl's launcher, how long a rank may be silent (no heartbeat: its process stopped, "
                    "e.g. by SIGSTOP or a debugger, or frozen where no thread of it runs) before the launcher kills "
                    "it and the job ends with one line naming it and its phase, instead of waiting "
                    "collective_timeout_s. A heartbeat thread runs beside the work, so a long but live step (a "
                    "10-minute generation) is never taken for a hang. 0: off. Workers started by torchrun or srun "
                    "have collective_timeout_s alone. docs/reliability.md.")


    @field_validator("capacity_weights", mode="before")
    @classmethod
    def _weights_or_auto(cls, value: Any) -> Any:
        # checked here: pydantic would name each member of the union in its message
        allowed = (f"expected 'auto' or a list of relative speeds in [{MIN_CAPACITY_WEIGHT:g}, "
                   f"{MAX_CAPACITY_WEIGHT:g}], one per training rank")
        if isinstance(value, str) and value != "auto":
            raise PydanticCustomError("capacity_weights", allowed)
        if isinstance(value, (list, tuple)):
            for i, x in enumerate(value):
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not (
                        MIN_CAPACITY_WEIGHT <= x <= MAX_CAPACITY_WEIGHT):
                    raise PydanticCustomError("capacity_weights", f"item {i} is {x!r}; {allowed}")
        return value

    def fixed_capacity_weights(self) -> list[float] | None:
        """capacity_weights when they are given as numbers (None: equal, or 'auto', which the run measures)."""
        return None if self.capacity_weights == "auto" else self.capacity_weights
