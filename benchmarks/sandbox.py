"""What containment costs, side by side: one call of the python tool in its sandbox (built and torn down per call)
against the same code in a plain `python -I` process (rewards.sandbox: none), and a warm batch of 128 cheap reward
calls through the worker pool with rewards.sandbox tools (workers in PID and network namespaces of their own) and
all (workers in the sandbox). Best of N, so that a loaded machine's noise weighs less.

    .venv/bin/python benchmarks/sandbox.py
"""

from __future__ import annotations

import time

from evenrl.isolation import code, pool
from evenrl.rewards.arithmetic import exact_match_reward
from evenrl.rewards.pool import score_all

CALLS, BATCHES = 20, 60


def best(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    print(f"{'python tool, one call':34s} {'best ms':>8s}")
    for mode in ("tools", "none"):
        code.MODE = mode
        print(f"  rewards.sandbox={mode:6s}{'':13s} {best(lambda: code.run_code('print(1)'), CALLS):8.1f}")
    code.MODE = "tools"
    completions, rows = [str(i % 10) for i in range(128)], [{"answer": "3"}] * 128
    print(f"{'128 reward calls, warm pool':34s} {'best ms':>8s} {'pool start ms':>14s}")
    for mode in ("tools", "all"):
        pool._pool().close()
        run = lambda: score_all([(exact_match_reward, 1.0)], completions, rows, 5, sandbox=mode)  # noqa: E731
        start = best(run, 1)
        print(f"  rewards.sandbox={mode:6s}{'':13s} {best(run, BATCHES):8.1f} {start:14.0f}")


if __name__ == "__main__":
    main()
