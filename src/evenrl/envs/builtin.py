"""The built-in environments (rollout.env by name).

    calculator   arithmetic problems the model may solve with the `calculator` tool; the final answer (the first
                 reply without a tool call) is scored by the math reward against the row's "answer"
    feedback     the model answers; a wrong answer is told so and asked again, up to rollout.max_turns; the reward
                 is 2^-(k-1) for a right answer at turn k, 0 if none is right (answers compared by the math reward)

sample fields: "prompt", "answer" (both).
"""

from __future__ import annotations

import random

from evenrl.envs.base import Env, Step, ToolEnv
from evenrl.envs.tools import calculator
from evenrl.rewards.math import math_reward


class CalculatorEnv(ToolEnv):
    tools = [calculator]

    def score(self, answer: str) -> float:
        return math_reward(answer, self.row)


class FeedbackEnv(Env):
    retry = "That is not right. Try again."

    def reset(self, row: dict, seed: int) -> None:
        super().reset(row, seed)
        self.turn = 0

    def step(self, reply: str) -> Step:
        self.turn += 1
        if math_reward(reply, self.row) == 1.0:
            return Step([], done=True, reward=0.5 ** (self.turn - 1))
        return Step([{"role": "user", "content": self.retry}])


def addition_rows(n: int, seed: int = 0, digits: tuple[int, int] = (3, 4)) -> list[dict]:
    """`n` addition problems with 3- and 4-digit operands, the tools demo's task: {"prompt": "123+4567=", "answer"}."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = (rng.randint(10 ** (d - 1), 10 ** d - 1) for d in (rng.choice(digits), rng.choice(digits)))
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows
