"""The precision schemes benchmarks/gpu_suite.py compares (its kernels process times and checks them):

  fp32           fp32 parameters and arithmetic (matmuls at "highest" precision)
  fp32-tf32      the same with TF32 matmuls on CUDA (torch.set_float32_matmul_precision("high"); on CPU, fp32)
  bf16-autocast  fp32 parameters (the master weights) under torch.autocast(bf16): evenrl's replicated
                 model.dtype=bfloat16
  bf16-params    bf16 parameters, fp32 master copies in the optimizer (MasterAdamW), cast once per step
"""

from __future__ import annotations

import copy

import torch

from evenrl.core.model_plan import record
from evenrl.models.loading import set_autocast

SCHEMES = ("fp32", "fp32-tf32", "bf16-autocast", "bf16-params")
# documented bf16 tolerance of the precision check (docs/performance.md, "Reading it"): TF32 is kept for fp32 runs
# only if its error stays within these
BF16_BOUNDS = {"mean_abs_dlogp": 1e-2, "grad_rel_err": 5e-2}


def set_tf32(on: bool) -> None:
    torch.set_float32_matmul_precision("high" if on else "highest")


class MasterAdamW:
    """bf16 parameters trained through fp32 master copies: gradients (bf16) are upcast into the masters, fused
    AdamW steps the masters, and the bf16 parameters are overwritten with their rounding. The scheme the suite
    measures against autocast over fp32 parameters (evenrl's model.dtype=bfloat16 when replicated)."""

    def __init__(self, model, fused=True, lr=1e-5):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, fused=fused)

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None
        self.opt.zero_grad(set_to_none=True)


def scheme_model(base, scheme: str, fused: bool = True):
    """(model, optimizer, undo) for a precision scheme over the fp32 model `base` (bf16-params: a bf16 copy)."""
    set_tf32(scheme == "fp32-tf32")
    if scheme == "bf16-params":
        model = copy.deepcopy(base).to(torch.bfloat16)
        return model, MasterAdamW(model, fused), lambda: None
    model = base
    if scheme == "bf16-autocast":
        set_autocast(model, torch.bfloat16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=fused,
                            foreach=None if fused else True)
    return model, opt, lambda: setattr(record(model), "autocast", None)
