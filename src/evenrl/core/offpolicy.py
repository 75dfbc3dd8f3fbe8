"""Which tokens of a step's samples an older policy sampled, and what the importance weight divides by, per token, as
pure functions; plus the per-token version counts a step reports.

A token's version is the policy that sampled it: the weights after that many RL steps. Step t trains the policy
after step t-1 (`trained` = t - 1: the proximal policy of AReaL's decoupled PPO, the trainer's weights at the start
of the step). With rollout.max_staleness k all tokens of a sample have its step's version; with partial rollouts
(rollout.partial) a sample carried across steps holds tokens of up to max_carry_steps + 1 versions, one run of
tokens per step it was generated in. The correction is per token, so both are one case:

  corrected_t = version_t < trained      algo.importance_correction=stale
              = true                     all (also the engine/trainer mismatch of tokens the trained policy sampled)
              = false                    none
  behavior_t  = engine_t where corrected_t, else target_t, so the weight exp(target_t - behavior_t) of a token that
                is not corrected is exp(0) = 1 exactly and it adds log-weight 0 to a sequence-level weight (a
                sequence weight is then the product over the sample's corrected tokens; evenrl.core.importance).

version [B, R] long (right-aligned like the forward's outputs); target, engine [B, R] log-probs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from evenrl.errors import bad

CORRECTIONS = ("stale", "all", "none")


def corrected_tokens(version: Tensor, trained: int, correction: str) -> Tensor:
    """[B, R] bool: the tokens whose sampling policy the loss corrects for (module docstring)."""
    if correction not in CORRECTIONS:
        raise bad("importance_correction", correction, "one of " + ", ".join(CORRECTIONS))
    if correction == "all":
        return torch.ones_like(version, dtype=torch.bool)
    if correction == "none":
        return torch.zeros_like(version, dtype=torch.bool)
    return version < trained


def behavior_logprobs(target_logp: Tensor, engine_logp: Tensor, version: Tensor, trained: int,
                      correction: str) -> Tensor:
    """[B, R]: what each token's importance weight divides by (module docstring), detached."""
    fix = corrected_tokens(version.to(target_logp.device), trained, correction)
    return torch.where(fix, engine_logp.to(target_logp.dtype), target_logp.detach())


# ------------------------------------------------------------------------------------------ what a step reports

def version_runs(version: list[int]) -> int:
    """How many policy versions sampled one sample's tokens (its tokens' versions)."""
    return len(set(version))


def tokens_by_age(versions: list[list[int]], trained: int, most: int) -> list[int]:
    """Tokens per age (trained - version: 0 = the trained policy's own) over the given samples, ages 0..most."""
    out = [0] * (most + 1)
    for row in versions:
        for v in row:
            out[min(max(trained - v, 0), most)] += 1
    return out
