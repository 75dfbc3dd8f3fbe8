"""Addition problems: a task tiny enough for the CPU demo to show learning in minutes.

sample fields: "prompt" (e.g. "3+5="), "answer" (e.g. "8").
"""

from __future__ import annotations

import random


def make_addition_problem(rng: random.Random, max_operand: int = 9) -> dict:
    """{"prompt": "a+b=", "answer": str(a + b)} with a, b uniform in [0, max_operand]; rng is a `random.Random`."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def exact_match_reward(completion: str, sample: dict) -> float:
    """1.0 if the completion, stripped, equals str(sample["answer"]) stripped, else 0.0."""
    return 1.0 if completion.strip() == str(sample["answer"]).strip() else 0.0
