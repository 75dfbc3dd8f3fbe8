"""What each experiment tracker costs rank 0: starting it (import, run creation, the config), logging one metrics row
of a typical step (~40 numbers), and closing it, side by side; nothing leaves the machine (W&B offline, MLflow's
local SQLite store).

    .venv/bin/python benchmarks/trackers.py           # each tracker alone, in a fresh process, 200 rows
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

ROWS = 200
CODE = """
import time
t0 = time.perf_counter()
from evenrl.config import load_config
from evenrl.train.trackers import Trackers
cfg = load_config(None, ["log.trackers={trackers}"])
t1 = time.perf_counter()
trackers = Trackers(cfg, {run_dir!r})
t2 = time.perf_counter()
row = {{f"group{{i % 6}}/metric{{i}}": i / 7 for i in range(40)}}
for step in range({rows}):
    trackers.log(step, row)
t3 = time.perf_counter()
trackers.close()
t4 = time.perf_counter()
print(f"{{t2 - t1:.2f}} {{(t3 - t2) / {rows} * 1e3:.3f}} {{t4 - t3:.2f}}")
"""


def main() -> None:
    print(f"{'trackers':<14} {'start s':>8} {'ms / row':>9} {'close s':>8}   ({ROWS} rows of 40 numbers, "
          "fresh process each)")
    for trackers in ("[]", "[tensorboard]", "[wandb]", "[mlflow]"):
        with tempfile.TemporaryDirectory() as d:
            out = subprocess.run([sys.executable, "-c", CODE.format(trackers=trackers, run_dir=d, rows=ROWS)],
                                 capture_output=True, text=True, check=True).stdout.split()
        print(f"{trackers:<14} {float(out[0]):8.2f} {float(out[1]):9.3f} {float(out[2]):8.2f}")


if __name__ == "__main__":
    main()
