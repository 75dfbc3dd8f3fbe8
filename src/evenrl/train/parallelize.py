"""Every model a run holds made ready over the mesh by one function, in one fixed order (torchtitan's
`models/llama3/parallelize.py` is the model): the policy and the critic (trained), the reference model and the
reward models (frozen).

    plan = parallelize(model, mesh, cfg, role="policy")   # before the optimizer is built

  1. freeze            a trained model's vision tower (model.freeze_vision_tower); a frozen model whole
  2. checkpointing     activation checkpointing of a trained model (model.gradient_checkpointing)
  3. TP / EP           the layers over the mesh's tp group (distributed.tensor_parallel), a mixture's experts over its
                       ep group (distributed.expert_parallel); then the output layer made able to compute
                       log-probs in place of logits, once (models.output_head); not for a reward model
  4. FSDP2, reduction  parallel.sharding=fsdp: FSDP2 over what is left (distributed.sharding; a trained model's
                       units compute in model.dtype); then a trained model's gradient reduction (train.reduction:
                       float or, under train.reproducibility=bitwise, fixed point, in FSDP2's reduce-scatters
                       (distributed.exact_fsdp) or after the backward passes)
  5. packing / SP      the packed forward (one rank's rows back to back) or Ulysses over the mesh's sp group
                       (distributed.sequence); not for a reward model
  6. precision         TF32 (model.tf32); a replicated trained model's forwards under autocast(model.dtype)

What was applied is the model's `ModelPlan` (core.model_plan), returned here and read by the forward and the step;
nothing else reads cfg.parallel for a model. Its parameters stay fp32 when trained: they are the master weights
whatever model.dtype is (a frozen model is loaded in model.dtype and kept so).
"""

from __future__ import annotations

import torch

from evenrl.config import RunConfig
from evenrl.core.model_plan import ModelPlan, record
from evenrl.distributed.expert_parallel import canonical_experts, expert_parallel
from evenrl.distributed.mesh import Mesh
from evenrl.distributed.sequence import sequence_parallel
from evenrl.distributed.sharding import shard
from evenrl.distributed.tensor_parallel import tensor_parallel
from evenrl.models.loading import set_autocast, set_tf32
from evenrl.models.output_head import computes_head
from evenrl.models.routing import is_moe
from evenrl.models.split_forward import packs
from evenrl.models.vision import freeze_tower, is_vision_model
from evenrl.train.reduction import choose

ROLES = ("policy", "critic", "reference", "scorer")
TRAINED = ("policy", "critic")


def parallelize(model, mesh: Mesh, cfg: RunConfig, role: str = "policy") -> ModelPlan:
    """Apply the run's plan to `model` in place, in the order of the module docstring; its ModelPlan."""
    if role not in ROLES:
        raise ValueError(f"parallelize: role {role!r}; one of {', '.join(ROLES)}")
    trained, scorer = role in TRAINED, role == "scorer"
    if not trained:
        model.eval().requires_grad_(False)
    elif cfg.model.freeze_vision_tower and is_vision_model(model):
        freeze_tower(model)
    if trained and cfg.model.gradient_checkpointing:
        # transformers 5 renamed it; the old name warns and goes in v6
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if not scorer:
        split_tensors(model, mesh, exact=cfg.train.reproducibility == "bitwise")
        computes_head(model)  # after TP, which replaces the output layer; before FSDP2 wraps it
    compute = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    if cfg.parallel.sharding == "fsdp":
        offload = cfg.parallel.cpu_offload == "full"
        # a frozen model is held in the compute dtype already: no master copy to cast from
        shard(model, compute_dtype=compute if trained else torch.float32, offload=offload)
    if trained:  # how its gradients are summed: float or fixed point, by FSDP2 or after the backward passes
        record(model).reduction = choose(model, bitwise=cfg.train.reproducibility == "bitwise",
                                         data=mesh.size("data"))
    if not scorer:
        split_sequences(model, cfg, mesh)
    if trained:
        set_tf32(cfg.model.tf32)
        if cfg.parallel.sharding != "fsdp" and compute != torch.float32:
            set_autocast(model, compute)
    plan = record(model)
    plan.role = role
    return plan


def split_tensors(model, mesh: Mesh, exact: bool = False) -> None:
    """Tensor parallelism (the mesh's tp > 1: the model's layers split over this rank's tp group) or expert
    parallelism (ep > 1: a mixture's experts split over its ep group), before FSDP2 shards what is left. exact
    (train.reproducibility=bitwise): the experts run each source rank's tokens apart (expert_parallel.take_terms),
    in every role: old and reference log-probs must be layout-free too."""
    device = next(model.parameters()).device
    # what they do not split (a vision-language model) was refused before anything loaded (config.compatibility)
    if mesh.tp > 1:
        tensor_parallel(model, mesh.device_mesh(device)["tp"])
    if mesh.ep > 1:  # after TP: its tp group splits the tokens the experts see (distributed.expert_parallel)
        expert_parallel(model, mesh.expert_mesh(device), mesh.group("tp") if mesh.tp > 1 else None, exact=exact)
    elif exact:  # the experts' arithmetic a split model's has under bitwise, so EP e is this model's run
        canonical_experts(model)


def split_sequences(model, cfg: RunConfig, mesh: Mesh) -> None:
    """Sequence parallelism (the mesh's sp > 1): the model's training forwards split each packed micro-batch over
    this rank's group (evenrl.distributed.sequence). On one rank (a group of one) every model whose attention the
    packed forward can run (evenrl.models.split_forward.packs: transformers' attention interface, rotary positions)
    packs its rows the same way instead of padding them to the longest (evenrl.models.forward says why), a
    vision-language one with its images and each row's M-RoPE positions; and so do a checkpointed text model, a
    mixture of experts (its routes are then recorded and replayed by packed position: evenrl.models.routing) and a
    tensor-parallel model (the model's own forward is its only training path). The step's schedule then counts a
    micro-batch's real tokens against the cap (packed)."""
    # mesh.sp > 1 for a vision-language model: refused before it loaded
    text = not is_vision_model(model)
    if mesh.sp > 1 or packs(model) or (text and (cfg.model.gradient_checkpointing or mesh.tp > 1)) or is_moe(model):
        sequence_parallel(model, mesh.sequence_group())


def scorer_home(cfg: RunConfig, device: torch.device) -> torch.device:
    """Where a frozen scorer's weights live between reward phases: the host for a replicated one on a GPU."""
    return torch.device("cpu") if cfg.parallel.sharding == "replicated" else device
