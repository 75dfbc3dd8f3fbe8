"""What a run leaves behind in its directory (rank 0 writes; other ranks get a no-op logger).

    RUN_DIR/config.yaml      the resolved config
    RUN_DIR/plan.txt|json    the preflight plan for the layout the run had
    RUN_DIR/metrics.jsonl    one JSON object per step
    RUN_DIR/samples.jsonl    a few completions every `log.samples_every_steps` steps
    RUN_DIR/tb/              TensorBoard event files
    RUN_DIR/checkpoints/     see evenrl.train.checkpoint
    RUN_DIR/final/           the trained model as a Hugging Face directory
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class RunLog:
    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool, progress_total: int | None,
                 progress: bool, initial_step: int = 0, shown: dict[str, str] | None = None):
        """`shown` maps metric names to the short labels the progress bar shows after each step."""
        self.dir = Path(run_dir)
        self.shown = shown or {}
        self.enabled = enabled
        self._tb = None
        self._bar = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tb"))
            except ImportError:  # tensorboard is a declared dependency; tolerate its absence anyway
                self._tb = None
        if progress and progress_total:
            from tqdm import tqdm

            self._bar = tqdm(total=progress_total, initial=initial_step, unit="step", dynamic_ncols=True,
                             mininterval=1.0)
        self._t0 = time.time()

    def write_text(self, name: str, text: str) -> None:
        if self.enabled:
            (self.dir / name).write_text(text)

    def metrics(self, step: int, values: dict, advance: bool = True) -> None:
        """Append one row; `advance=False` for a row that is not a training step (evaluation before step 1)."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in values.items()}}
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._bar is not None and advance:
            self._bar.update(1)
            self._bar.set_postfix_str(" ".join(f"{label} {values[k]:.4g}" for k, label in self.shown.items()
                                               if isinstance(values.get(k), (int, float))), refresh=False)

    def samples(self, step: int, rows: list[dict]) -> None:
        if not self.enabled:
            return
        with open(self.dir / "samples.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
