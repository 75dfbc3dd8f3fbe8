"""DAPO's soft overlong punishment (Yu et al. arXiv:2503.14476, section 3.4; verl `reward_model.overlong_buffer`)."""

from __future__ import annotations

import torch


def overlong_penalty(response_len: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """Reward added to each response for its length: 0 up to max_new_tokens - buffer tokens, then falling linearly
    to -penalty at max_new_tokens (verl: min(-excess / buffer * penalty_factor, 0)).  response_len [N] -> [N]
    float32; all zeros when buffer is 0 (off)."""
    if buffer <= 0:
        return torch.zeros(response_len.shape, dtype=torch.float32)
    excess = (response_len.long() - (max_new_tokens - buffer)).clamp(min=0)
    return (-penalty * excess.double() / buffer).float()
