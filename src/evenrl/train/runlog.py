"""What a run leaves behind in its directory (rank 0 writes; other ranks get a no-op logger).

    RUN_DIR/config.yaml      the resolved config
    RUN_DIR/plan.txt|json    the preflight plan for the layout the run had
    RUN_DIR/metrics.jsonl    one JSON object per step
    RUN_DIR/samples.jsonl    a few completions every `log.samples_every_steps` steps
    RUN_DIR/tb/              TensorBoard event files (log.trackers: tensorboard)
    RUN_DIR/wandb/, mlflow/  W&B offline runs, the local MLflow store (log.trackers: wandb, mlflow)
    RUN_DIR/trackers.json    the trackers' run ids, for a resume (evenrl.train.trackers)
    RUN_DIR/checkpoints/     see evenrl.train.checkpoint
    RUN_DIR/final/           the trained model as a Hugging Face directory
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from evenrl.errors import UsageError, first_line, shown

if TYPE_CHECKING:
    from evenrl.train.trackers import Trackers

# A sampled token whose engine and trainer log-probs differ by more than this counts in rollout/mismatch_fraction.
MISMATCH_THRESHOLD = 0.1


class RunLog:
    def __init__(self, run_dir: str, *, enabled: bool, trackers: Trackers | None, progress_total: int | None,
                 progress: bool, initial_step: int = 0, shown: dict[str, str] | None = None):
        """`trackers` (rank 0's, evenrl.train.trackers) get every row metrics.jsonl gets; `shown` maps metric names
        to the short labels the progress bar shows after each step."""
        self.dir = Path(run_dir)
        self.shown = shown or {}
        self.enabled = enabled
        self.trackers = trackers if enabled else None
        self._bar = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
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
        if self.trackers is not None:
            self.trackers.log(step, values)
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
        if self.trackers is not None:
            self.trackers.close()


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


MAX_STEP = 10**12  # more steps than any run takes: a larger "step" is damage, and could not be plotted


def _outsized(value, key: str = "") -> str | None:
    """The key of the first integer, at any depth of a row, that no float holds (a plot converts every number)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return key if abs(value) > sys.float_info.max else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _outsized(v, f"{key}[{k}]" if isinstance(k, int) else (f"{key}.{k}" if key else str(k)))
        if found is not None:
            return found
    return None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl ([] when there is none). A line that is not a JSON object with a whole
    "step" is a one-line UsageError naming the file and the line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    try:
        with path.open("rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    raise UsageError(f"{path} line {n}: not valid JSON; expected one JSON object per step, as evenrl "
                                     "train writes (delete the line to read the rest)") from None
                except ValueError as e:  # an integer past Python's digit limit (4,300), and the like
                    raise UsageError(f"{path} line {n}: a value cannot be read ({first_line(e)[:80]}); expected "
                                     "the numbers evenrl train writes (delete the line to read the rest)") from None
                if not isinstance(row, dict):
                    kind = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(
                        type(row), "null")
                    raise UsageError(f"{path} line {n}: a JSON {kind}; expected one JSON object per step")
                if type(row.get("step")) is not int or not 0 <= row["step"] <= MAX_STEP:
                    raise UsageError(f"{path} line {n}: \"step\" is {shown(row.get('step'), 40)}; expected a whole "
                                     f"number from 0 to {MAX_STEP:,}")
                key = _outsized(row)
                if key is not None:
                    raise UsageError(f"{path} line {n}: \"{key}\" holds a number too large for a plot (beyond "
                                     f"{sys.float_info.max:.3g}); expected the numbers evenrl train writes")
                rows.append(row)
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.__class__.__name__}); expected the metrics of a run") from None
    return rows
