"""FSDP2 applied to a model from outside it (parallel.sharding=fsdp): free functions, the model class untouched.

Each decoder block is one FSDP unit (its parameters are gathered for its forward and again for its backward, and
freed after), the root a last one (embeddings, final norm, output head). Gradients are reduce-scattered after every
micro-step's backward and accumulate in the sharded .grad, so no rank ever holds a whole model's gradients (turning
the sync off between micro-steps saves meetings but keeps unsharded gradients: W times the memory). Every rank must
therefore run the same number of forward/backward passes per mini-batch: evenrl.train.update runs zero-weight
filler passes on a rank with fewer micro-batches. Every unit reduces gradients by SUM, not
the default mean: evenrl's losses are already divided by the mini-batch's global token/sequence counts, so the sum
over ranks is the single-device gradient (as with the replicated path's all_reduce_grads).

Mixed precision (model.dtype=bfloat16): parameters stay fp32 (the master weights the optimizer updates), each unit
computes in bf16 and gradients are reduced and kept in fp32. Offload (parallel.cpu_offload=full): the sharded
parameters, gradients and optimizer state live in host memory and the optimizer step runs there; FSDP2 copies a
unit's shard to the accelerator to gather it, so offload needs one (it fails at the first forward on a CPU-only
machine) and is refused before a run starts there.
"""

from __future__ import annotations

import torch

from evenrl.config.compatibility import stated
from evenrl.core.model_plan import record
from evenrl.distributed import collectives as dist
from evenrl.distributed.expert_parallel import shard_of
from evenrl.errors import UsageError


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (the classes it names in `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise UsageError(f"parallel.sharding: fsdp cannot shard {type(model).__name__}: it names no decoder blocks "
                         f"(_no_split_modules is {sorted(names) or 'empty'}); use parallel.sharding=replicated")
    return blocks


def shard(model: torch.nn.Module, *, compute_dtype: torch.dtype = torch.float32, offload: bool = False) -> None:
    """Shard `model` in place over the mesh's data dimension (every training rank without tensor parallelism; with
    it, a tensor-parallel model's DTensors become 2-D: split on `tp`, sharded on `data`; an expert-parallel
    model's experts: split on `ep`, sharded on `edata`). Call after the model is on
    its device and tensor-parallel, before the optimizer is built (the optimizer must see the sharded
    parameters)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    device = next(model.parameters()).device
    if offload and device.type == "cpu":  # evenrl train's plan and ranks refuse it first; evenrl sft here
        raise UsageError(stated("offload-cpu"))
    mesh = dist.device_mesh(device, host_collectives=offload)
    mesh = mesh["data"] if "tp" in (mesh.mesh_dim_names or ()) else mesh  # tensor parallelism: FSDP2 over the rest
    mp = MixedPrecisionPolicy() if compute_dtype == torch.float32 else \
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    # expert parallelism: each experts module a unit of its own over the ranks holding the same experts (edata),
    # its block's unit over the data ranks holding the rest (torchtitan's layout)
    for experts in (m for m in model.modules() if shard_of(m) is not None):
        fully_shard(experts, mesh=dist.expert_mesh(device)["edata"], mp_policy=mp, offload_policy=policy)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    for unit in (m for m in model.modules() if hasattr(m, "set_gradient_divide_factor")):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
    record(model).sharded = True
