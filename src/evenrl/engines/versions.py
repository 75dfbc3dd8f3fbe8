"""Policy versions as pushed, on disk: what a checkpoint keeps so that a run resumed from it regenerates the steps
that were in flight with the weights they were meant to sample from (rollout.max_staleness = k >= 1, reserved
rollout ranks; evenrl.core.staleness says which versions).

    checkpoints/versions/v<N>/        the staging area: version N's push buckets, written by rank 0 as they go out
    checkpoints/step-C/versions/v<N>/ the versions checkpoint C carries, hard-linked from the staging area

Each bucket is one safetensors file (in push order, its tensor names in the file's metadata), so a version reads back
as exactly the buckets that were pushed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch

from evenrl.errors import UsageError

VERSIONS = "versions"
_EARLIER = "delete it or resume from an earlier one"

Buckets = Iterable[list[tuple[str, torch.Tensor]]]


class VersionStore:
    """The staging area under a run's checkpoint directory (rank 0 only writes it)."""

    def __init__(self, ckpt_root: str | os.PathLike):
        self.root = Path(ckpt_root) / VERSIONS

    def save(self, version: int, buckets: Buckets) -> None:
        """Write policy `version` as pushed (its buckets, in order, one safetensors file each), atomically."""
        from safetensors.torch import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"v{version}"
        tmp = self.root / f".tmp-v{version}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for i, bucket in enumerate(buckets):
            seen: set[int] = set()
            tensors = {}
            for name, t in bucket:  # a tied tensor appears under two names: safetensors stores shared memory once only
                tensors[name] = t.detach().to("cpu", copy=True) if id(t) in seen else t.detach().cpu().contiguous()
                seen.add(id(t))
            save_file(tensors, str(tmp / f"{i:05d}.safetensors"),
                      metadata={"names": json.dumps([n for n, _ in bucket])})
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)

    def link_into(self, checkpoint_dir: Path, versions: list[int]) -> None:
        """Make `versions` part of the checkpoint being written in `checkpoint_dir` (hard links: no second copy)."""
        for v in versions:
            src, dst = self.root / f"v{v}", checkpoint_dir / VERSIONS / f"v{v}"
            dst.mkdir(parents=True)
            for f in src.iterdir():
                try:
                    os.link(f, dst / f.name)
                except OSError:  # a file system without hard links
                    shutil.copy2(f, dst / f.name)

    def prune(self, below: int) -> None:
        """Forget the staged versions older than `below`: no later checkpoint needs them (the ones already written
        hold their own links)."""
        for v in self.root.glob("v*"):
            if v.name[1:].isdigit() and int(v.name[1:]) < below:
                shutil.rmtree(v, ignore_errors=True)


def read_version(checkpoint: str | os.PathLike, version: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Policy `version` kept by the checkpoint at `checkpoint`: its push buckets, in order."""
    from safetensors import safe_open

    where = Path(checkpoint) / VERSIONS / f"v{version}"
    files = sorted(where.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{where}: missing; this checkpoint was saved with rollout.max_staleness >= 1 and must keep "
                         f"the policy versions its next steps sample from; {_EARLIER}")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as reader:
                names = json.loads(reader.metadata()["names"])
                yield [(n, reader.get_tensor(n)) for n in names]
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise UsageError(f"{f}: unreadable policy version ({e.__class__.__name__}); {_EARLIER}") from None


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries to disk (renames into it survive a crash); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
