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
import pickle
import random
import re
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
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name)))
    for _, old in steps[:-keep]:  # by number: step-1000000 is newer than step-999999
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


STEP_DIR = re.compile(r"step-(\d+)")
_EARLIER = "delete it or resume from an earlier one"


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or None. Half-written `.tmp-*` directories are ignored; a `latest`
    pointer that cannot be read or names no checkpoint falls back to the highest step-N with a meta.json."""
    root = Path(ckpt_root)
    pointer = root / "latest"
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        cand = root / name
        if STEP_DIR.fullmatch(name) and (cand / "meta.json").exists():
            return cand
    done = [p for p in root.glob("step-*") if STEP_DIR.fullmatch(p.name) and (p / "meta.json").exists()]
    return max(done, key=lambda p: int(p.name[5:])) if done else None


def read_meta(path: str | os.PathLike) -> dict:
    """A checkpoint's meta.json: a JSON object whose "step" is a whole number (the one in the directory's name);
    anything else is a one-line UsageError naming the file."""
    f = Path(path) / "meta.json"
    want = '{"step": N, "time": T} as evenrl train writes it'
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"{f}: cannot read ({e.__class__.__name__}); {_EARLIER}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UsageError(f"{f}: not valid JSON; expected {want}; {_EARLIER}") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{f}: top level is a {type(meta).__name__}; expected {want}; {_EARLIER}")
    if "step" not in meta:
        raise UsageError(f"{f}: no \"step\" field; expected {want}; {_EARLIER}")
    step = meta["step"]
    if type(step) is not int or step < 0:
        raise UsageError(f"{f}: step is {step!r}; expected a whole number >= 0; {_EARLIER}")
    named = STEP_DIR.fullmatch(Path(path).name)
    if named and int(named.group(1)) != step:
        raise UsageError(f"{f}: step is {step} but the directory is {Path(path).name}; {_EARLIER}")
    return meta


def load(path: str | os.PathLike, model: torch.nn.Module) -> tuple[int, dict]:
    """Load weights into `model` and return (step, trainer_state). The metadata is checked before anything is
    read into the model; every problem is a one-line UsageError naming the checkpoint's file."""
    path = Path(path)
    step = read_meta(path)["step"]
    try:
        weights = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise UsageError(f"{path / 'model.safetensors'}: unreadable checkpoint ({e.__class__.__name__}); "
                         f"{_EARLIER}") from None
    try:
        trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as e:
        raise UsageError(f"{path / 'trainer.pt'}: unreadable checkpoint ({e.__class__.__name__}); "
                         f"{_EARLIER}") from None
    if not isinstance(trainer_state, dict):
        raise UsageError(f"{path / 'trainer.pt'}: holds a {type(trainer_state).__name__}; expected the trainer state "
                         f"(a dict); {_EARLIER}")
    if "step" in trainer_state and trainer_state["step"] != step:
        raise UsageError(f"{path / 'trainer.pt'}: saved at step {trainer_state['step']!r} but meta.json says {step}; "
                         f"{_EARLIER}")
    device = next(model.parameters()).device
    try:
        missing, unexpected = model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
    except RuntimeError as e:  # same names, other shapes
        raise UsageError(f"{path}: checkpoint does not match model.path ({_last_line(e)}); resume with the same "
                         "model") from None
    # tied weights were saved once; anything else missing means a different model
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise UsageError(f"{path}: checkpoint does not match model.path (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}); resume with the same model")
    return step, trainer_state


def _last_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


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
