"""Environment code run contained: the openings of a dataset's rows and the steps of many trajectories at once, as
calls in the reward workers (evenrl.isolation.pool), under rewards.timeout_s / cpu_time_limit_s / memory_limit_mib
and rewards.isolate.

Between steps an environment lives as its pickle: each step call unpickles it (or, at the first step, builds and
resets it), steps it and pickles it again, in the worker. So any worker can take any trajectory's next step, a
worker that dies loses one step, and the trainer holds bytes and plain messages, never a user object.
"""

from __future__ import annotations

import math
import numbers
import pickle

from evenrl.config.rewards import RewardsConfig
from evenrl.envs.base import Step
from evenrl.envs.registry import resolve
from evenrl.errors import UsageError
from evenrl.envs.tools import python
from evenrl.isolation import code, sandbox
from evenrl.isolation.pool import Limits, run_contained


def opening(spec: str, row: dict) -> list[dict]:
    """(In a worker) the first messages of a conversation on `row`."""
    return _checked_messages(resolve(spec)().opening(row), "opening")


def step(spec: str, state: bytes | None, row: dict, seed: int, reply: str) -> tuple[bytes, tuple]:
    """(In a worker) one step of one trajectory: (the environment's pickle afterwards, the Step as a plain tuple)."""
    if state is None:
        env = resolve(spec)()
        env.reset(row, seed)
    else:
        env = pickle.loads(state)
    out = env.step(reply)
    if not isinstance(out, tuple) or not 1 <= len(out) <= len(Step._fields):
        raise TypeError(f"step returned {type(out).__name__}; expected evenrl.envs.Step")
    out = Step(*out)
    if not isinstance(out.done, bool):
        raise TypeError(f"Step.done is {type(out.done).__name__}; expected True or False")
    if not (isinstance(out.reward, numbers.Real) and math.isfinite(out.reward)):
        raise TypeError(f"Step.reward is {out.reward!r}; expected a finite number")
    for name in ("tool_calls", "tool_errors"):
        if not (isinstance(getattr(out, name), int) and getattr(out, name) >= 0):
            raise TypeError(f"Step.{name} is {getattr(out, name)!r}; expected an int >= 0")
    try:
        blob = pickle.dumps(env)
    except Exception as e:
        raise TypeError(f"the environment cannot be pickled between steps ({type(e).__name__}: {e})") from None
    messages = _checked_messages(out.messages, "Step.messages")
    return blob, (messages, out.done, float(out.reward), out.tool_calls, out.tool_errors)


def _checked_messages(messages, what: str) -> list[dict]:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise TypeError(f"{what} must be a list of {{'role': str, 'content': str}} messages")
    return [dict(m) for m in messages]


class EnvSession:
    """The trainer's side: rollout.env's calls, contained by the rewards section's limits. An environment that
    offers the python tool needs a sandbox (rewards.sandbox): on a machine that cannot make one, the run stops here
    with the reason, before any step."""

    def __init__(self, spec: str, rewards: RewardsConfig, tools: list = ()):
        self.spec = spec
        self.isolate = rewards.isolate
        self.limits = Limits(rewards.timeout_s, rewards.cpu_time_limit_s, rewards.memory_limit_mib, rewards.sandbox)
        code.MODE = rewards.sandbox  # for calls run inline (isolate=false); workers get it with each batch
        self.unsandboxed = rewards.sandbox == "none" and python in tools
        if rewards.sandbox != "none" and python in tools:
            sandbox.require("rewards.sandbox")

    def openings(self, rows: list[dict]) -> list[list[dict]]:
        """Every row's first messages; an opening that fails stops the run (it is the environment's bug, and no
        trajectory of that row could start), naming the row."""
        results, _ = run_contained([opening], [(i, 0, (self.spec, r)) for i, r in enumerate(rows)], self.limits,
                                   isolate=self.isolate, what="environment opening")
        for i in range(len(rows)):
            kind, value = results[i]
            if kind != "ok":
                raise UsageError(f"rollout.env {self.spec}: opening(row {rows[i].get('id', i)}) failed ({kind}: "
                                 f"{value})")
        return [results[i][1] for i in range(len(rows))]

    def steps(self, calls: list[tuple[bytes | None, dict, int, str]]) -> list[tuple[str, object]]:
        """(kind, value) per (state, row, seed, reply): "ok" with (state, (messages, done, reward, tool_calls,
        tool_errors)), or a failure kind of evenrl.isolation.pool with its message."""
        if self.unsandboxed:
            print("evenrl: warning: rewards.sandbox is none: the python tool runs model-written code unsandboxed, "
                  "as the trainer's user", flush=True)
        jobs = [(i, 0, (self.spec, *call)) for i, call in enumerate(calls)]
        results, _ = run_contained([step], jobs, self.limits, isolate=self.isolate, what="environment step")
        return [results[i] for i in range(len(calls))]
