"""What containment costs, side by side: one call of the python tool in its sandbox (built and torn down per
call), with its seccomp filter and Landlock rules and without them (namespaces, mounts and uid change only, as before
they were added), against the same code in a plain `python -I` process (rewards.sandbox: none), and a warm batch of
128 cheap reward calls through the worker pool with rewards.sandbox tools (workers in PID and network namespaces of
their own) and all (workers in the sandbox). Best of N, interleaved, so that a loaded machine's noise weighs less.

    .venv/bin/python benchmarks/sandbox.py
"""

from __future__ import annotations

import os
import time

from evenrl.isolation import code, jail, pool, sandbox, syscalls
from evenrl.rewards.arithmetic import exact_match_reward
from evenrl.rewards.pool import score_all

CALLS, BATCHES = 30, 60


def best(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def layers_in_a_child() -> float:
    """ms the sandbox's child spends on its two extra layers: Landlock's rules for the paths a sandbox binds, and
    loading the compiled filter; timed inside a forked child (no_new_privs set first, as in the sandbox)."""
    paths = [p for p in (*sandbox.SYSTEM_PATHS, *sandbox.python_paths()) if os.path.lexists(p)]
    program, abi = syscalls.program()[0], jail.landlock_abi()
    read, write = os.pipe()
    if os.fork() == 0:
        jail._libc.prctl(jail.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        started = time.perf_counter()
        jail.landlock(paths, abi)
        jail.seccomp(program)
        os.write(write, repr((time.perf_counter() - started) * 1e3).encode())
        os._exit(0)
    os.close(write)
    took = float(os.read(read, 64))
    os.close(read)
    os.wait()
    return took


def main() -> None:
    print(f"{'python tool, one call':34s} {'best ms':>8s}")
    with_layers = (syscalls.program, jail.landlock_abi)
    without = (lambda: (b"", None), lambda: 0)  # the command then carries no filter and no Landlock ABI
    setups = {("tools", "seccomp+Landlock"): with_layers, ("tools", "namespaces only"): without,
              ("none", ""): with_layers}
    times: dict = {setup: [] for setup in setups}
    for _ in range(CALLS):  # interleaved, so that a change in the machine's load weighs on every row alike
        for (mode, name), layers in setups.items():
            code.MODE = mode
            syscalls.program, jail.landlock_abi = layers
            times[(mode, name)].append(best(lambda: code.run_code("print(1)"), 1))
    syscalls.program, jail.landlock_abi = with_layers
    for (mode, name), row in times.items():
        print(f"  rewards.sandbox={mode:6s}{name:17s} {min(row):8.1f}")
    print(f"  {'of which Landlock rules + seccomp load':39s} {min(layers_in_a_child() for _ in range(CALLS)):8.2f}")
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
