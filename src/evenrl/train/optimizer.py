"""The AdamW a trained model gets, by what the run asks of it (evenrl train's policy and critic, evenrl sft's model):

  fp32 weights (model.weights_dtype=float32)   torch.optim.AdamW: one fused kernel over every parameter, or each
                                               tensor stepped on its own where a tensor- or expert-parallel model mixes
                                               DTensors of several meshes with plain tensors (no fused or foreach
                                               kernel takes both)
  train.reproducibility=bitwise                distributed.exact.ElementwiseAdamW: an element's step is the same bits
                                               whatever FSDP2 shard holds it
  bf16 weights (model.weights_dtype=bfloat16)  torch-optimi's AdamW with Kahan summation: bf16 moments, and a bf16
                                               compensation buffer that carries each update's rounding error into
                                               the next, so an update far below a weight's bf16 resolution (lr 1e-6
                                               on weights near 1e-2) still adds up instead of rounding away

Why torch-optimi for bf16 state (benchmarks/bf16_state.py measures it against fp32 AdamW; docs/sharding.md): its step
is element-wise and deterministic (Kahan summation, no random rounding), so the same gradients give the same bits on
any shard; it runs as plain foreach ops (here on a DTensor's local shard), on CPU too. torchao's
AdamW(bf16_stochastic_round=True) saves 2 more bytes per parameter (no compensation buffer) but draws random bits
per element (a sharded and a whole run round differently) and steps each parameter through torch.compile (an
Inductor build per shape, minutes of CPU on a 2-core machine). EasyR1's adamw_bf16 is the same
method as optimi's (AnyPrecisionAdamW: bf16 moments, Kahan compensation in bf16).
"""

from __future__ import annotations

import functools
import warnings

import torch

from evenrl.config import RunConfig
from evenrl.distributed.exact import ElementwiseAdamW
from evenrl.distributed.ops import _local

def make_adamw(params: list[torch.nn.Parameter], cfg: RunConfig, lr: float, *,
               split: bool = False) -> torch.optim.Optimizer:
    """AdamW over `params` with the run's betas and weight decay, as the module docstring says which. `split`: the
    model is split over a tensor- or expert-parallel group (its plan says so)."""
    betas, decay = tuple(cfg.train.betas), cfg.train.weight_decay
    bitwise = cfg.train.reproducibility == "bitwise"
    if cfg.model.weights_dtype == "bfloat16":  # not under bitwise: config.compatibility refuses the pair
        # eps as torch's (optimi's own default is 1e-6); triton off: the same element-wise ops on every device.
        # optimi 0.3 warns that foreach will give way to triton (a later release: pyproject bounds it below 0.4)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Parameter `foreach` is deprecated", category=DeprecationWarning)
            return _kahan_adamw()(params, lr=lr, betas=betas, weight_decay=decay, eps=1e-8, kahan_sum=True,
                                  foreach=True, triton=False)
    if bitwise:  # an element's step whatever shard holds it (FSDP2 on any world)
        return ElementwiseAdamW(params, lr=lr, betas=betas, weight_decay=decay)
    # fused: one kernel over all parameters; the default per-tensor loop cost ~15 ms a step for 2.4 M params on CPU.
    # A tensor-parallel model mixes DTensors (split weights) with plain tensors (norms), or DTensors of two meshes
    # under FSDP2, which one fused or foreach kernel refuses: each tensor is then stepped on its own; so does an
    # expert-parallel one
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=decay, fused=not split,
                             foreach=False if split else None)


@functools.cache
def _kahan_adamw() -> type:
    """optimi.AdamW stepping the local tensors of DTensors (FSDP2's shards, tensor- and expert-parallel splits): its
    foreach step copies tensors with torch._foreach_copy_, which DTensor has no rule for, and every op of the step
    is element-wise, so a shard's step is the whole tensor's step restricted to it. The state stays DTensors, so
    checkpoints reshard it as they do torch's AdamW's. (optimi is imported here: 0.3 s that a run with fp32 weights
    does not pay.)"""
    import optimi

    class KahanAdamW(optimi.AdamW):
        def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, kahan_comps):
            super()._init_group(group, params, grads, exp_avgs, exp_avg_sqs, kahan_comps)
            for tensors in (params, grads, exp_avgs, exp_avg_sqs, kahan_comps):
                tensors[:] = [_local(t) for t in tensors]

    return KahanAdamW


def forget_steps(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that had not stepped, put back so: its state cleared, and a step count kept per group (optimi's)
    back to 0 (reading a fresh optimizer's state, DCP steps it once with lr 0 to create that state)."""
    optimizer.state.clear()
    for group in optimizer.param_groups:
        if isinstance(group.get("step"), torch.Tensor):
            group["step"].zero_()
