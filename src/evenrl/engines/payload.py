"""What of the trainer's policy reaches an engine that holds its own copy (engines.sync calls it for every push):

    full weights   full fine-tuning: the whole state dict in model.dtype (distributed.weights.full_weights), a
                   frozen vision tower left out (model.freeze_vision_tower); to vLLM under its checkpoint's names
                   (models.loading.checkpoint_names: a mixture of experts' fused experts split back)
    adapters       model.lora: only the adapter tensors, fp32, under their state-dict names; the engine's copy has
                   the same adapters (a rollout rank's hf copy) or loads them as a LoRA (vLLM, engines.vllm_lora).
                   The base never moves, so a push is ~2 x rank x (in + out) numbers per adapted layer
    merged         model.lora where the engine cannot load adapters (a vLLM build or model without LoRA support):
                   the base weights with each adapter's update added by peft (the experts' folded in as their
                   forward folds them: models.expert_lora.merged), under the plain Hugging Face names, pushed like
                   full weights

Both sides of a push compute the same choice from the config (`takes_adapters`), so a reserved rollout rank's copy
gives the push the layout the trainers send.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from evenrl.config import RunConfig
from evenrl.distributed import collectives as dist
from evenrl.distributed.weights import BUCKET_BYTES, buckets, full_weights, gathered
from evenrl.models.expert_lora import expert_targets, merged as merged_experts
from evenrl.models.loading import checkpoint_names
from evenrl.models.lora import adapted_layers, has_adapters, is_adapter, merged, merged_name
from evenrl.models.vision import frozen_names

Payload = Callable[[], Iterable[list[tuple[str, torch.Tensor]]]]


def takes_adapters(cfg: RunConfig) -> tuple[bool, str]:
    """(whether the engine loads LoRA adapters, the reason when it does not)."""
    if cfg.rollout.engine != "vllm":
        return True, ""
    from evenrl.engines.vllm_lora import supports_adapters

    try:
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        hf = {}
    why = supports_adapters(cfg.model.lora.rank, hf)
    return why is None, why or ""


def make_payload(cfg: RunConfig, model: torch.nn.Module) -> Payload:
    """What a push of `model` sends (module docstring). With adapters, rank 0 says once which form reaches the
    engine."""
    dtype = getattr(torch, cfg.model.dtype)
    # vLLM reads weights as checkpoint files name them (a mixture of experts' experts one by one, not fused)
    named = (lambda b: checkpoint_names(model, b)) if cfg.rollout.engine == "vllm" else (lambda b: b)
    if not has_adapters(model):
        skip = frozen_names(model, cfg.model.freeze_vision_tower)
        return lambda: map(named, full_weights(model, dtype=dtype, skip=skip))
    adapters, why = takes_adapters(cfg)
    if dist.is_main() and (cfg.rollout.engine != "hf" or dist.rollout_ranks()):
        print(f"evenrl: LoRA: the {cfg.rollout.engine} engine gets "
              + ("the adapters only at every push" if adapters else f"merged weights at every push ({why})"),
              flush=True)
    if adapters:
        base = frozenset(name for name in model.state_dict() if not is_adapter(name))
        return lambda: full_weights(model, skip=base)
    return lambda: map(named, merged_weights(model, dtype=dtype))


def merged_weights(model: torch.nn.Module, *, dtype: torch.dtype,
                   bucket_bytes: int = BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model with its adapters merged, as full_weights gives a model without them: buckets of (Hugging Face name,
    whole tensor in `dtype`), tied names included. A collective under sharding (the model is gathered whole while
    the buckets are made, as for on-rank generation)."""
    layers, experts = adapted_layers(model), expert_targets(model)
    # listed before gathering: FSDP2's state_dict hook would put the shards back in place of the gathered parameters
    names = [name for name in model.state_dict() if not is_adapter(name)]
    with gathered(model):
        found = [getattr(model.get_submodule(owner), attr) for owner, _, attr in (n.rpartition(".") for n in names)]
        tied = {i for i, n in Counter(map(id, found)).items() if n > 1}
        made: dict[int, torch.Tensor] = {}  # a tied tensor is made once

        def tensors():
            for name, t in zip(names, found):
                out = made.get(id(t))
                if out is None:
                    # a copy: a gathered parameter's storage is freed when the block ends, and buckets may outlive it;
                    # an expert-parallel model's experts stay split in the block: whole here (a collective)
                    whole = t.full_tensor() if hasattr(t, "full_tensor") and name not in layers else t
                    if name in experts:
                        out = merged_experts(*experts[name], whole).to(dtype)
                    else:
                        out = merged(layers[name], t).to(dtype) if name in layers else whole.detach().to(dtype, copy=True)
                    if id(t) in tied:
                        made[id(t)] = out
                yield merged_name(name), out

        yield from buckets(tensors(), bucket_bytes)
