"""A run directory belongs to one run. Checked before anything loads or is written, by the launcher and by every
worker (the check only reads the file system, so ranks started by torchrun or Slurm agree without a collective).

  * a directory that already holds a run (metrics, checkpoints, a final model) is refused unless the command says
    what to do with it: --resume continues it, --overwrite replaces it;
  * --resume with no checkpoint to continue from is refused (a restarted worker with none starts over instead:
    the first attempt died before its first save);
  * a directory that cannot be created or written is refused with the reason;
  * temp directories of saves that were killed half-way (.tmp-*, .old-*) are removed when the run starts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from evenrl.errors import UsageError
from evenrl.train import checkpoint

# What a run writes; --overwrite removes exactly these, never anything else a user keeps in the directory.
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "checkpoints", "final", "tb", "plots", "config.yaml", "plan.txt",
             "plan.json", "wandb", "mlflow", "trackers.json")
# What shows that a run has already trained here (a plan alone does not).
TRAINED = ("metrics.jsonl", "checkpoints", "final")


def check(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool, restarted: bool = False) -> None:
    """Refuse (UsageError, one line) a run directory this run may not use; writes nothing."""
    d = Path(run_dir)
    if resume and overwrite:
        raise UsageError("--resume and --overwrite: give one; --resume continues the run in log.run_dir, "
                         "--overwrite replaces it")
    _check_writable(d)
    used = [name for name in TRAINED if (d / name).exists()]
    if resume or restarted:
        if not has_checkpoint(d) and not restarted:
            found = f"holds {used[0]} but no checkpoint" if used else "holds no checkpoint"
            raise UsageError(f"--resume: {d} {found} to continue from (it stopped before its first save); run without "
                             "--resume to start a new run there" + (" (with --overwrite)" if used else "") + "; next "
                             "time keep checkpoint.every_steps / every_minutes > 0 (a run also saves on Ctrl-C and "
                             "SIGTERM, not when killed with SIGKILL)")
    elif used and not overwrite:
        raise UsageError(f"log.run_dir: {d} already holds a run ({used[0]}); --resume continues it, --overwrite "
                         "replaces it, or choose another log.run_dir")


def finished_step(run_dir: str | os.PathLike, steps: int) -> int | None:
    """The step of the run's latest checkpoint when it is at or past `steps` and the final model is there (the run
    has nothing left to do), else None."""
    d = Path(run_dir)
    found = checkpoint.latest(d / "checkpoints")
    if found is None or not (d / "final").is_dir():
        return None
    step = checkpoint.read_meta(found)["step"]
    return step if step >= steps else None


def prepare(run_dir: str | os.PathLike, *, overwrite: bool) -> None:
    """On rank 0 once the run starts: remove the old run's files (--overwrite) and temp directories that killed
    saves left behind."""
    d = Path(run_dir)
    if overwrite:
        for name in RUN_FILES:
            p = d / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    for parent in (d, d / "checkpoints"):
        for tmp in [*parent.glob(".tmp-*"), *parent.glob(".old-*")] if parent.is_dir() else ():
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    """A checkpoint `evenrl train --resume` would load (a complete step directory, as checkpoint.latest finds)."""
    return checkpoint.latest(Path(run_dir) / "checkpoints") is not None


def _check_writable(d: Path) -> None:
    """The directory, or the nearest ancestor that exists, must be a writable directory."""
    probe = d
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"log.run_dir: {d} cannot be created: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"log.run_dir: {d} cannot be {'written' if probe == d else 'created'}: no write permission "
                         f"on {probe}")
