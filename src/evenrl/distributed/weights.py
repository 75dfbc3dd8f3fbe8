"""Where the trainer's weights leave it whole: the one seam between training (replicated or FSDP2-sharded) and
whatever else needs the full model on a rank.

  gathered(model)      every parameter whole on every rank for the duration of a `with` block: generation and
                       greedy evaluation with evenrl's own sampler on the training ranks (FSDP2's units unsharded,
                       an expert-parallel model's experts gathered over their ep group).
  full_weights(model)  (name, full tensor) pairs in buckets of bounded size: weight pushes to a rollout engine and
                       the final Hugging Face save. One bucket at a time is whole, never the whole model twice.

On a sharded or expert-parallel model both are collectives (all-gathers): every training rank calls them at the
same point, in the same order. On a replicated model they gather nothing and cost nothing.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

from evenrl.distributed.expert_parallel import gathered_experts
from evenrl.distributed.guard import guard

# 256 MiB: a 7B model's largest tensor (the embedding, 152k x 3584 in bf16: 1 GiB) goes alone; the blocks go a few
# at a time. Smaller buckets bound the transient memory, larger ones the number of meetings.
BUCKET_BYTES = 256 << 20


def sharded_modules(model: torch.nn.Module) -> list:
    """The FSDP2 units of `model` (each decoder block and the root when sharded), outermost first; [] if replicated."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Within the block every parameter of `model` is a whole, plain tensor on this rank (FSDP2: all units
    unsharded, in the mixed-precision policy's compute dtype; resharded, i.e. freed, on exit). Gathering once per
    generation beats gathering per layer per token: a decode step is a forward over every layer, so per-layer
    gathering would be max_new_tokens x layers all-gathers, and every rank would have to decode the same number of
    tokens to keep them matched."""
    units = sharded_modules(model)
    if not units:
        with gathered_experts(model):
            yield model
        return
    with guard("weight all-gather"):
        for unit in units:
            unit.unshard()
            # a forward inside the block (a decoder that calls the model) must not free the units it just used:
            # the next token would gather them again, and every rank would have to decode as many tokens
            unit.set_reshard_after_forward(False, recurse=False)
    try:
        with gathered_experts(model):  # expert parallelism: then every expert of the ep group, once
            yield model
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def full_weights(model: torch.nn.Module, *, bucket_bytes: int = BUCKET_BYTES, dtype: torch.dtype | None = None,
                 skip: frozenset[str] = frozenset()) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model's state dict, whole, as buckets of (Hugging Face name, tensor) of at most `bucket_bytes` (a larger
    tensor goes alone), on the parameters' device, cast to `dtype` if given. Tied tensors appear under each name
    (an engine that keeps a separate output head needs `lm_head.weight` too, or its head stays stale), as the same
    tensor object, gathered once.
    Every rank gets every bucket: with sharding, each tensor is all-gathered as its bucket is made, so a caller that
    only sends from one rank must still iterate on all of them. Names in `skip` are left out, ungathered (a frozen
    vision tower: evenrl.models.vision.frozen_names; all but a LoRA policy's adapters: engines.payload)."""
    from torch.distributed.tensor import DTensor

    def whole_tensors():
        whole: dict[int, torch.Tensor] = {}  # id of a state-dict tensor -> its whole form: a tied tensor is made once
        for name, t in model.state_dict(keep_vars=True).items():  # the parameters themselves: tied ones are one object
            if name in skip:
                continue
            if id(t) not in whole:
                source, t = t, t.detach()
                if isinstance(t, DTensor):
                    with guard("weight all-gather"):
                        t = t.full_tensor()
                whole[id(source)] = t if dtype is None else t.to(dtype)
                t = source
            yield name, whole[id(t)]

    return buckets(whole_tensors(), bucket_bytes)


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs in buckets of at most `bucket_bytes` (a larger tensor goes alone; a tensor under several
    names counts once per bucket)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size, seen = 0, set()
    for name, t in named:
        if id(t) not in seen:
            if bucket and size + t.nbytes > bucket_bytes:
                yield bucket
                bucket, size, seen = [], 0, set()
            size += t.nbytes
            seen.add(id(t))
        bucket.append((name, t))
    if bucket:
        yield bucket
