"""Plot a run directory's metrics to PNG files (the plots themselves: evenrl.train.plots).

    evenrl report runs/demo/grpo      # writes runs/demo/grpo/plots/*.png and prints their paths
"""

from __future__ import annotations

from pathlib import Path

from evenrl.errors import ArgumentParser, UsageError
from evenrl.train.plots import write_plots


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="evenrl report", description="Plot a run directory's metrics to PNG.")
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    if not Path(args.run_dir).is_dir():
        raise UsageError(f"{args.run_dir}: not a directory; give a run directory written by evenrl train")
    for path in write_plots(args.run_dir):
        print(path)
    return 0
