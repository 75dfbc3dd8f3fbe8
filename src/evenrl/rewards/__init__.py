"""Reward functions: the built-in registry and `resolve` for user rewards (registry), and `score_all`, the safe
runner (pool). Every reward is `fn(completion: str, sample: dict) -> float`; `sample` is the dataset row.
What reads model output, and how `score_all` contains reward calls: docs/rewards.md.
"""

from evenrl.rewards.pool import FAILURE_KINDS, score_all
from evenrl.rewards.registry import REGISTRY, RewardFn, resolve
