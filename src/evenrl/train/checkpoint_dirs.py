"""A run's checkpoint directories, without torch (the launcher checks a run directory before it imports torch):
which `step-N` directory is a whole checkpoint, the newest one, its meta.json, and deleting one so that a kill
half-way never leaves a step directory with some of its files gone. evenrl.train.checkpoint writes and reads
what is inside."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

from evenrl.errors import UsageError

# what every refused checkpoint's line ends with
EARLIER = "delete it or resume from an earlier one"
STEP_DIR = re.compile(r"step-(\d+)")


def discard(path: Path) -> None:
    """Delete a checkpoint directory so that a kill half-way leaves a `.old-*` directory (removed at the next
    start), never a step directory with some of its files gone."""
    shutil.rmtree(retired(path), ignore_errors=True)


def retired(path: Path) -> Path:
    """`path` renamed (atomically) to a `.old-*` name beside it; the new name."""
    old = path.with_name(f".old-{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(path, old)
    return old


def is_complete(path: Path) -> bool:
    """A step directory holding the files a save writes last before its rename (meta.json, trainer.pt)."""
    return (path / "meta.json").is_file() and (path / "trainer.pt").is_file()


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or None. Half-written `.tmp-*` and half-deleted `.old-*` directories are
    ignored; a `latest` pointer that cannot be read or names no complete checkpoint falls back to the highest
    complete step-N (is_complete)."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        cand = root / name
        if STEP_DIR.fullmatch(name) and is_complete(cand):
            return cand
    done = [p for p in root.glob("step-*") if STEP_DIR.fullmatch(p.name) and is_complete(p)]
    return max(done, key=lambda p: int(p.name[5:])) if done else None


def read_meta(path: str | os.PathLike) -> dict:
    """A checkpoint's meta.json: a JSON object whose "step" is a whole number (the one in the directory's name);
    anything else is a one-line UsageError naming the file."""
    f = Path(path) / "meta.json"
    want = '{"step": N, "time": T} as evenrl train writes it'
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"{f}: cannot read ({e.__class__.__name__}); {EARLIER}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UsageError(f"{f}: not valid JSON; expected {want}; {EARLIER}") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{f}: top level is a {type(meta).__name__}; expected {want}; {EARLIER}")
    if "step" not in meta:
        raise UsageError(f"{f}: no \"step\" field; expected {want}; {EARLIER}")
    step = meta["step"]
    if type(step) is not int or step < 0:
        raise UsageError(f"{f}: step is {step!r}; expected a whole number >= 0; {EARLIER}")
    named = STEP_DIR.fullmatch(Path(path).name)
    if named and int(named.group(1)) != step:
        raise UsageError(f"{f}: step is {step} but the directory is {Path(path).name}; {EARLIER}")
    return meta
