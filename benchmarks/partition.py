"""Balance and speed of evenrl's partitioner against naive splits, and the speed of make_schedule.

Run: .venv/bin/python benchmarks/partition.py [--plot docs/rank_load.png]

Lengths are lognormal (mean ~600 tokens, sigma 1.0, seed 0). Load = tokens. "ratio" is max load over the lower
bound on the best achievable max (so 1.0000 is optimal). Times are medians over repeats, wall clock and CPU.
Prints numbers only; nothing here asserts speed.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import evenrl.core.partition as partition_mod
from evenrl.core.partition import balanced_partition, lower_bound
from evenrl.core.schedule import make_schedule

REPEATS = 15


def lognormal_lengths(n: int, seed: int = 0, mean: float = 600.0, sigma: float = 1.0) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(mean) - sigma * sigma / 2
    return [max(1, int(rng.lognormvariate(mu, sigma))) for _ in range(n)]


def contiguous(loads: list[int], k: int) -> list[list[int]]:
    q, r = divmod(len(loads), k)
    cuts = [i * q + min(i, r) for i in range(k + 1)]
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def round_robin(loads: list[int], k: int) -> list[list[int]]:
    return [list(range(i, len(loads), k)) for i in range(k)]


def evenrl_parts(loads: list[int], k: int) -> list[list[int]]:
    return balanced_partition(loads, k).parts


def lpt_only_parts(loads: list[int], k: int) -> list[list[int]]:
    saved = partition_mod._IMPROVE_BUDGET
    partition_mod._IMPROVE_BUDGET = 0  # the local pass switched off: plain LPT, for reference
    try:
        return balanced_partition(loads, k).parts
    finally:
        partition_mod._IMPROVE_BUDGET = saved


def timed(fn, *args) -> tuple[object, float, float]:
    wall, cpu = [], []
    out = None
    for _ in range(REPEATS):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return out, statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def plot(path: str, n: int = 512, k: int = 6) -> None:
    """Per-rank tokens of one long-tailed step, evenrl vs contiguous chunks (the EasyR1 512-on-6 case)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = lognormal_lengths(n)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, (title, fn) in zip(axes, [("contiguous chunks (row counts)", contiguous),
                                      ("evenrl balanced_partition (tokens)", evenrl_parts)]):
        per_rank = [sum(loads[i] for i in p) for p in fn(loads, k)]
        ax.bar(range(k), per_rank, color="#c44e52" if fn is contiguous else "#4c72b0")
        ax.axhline(sum(loads) / k, color="k", ls="--", lw=1)
        ax.set_title(f"{title}\nslowest rank / mean = {max(per_rank) / (sum(loads) / k):.3f}", fontsize=9)
        ax.set_xlabel("rank")
    axes[0].set_ylabel("tokens")
    fig.suptitle(f"{n} samples (lognormal lengths) on {k} ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    import sys

    if "--plot" in sys.argv:
        plot(sys.argv[sys.argv.index("--plot") + 1])
    methods = [
        ("evenrl balanced_partition", evenrl_parts),
        ("  (LPT only, no local pass)", lpt_only_parts),
        ("naive contiguous chunks", contiguous),
        ("round-robin", round_robin),
    ]
    header = (
        f"{'N':>5} {'K':>3}  {'method':<28} {'max load':>10} {'mean load':>10} {'max/mean':>9} {'ratio':>7}"
        f" {'ms':>8} {'cpu ms':>7}"
    )
    print(header)
    print("-" * len(header))
    for n, k in [(4096, 8), (4096, 64), (512, 6)]:
        loads = lognormal_lengths(n)
        lb = lower_bound(loads, k)
        mean = sum(loads) / k
        for name, fn in methods:
            parts, ms, cpu = timed(fn, loads, k)
            mx = max(sum(loads[i] for i in p) for p in parts)
            print(
                f"{n:>5} {k:>3}  {name:<28} {mx:>10.0f} {mean:>10.1f} {mx / mean:>9.4f} {mx / lb:>7.4f}"
                f" {ms:>8.3f} {cpu:>7.3f}"
            )
        print()

    lengths = lognormal_lengths(4096)
    sched, ms, cpu = timed(lambda: make_schedule(lengths, world=64, minibatches=4, token_cap=16384))
    padded = sched.rank_loads()
    print(
        f"make_schedule 4096 rows, world 64, 4 mini-batches, token_cap 16384: {ms:.1f} ms ({cpu:.1f} ms cpu); "
        f"micro-steps {sched.micro_steps()}; padded tokens per rank max/mean "
        f"{max(padded) / (sum(padded) / len(padded)):.4f}; oversize {len(sched.oversize)}"
    )
    sched, ms, cpu = timed(lambda: make_schedule(lengths, world=64, minibatches=4, token_cap=16384, min_rows=2))
    print(f"  same with min_rows=2: {ms:.1f} ms ({cpu:.1f} ms cpu); micro-steps {sched.micro_steps()}")


if __name__ == "__main__":
    main()
