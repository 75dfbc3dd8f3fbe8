"""User environments for the multi-turn tests (rollout.env=toy_envs:Name, with tests/ on PYTHONPATH)."""

from __future__ import annotations

import os
import time

from evenrl.envs import Env, Step, ToolEnv


def hang(seconds: int) -> str:
    """Sleep, far longer than any step may take.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke up"


def boom(reason: str) -> str:
    """Raise.

    Args:
        reason: the message
    """
    raise RuntimeError(reason)


def hog(gib: int) -> str:
    """Allocate memory.

    Args:
        gib: how many GiB
    """
    block = bytearray(gib << 30)
    return str(len(block))


def shout(mib: int) -> str:
    """Print a lot.

    Args:
        mib: how many MiB
    """
    print("x" * (mib << 20))
    return "done"


class Faulty(ToolEnv):
    """Tools that misbehave; the final answer scores its length."""

    tools = [hang, boom, hog, shout]

    def score(self, answer: str) -> float:
        return float(len(answer))


class Counter(Env):
    """Counts the replies; answers each with the count, done at the third; reward 1 per reply with a digit."""

    def reset(self, row, seed):
        super().reset(row, seed)
        self.n = 0

    def step(self, reply):
        self.n += 1
        reward = float(any(c.isdigit() for c in reply))
        return Step([], done=True, reward=reward) if self.n == 3 else Step([{"role": "user", "content": str(self.n)}],
                                                                              reward=reward)


class Unpicklable(Env):
    def reset(self, row, seed):
        self.gen = (i for i in range(3))  # generators do not pickle

    def step(self, reply):
        return Step([{"role": "user", "content": "again"}])


class Broken(Env):
    def step(self, reply):
        return {"messages": []}


class Spawner(Env):
    """A hostile environment: its reply "KIND N MARKER" makes the step start N processes that escape its process
    group (setsid) and sleep with MARKER on their command line; KIND "fork" then returns, "hang" sleeps past the
    time limit, "swallow" also catches every exception (the limit's too) and keeps sleeping."""

    def reset(self, row, seed):
        pass

    def step(self, reply):
        kind, n, marker = reply.split()
        started = 0
        for _ in range(int(n)):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                os.setsid()
                os.execv("/bin/sleep", ["sleep", marker])
            started += 1
        while kind != "fork":
            try:
                time.sleep(60)
            except BaseException:
                if kind == "hang":
                    raise
        return Step([{"role": "user", "content": str(started)}], done=True, reward=0.0)


class Flood(Env):
    """An environment whose step writes int(reply) MiB straight to file descriptor 1, below Python's sys.stdout."""

    def reset(self, row, seed):
        pass

    def step(self, reply):
        block = b"x" * (1 << 20)
        for _ in range(int(reply)):
            os.write(1, block)
        return Step([], done=True, reward=1.0)
