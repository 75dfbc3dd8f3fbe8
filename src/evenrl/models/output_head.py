"""The output layer made able to compute log-probs (or any per-token head) instead of logits, installed once on a
model: by evenrl.train.parallelize for every model a run trains or scores with, or on first use by the training
forward for a model nothing was applied to (a test's, a benchmark's).

    layer = computes_head(model)                    # the model's output layer, installed (idempotent)
    with layer.computing(job):                      # job(layer, hidden) -> what the layer returns instead of logits
        out = model(...)                            # out.logits is the job's output
    layer.logprobs(hidden, targets, temperature, entropy=..., entropy_grad=...)

Why a class swap, as FSDP2's fully_shard does (the layer's class becomes a subclass of its own with this forward):
the job must run inside the model's own forward, where FSDP2's hooks have gathered the layer's weight, so the layer
itself must compute it; the swap keeps the module object, its parameters (a tied embedding stays tied), their
names in the state dict and every hook on it, where a wrapper module would rename them. What a call asks for is data
set for the duration of `computing`, not a method shadowed on each call.

`logprobs` is core.fused_head.head_logprobs over the layer's weight, or the layer's own where it has one: an output
layer split by vocabulary over a tensor-parallel group (evenrl.distributed.tensor_parallel.VocabParallelHead)
computes its slice's part with one all-reduce of per-token numbers.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor

from evenrl.core.fused_head import head_logprobs

_CLASSES: dict[type, type] = {}  # an output layer's class -> its computing subclass, made once per class


class ComputesHead:
    """The methods an installed output layer gains (its class's subclass puts these first)."""

    _job: Callable | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        job = self._job
        return super().forward(hidden) if job is None else job(self, hidden)

    @contextlib.contextmanager
    def computing(self, job: Callable):
        """Within the block, the layer returns job(layer, hidden) in place of logits."""
        self._job = job
        try:
            yield
        finally:
            self._job = None


def _logprobs(self, hidden: Tensor, targets: Tensor, temperature: float, *, entropy: bool,
              entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """The log-probs of `targets` (and entropies) from the hidden states and the layer's whole weight."""
    return head_logprobs(hidden, self.weight, self.bias, targets, temperature, entropy=entropy,
                         entropy_grad=entropy_grad)


def computes_head(model) -> torch.nn.Module:
    """The model's output layer, its class swapped once for one that can compute a head (module docstring)."""
    layer = model.get_output_embeddings()
    if layer is not None and not isinstance(layer, ComputesHead):  # None: a model without one computes no head
        cls = type(layer)
        if cls not in _CLASSES:
            own = {} if hasattr(cls, "logprobs") else {"logprobs": _logprobs}
            _CLASSES[cls] = type(f"Head{cls.__name__}", (ComputesHead, cls), own)
        layer.__class__ = _CLASSES[cls]
    return layer
