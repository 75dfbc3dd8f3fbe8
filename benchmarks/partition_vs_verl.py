"""evenrl's partitioner against verl's Karmarkar-Karp on the same lognormal lengths: balance and time.

    .venv/bin/python benchmarks/partition_vs_verl.py --verl /path/to/verl        # a checkout of volcengine/verl
    VERL_PATH=/path/to/verl .venv/bin/python benchmarks/partition_vs_verl.py

verl's code is not part of evenrl: this script loads `verl/utils/seqlen_balancing.py` from the checkout you name at
run time (no verl install needed; `pip install verl` would pull ray, vLLM-era pins and a CUDA torch, so it is not
used). That module imports verl.protocol, verl.utils.tensordict_utils and verl.utils.device at the top; the two
functions measured here use none of them, so light stand-ins are registered for those three names only.
Without a checkout the script says so and exits 0 (nothing to compare).

Measured: evenrl.partition.balanced_partition (LPT + bounded local improvement) and verl's karmarkar_karp and
get_seqlen_balanced_partitions (KK plus its checks) with equal_size=False, the same problem (any number of rows
per part); verl's equal_size=True (what its trainer uses to balance data-parallel ranks) is shown for reference:
it solves a harder, constrained problem against the same lower bound. "ratio" = max part load / lower bound on the
optimal max (1.0000 is optimal); times are medians of wall clock per call. Prints numbers only.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import statistics
import sys
import time
import types
from pathlib import Path

from evenrl.core.partition import balanced_partition, lower_bound

CASES = [(4096, 64), (4096, 8), (512, 6)]


def lognormal_lengths(n: int, seed: int = 0, mean: float = 600.0, sigma: float = 1.0) -> list[int]:
    """Same generator as benchmarks/partition.py (mean ~600 tokens, sigma 1.0)."""
    rng = random.Random(seed)
    mu = math.log(mean) - sigma * sigma / 2
    return [max(1, int(rng.lognormvariate(mu, sigma))) for _ in range(n)]


def load_verl(root: Path):
    """verl/utils/seqlen_balancing.py from a checkout, with stand-ins for the three verl imports it does not need
    for partitioning. Returns the module, or None when the file is not there."""
    path = root / "verl" / "utils" / "seqlen_balancing.py"
    if not path.is_file():
        return None
    stubs = {}
    for name in ("verl", "verl.utils", "verl.protocol", "verl.utils.tensordict_utils", "verl.utils.device"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = []  # a package, so submodule imports resolve to the stand-ins
            stubs[name] = mod
    stubs.get("verl.protocol", types.ModuleType("x")).DataProto = object
    stubs.get("verl.utils.device", types.ModuleType("x")).get_device_name = lambda: "cpu"
    if "verl.utils" in stubs and "verl.utils.tensordict_utils" in stubs:
        stubs["verl.utils"].tensordict_utils = stubs["verl.utils.tensordict_utils"]
    sys.modules.update(stubs)
    spec = importlib.util.spec_from_file_location("verl_seqlen_balancing", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times) * 1e3


def check(parts: list[list[int]], n: int, k: int) -> None:
    assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(n)), "not a partition"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verl", default=os.environ.get("VERL_PATH", ""),
                   help="a checkout of volcengine/verl (the directory holding verl/); default $VERL_PATH")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per method and case (median reported)")
    p.add_argument("--seeds", type=int, default=3, help="length draws per case (ratios and times averaged)")
    args = p.parse_args(argv)
    verl = load_verl(Path(args.verl)) if args.verl else None
    if verl is None:
        where = f"{args.verl}/verl/utils/seqlen_balancing.py not found" if args.verl else "no checkout given"
        print(f"skipped: verl is not available ({where}). Give a checkout of volcengine/verl with --verl PATH "
              "or VERL_PATH=PATH; only verl/utils/seqlen_balancing.py is read.")
        return 0
    print(f"verl: {Path(args.verl).resolve() / 'verl/utils/seqlen_balancing.py'}")
    print(f"lognormal lengths (mean ~600, sigma 1.0), {args.seeds} draws per case, median of {args.repeats} calls; "
          "ratio = max part / lower bound (mean over draws)\n")
    methods = [
        ("evenrl balanced_partition", lambda x, k: balanced_partition(x, k).parts),
        ("verl karmarkar_karp", lambda x, k: verl.karmarkar_karp(x, k, equal_size=False)),
        ("verl get_seqlen_balanced_partitions", lambda x, k: verl.get_seqlen_balanced_partitions(x, k, False)),
        ("verl KK equal_size=True (constrained)", lambda x, k: verl.karmarkar_karp(x, k, equal_size=True)),
    ]
    header = f"{'N':>5} {'K':>3}  {'method':<40} {'ratio':>8} {'ms':>9}"
    print(header)
    print("-" * len(header))
    for n, k in CASES:
        for name, fn in methods:
            if "equal_size=True" in name and n % k:
                print(f"{n:>5} {k:>3}  {name:<40} {'n/a':>8} {'':>9}  (verl asserts N % K == 0)")
                continue
            ratios, times = [], []
            for seed in range(args.seeds):
                lengths = lognormal_lengths(n, seed=seed)
                parts, ms = timed(lambda fn=fn, lengths=lengths, k=k: fn(lengths, k), args.repeats)
                check(parts, n, k)
                ratios.append(max(sum(lengths[i] for i in part) for part in parts) / lower_bound(lengths, k))
                times.append(ms)
            print(f"{n:>5} {k:>3}  {name:<40} {statistics.mean(ratios):8.4f} {statistics.mean(times):9.2f}",
                  flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
