"""Atomic checkpoints: a kill during a save leaves the previous checkpoint intact.

A checkpoint is a directory `checkpoints/step-000010/` holding
  model.safetensors    the policy's weights (safetensors; no pickle)
  trainer.pt           optimizer, scheduler, prompt-sampler and RNG state (read back with weights_only=True)
  meta.json            step number and what wrote it
It is written under `checkpoints/.tmp-step-000010-<pid>/` and renamed into place (rename is atomic on POSIX),
then `checkpoints/latest` (a one-line text file) is replaced atomically. Under data parallelism every rank
holds the same replicated state, so rank 0 writes it; that is also why a run can resume on a different
number of ranks.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from evenrl.errors import UsageError


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    py = state["python"]
    # torch.load(weights_only=True) gives lists where random.setstate wants tuples
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(state["torch"])


def save(ckpt_root: str | os.PathLike, step: int, *, model: torch.nn.Module, trainer_state: dict,
         keep: int = 2) -> Path:
    """Write checkpoint `step` atomically and prune all but the newest `keep`. Call on rank 0 only."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # safetensors refuses shared storage (tied embeddings): save each tensor once, contiguous.
    state = {}
    seen = {}
    for k, v in model.state_dict().items():
        key = (v.data_ptr(), v.shape, v.stride())
        if key in seen:
            continue
        seen[key] = k
        state[k] = v.detach().to("cpu").contiguous()
    save_file(state, str(tmp / "model.safetensors"))
    torch.save(trainer_state, tmp / "trainer.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, "time": time.time()}))
    _fsync_dir(tmp)
    if final.exists():  # a re-run of the same step (after a resume) replaces it
        old = root / f".old-{name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _write_text_atomic(root / "latest", name + "\n")
    _fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
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


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or None. Half-written `.tmp-*` directories are ignored."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    if pointer.exists():
        cand = root / pointer.read_text().strip()
        if (cand / "meta.json").exists():
            return cand
    done = sorted(p for p in root.glob("step-*") if (p / "meta.json").exists())
    return done[-1] if done else None


def load(path: str | os.PathLike, model: torch.nn.Module) -> tuple[int, dict]:
    """Load weights into `model` and return (step, trainer_state)."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        weights = load_file(str(path / "model.safetensors"))
        trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, SafetensorError, KeyError) as e:
        raise UsageError(f"{path}: unreadable checkpoint ({e.__class__.__name__}); "
                         f"delete it or resume from an earlier one") from None
    device = next(model.parameters()).device
    missing, unexpected = model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
    # tied weights were saved once; anything else missing means a different model
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise UsageError(f"{path}: checkpoint does not match model.path (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); resume with the same model")
    return int(meta["step"]), trainer_state


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(tied, dict):
        tied = list(tied)
    return key in tied or (key == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))


def save_final(model, tokenizer, out: Path) -> None:
    """The trained model as a Hugging Face directory (safetensors), written atomically."""
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # safetensors by default
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
