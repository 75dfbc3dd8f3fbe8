"""Plot a run directory's metrics to PNG files (the plots themselves: evenrl.train.plots).

    evenrl report runs/demo/grpo                  # writes runs/demo/grpo/plots/*.png and prints their paths
    evenrl report runs/one runs/two               # and compare.png: the first step the two runs' weights differ
"""

from __future__ import annotations

from pathlib import Path

from evenrl.errors import ArgumentParser, UsageError
from evenrl.train.plots import comparable, plotted_rows, write_comparison, write_plots
from evenrl.train.runlog import read_metrics


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="evenrl report", description="Plot a run directory's metrics to PNG.")
    p.add_argument("run_dir")
    p.add_argument("other_run", nargs="?", help="another run directory: compare the weights/hash each step logged "
                                                "(train.reproducibility=bitwise) and plot where they part")
    args = p.parse_args(argv)
    for d in (args.run_dir, args.other_run):
        if d is not None and not Path(d).is_dir():
            raise UsageError(f"{d}: not a directory; give a run directory written by evenrl train")
    # both runs read and checked before anything is written: a refusal leaves both directories as they were
    rows = plotted_rows(args.run_dir)
    if args.other_run is not None:
        other = read_metrics(args.other_run)
        comparable(args.run_dir, args.other_run, rows, other)
    for path in write_plots(args.run_dir, rows):
        print(path)
    if args.other_run is not None:
        path, verdict = write_comparison(args.run_dir, args.other_run, rows, other)
        print(path)
        print(f"evenrl report: {verdict}")
    return 0
