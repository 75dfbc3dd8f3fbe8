"""Plot a run directory's metrics to PNG files (the plots themselves: evenrl.train.plots).

    evenrl report runs/demo/grpo                  # writes runs/demo/grpo/plots/*.png and prints their paths
    evenrl report runs/one runs/two               # and compare.png: the first step the two runs' weights differ
"""

from __future__ import annotations

from pathlib import Path

from evenrl.errors import ArgumentParser, UsageError
from evenrl.train.plots import write_comparison, write_plots


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="evenrl report", description="Plot a run directory's metrics to PNG.")
    p.add_argument("run_dir")
    p.add_argument("other_run", nargs="?", help="another run directory: compare the weights/hash each step logged "
                                                "(train.reproducibility=bitwise) and plot where they part")
    args = p.parse_args(argv)
    for d in (args.run_dir, args.other_run):
        if d is not None and not Path(d).is_dir():
            raise UsageError(f"{d}: not a directory; give a run directory written by evenrl train")
    for path in write_plots(args.run_dir):
        print(path)
    if args.other_run is not None:
        path, verdict = write_comparison(args.run_dir, args.other_run)
        print(path)
        print(f"evenrl report: {verdict}")
    return 0
