"""A verifiers (0.4, `verifiers.v1`) taskset, written as verifiers' docs write one (docs/v1/tasksets.md), that evenrl
trains as it is: rollout.agent "verifiers:vf_arith" with examples/ on the Python path (examples/verifiers.yaml,
docs/agents.md). Additions of two 1-2-digit numbers; the reply's last number is checked exactly, and a small reward
for the answer's digits in the reply gives a tiny model something to climb before it is ever right."""

import random
import re

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply) == self.data.answer)

    @vf.reward(weight=0.2)
    async def digits(self, trace: vf.Trace) -> float:
        return digit_share(trace.last_reply, self.data.answer)


def last_number(reply: str) -> str | None:
    numbers = re.findall(r"-?\d+", reply)
    return numbers[-1] if numbers else None


def digit_share(reply: str, answer: str) -> float:
    """The share of the answer's digits (each counted once) that the reply contains."""
    wanted = set(answer)
    return len(wanted & set(reply)) / len(wanted)


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 32
    seed: int = 0


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            tasks.append(ArithTask(ArithData(idx=i, prompt=f"What is {a} + {b}? Answer with the number.",
                                             answer=str(a + b)), self.config.task))
        return tasks


__all__ = ["ArithTaskset"]
