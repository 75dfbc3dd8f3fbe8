"""The environment interface: what a user writes to train a model on conversations, tool use and feedback.

    class Guess(Env):                                        # rollout.env: mypkg.games:Guess
        def reset(self, row, seed):
            self.secret, self.turn = random.Random(seed).randint(1, 9), 0
        def step(self, reply):
            self.turn += 1
            if reply.strip() == str(self.secret):
                return Step([], done=True, reward=1.0)
            hint = "higher" if reply.strip() < str(self.secret) else "lower"
            return Step([{"role": "user", "content": hint}])

One environment object lives for one trajectory: `opening(row)` gives the conversation's first messages (once per
dataset row, when the prompts load), `reset(row, seed)` starts the trajectory (`seed` is keyed like the samples:
the same trajectory on any layout and after a resume), and `step(reply)` answers each assistant reply (its text)
with the environment's next messages, whether the trajectory is done, and a reward. A trajectory's reward is the
sum of its steps' rewards (algo.turn_discount weighs later turns less). The object is pickled between steps: each
step runs in a reward worker process (rewards.* limits and failure policy), so its state must pickle.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from evenrl.envs.toolcalls import call_tool, parse_tool_calls


class Step(NamedTuple):
    messages: list[dict]  # the environment's next messages, {"role": ..., "content": ...}; [] when done
    done: bool = False
    reward: float = 0.0
    tool_calls: int = 0  # tool calls this reply made
    tool_errors: int = 0  # of those, the ones that could not be read or run


class Env:
    """Override `step` (and `opening`, `reset` where the defaults do not fit)."""

    tools: list[Callable] = []  # offered to the model through the chat template's tools=
    roles: tuple[str, ...] = ("user",)  # roles of the messages step() returns: the template check renders them
    system_prompt: str | None = None

    def opening(self, row: dict) -> list[dict]:
        """The conversation's first messages from a dataset row: the system prompt, if any, and the prompt."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": str(row["prompt"])}]

    def reset(self, row: dict, seed: int) -> None:
        """Start a trajectory on `row`; `seed` for any randomness of the environment."""
        self.row, self.seed = row, seed

    def step(self, reply: str) -> Step:
        raise NotImplementedError(f"{type(self).__name__}.step")


class ToolEnv(Env):
    """An environment where the model may call `tools`: a reply with tool calls gets one tool message per call
    (results, or errors the model can read); the first reply without one is the final answer, scored by `score`."""

    roles = ("tool",)
    max_calls_per_reply = 8
    max_tool_output_chars = 4000

    def step(self, reply: str) -> Step:
        calls = parse_tool_calls(reply)
        if not calls:
            return Step([], done=True, reward=float(self.score(reply)))
        tools = {fn.__name__: fn for fn in self.tools}
        messages, errors = [], 0
        for i, call in enumerate(calls):
            if i < self.max_calls_per_reply:
                text, ran = call_tool(call, tools, self.max_tool_output_chars)
            else:
                text, ran = f"error: more than {self.max_calls_per_reply} tool calls in one reply", False
            errors += not ran
            messages.append({"role": "tool", "name": call.name or "unknown", "content": text})
        return Step(messages, tool_calls=len(calls), tool_errors=errors)

    def score(self, answer: str) -> float:
        raise NotImplementedError(f"{type(self).__name__}.score")
