"""A run directory belongs to one run. Checked before anything loads or is written, by the launcher and by every
worker (the check only reads the file system, so ranks started by torchrun or Slurm agree without a collective).

  * a directory that already holds a run (metrics, checkpoints, a final model) is refused unless the command says
    what to do with it: --resume continues it, --overwrite replaces it;
  * --resume with no checkpoint to continue from is refused (a restarted worker with none starts over instead:
    the first attempt died before its first save);
  * a directory that cannot be created or written is refused with the reason, found by making (and removing) a
    directory where the run's would go: an empty name, the current directory or one above it (where --overwrite
    would delete the user's files), names past the system's limits, symlinks that lead nowhere, a file system
    that makes no directories (/proc);
  * temp directories of saves and prunes that were killed half-way (.tmp-*, .old-*), and step directories an older
    version's prune left half-deleted, are removed when the run starts.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from evenrl.errors import UsageError, bad
from evenrl.train import checkpoint_dirs as checkpoint

# What a run writes; --overwrite removes exactly these, never anything else a user keeps in the directory.
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "checkpoints", "final", "tb", "plots", "config.yaml", "plan.txt",
             "plan.json", "wandb", "mlflow", "trackers.json")
# What shows that a run has already trained here (a plan alone does not).
TRAINED = ("metrics.jsonl", "checkpoints", "final")
# Characters a run's own paths add under its directory (checkpoints/.tmp-step-000010-<pid>/state/__0_0.distcp,
# final/merged/...), kept free below the system's limit on a path.
_DEEPEST = 160


def check(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool, restarted: bool = False) -> None:
    """Refuse (UsageError, one line) a run directory this run may not use; writes nothing."""
    d = Path(run_dir)
    if resume and overwrite:
        raise UsageError("--resume and --overwrite: give one; --resume continues the run in log.run_dir, "
                         "--overwrite replaces it")
    _check_usable(str(run_dir))
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
    """On rank 0 once the run starts: remove the old run's files (--overwrite), temp directories that killed saves
    and prunes left behind, and step directories that are not whole checkpoints (an older version's prune)."""
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
    for step in (d / "checkpoints").glob("step-*") if (d / "checkpoints").is_dir() else ():
        if step.is_dir() and checkpoint.STEP_DIR.fullmatch(step.name) and not checkpoint.is_complete(step):
            checkpoint.discard(step)


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    """A checkpoint `evenrl train --resume` would load (a complete step directory, as checkpoint.latest finds)."""
    return checkpoint.latest(Path(run_dir) / "checkpoints") is not None


def _check_usable(run_dir: str) -> None:
    """log.run_dir must name a directory of its own that this process can create, or use where it exists: a
    UsageError (one line) otherwise. Writes nothing it leaves behind."""
    if not run_dir.strip():
        raise bad("log.run_dir", run_dir, "give a directory for the run's files, e.g. runs/NAME")
    d = Path(os.path.abspath(run_dir))
    try:
        here = Path.cwd().resolve()
        where = d.resolve()
    except (OSError, RuntimeError):  # a symlink loop on the way (RuntimeError before Python 3.13): named below
        here = where = None
    if where is not None and (where == here or where in here.parents):
        raise UsageError(f"log.run_dir: {run_dir} is {'the' if where == here else 'above the'} current directory, "
                         "where a run writes config.yaml, metrics.jsonl, checkpoints/ ... and --overwrite deletes "
                         "them; give a directory of its own, e.g. runs/NAME")
    probe = _nearest(d, run_dir)
    longest = os.pathconf(probe, "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    for part in d.relative_to(probe).parts:
        if len(os.fsencode(part)) > longest:
            raise UsageError(f"log.run_dir: holds a name of {len(os.fsencode(part)):,} bytes; this file system "
                             f"allows {longest}")
    most = (os.pathconf(probe, "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096) - _DEEPEST
    if len(os.fsencode(d)) > most:
        raise UsageError(f"log.run_dir: {len(os.fsencode(d)):,} bytes as an absolute path; at most {most:,} (the "
                         f"system's limit less the {_DEEPEST} a run's own files add)")
    if not probe.is_dir():
        raise UsageError(f"log.run_dir: {run_dir} cannot be created: {probe} is a file, not a directory")
    try:  # the one sure test: make a directory where the run's goes (its own name: ranks probe side by side)
        os.rmdir(tempfile.mkdtemp(prefix=".evenrl-probe-", dir=probe))
    except OSError as e:
        verb = "written" if probe == d else "created"
        raise UsageError(f"log.run_dir: {run_dir} cannot be {verb}: making a directory in {probe} failed "
                         f"({e.strerror})") from None


def _nearest(d: Path, run_dir: str) -> Path:
    """The deepest existing directory on the way to `d` (d itself when it exists); a symlink on the way that leads
    nowhere is a UsageError (mkdir would fail on it after the model has loaded)."""
    for p in [*reversed(d.parents), d]:
        if os.path.exists(p):
            continue
        if os.path.islink(p):
            try:
                os.stat(p)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UsageError(f"log.run_dir: {p} is a symlink loop; give a directory") from None
            raise UsageError(f"log.run_dir: {p} is a symlink to {os.readlink(p)}, which does not exist; create "
                             "that directory or give another") from None
        return p.parent
    return d
