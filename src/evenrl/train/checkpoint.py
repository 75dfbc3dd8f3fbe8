"""Atomic, sharded checkpoints that resume on any number of ranks, replicated or sharded.

A checkpoint is a directory `checkpoints/step-000010/` holding
  state/       model weights and optimizer moments (the critic's too, when the run trains one: algo.advantage=gae),
               by parameter name, in torch.distributed.checkpoint (DCP) format; only what trains (with
               model.lora the adapters and their moments: the frozen base is model.path's):
               each rank writes the pieces it holds (its shards under sharding=fsdp; replicated tensors are written
               once, by one rank), and DCP reads back whatever pieces a rank needs, so a checkpoint saved on 3 ranks
               loads on 2 or 4, and a replicated run can resume sharded and back.
  trainer.pt   optimizer hyper-parameters (param_groups), scheduler, prompt-sampler and RNG state (no tensors of the
               model; read back with weights_only=True)
  meta.json    step number and what wrote it
  versions/    with rollout.max_staleness = k >= 1: the earlier policy versions the next k steps sample from
               (evenrl.core.staleness.versions_needed), each `v<N>/` the weight push's buckets as safetensors files,
               so a resumed run regenerates the steps that were in flight exactly; the weight sync puts them there
               (evenrl.engines.sync, evenrl.engines.versions).
Every rank writes under `checkpoints/.tmp-step-000010-<id>/`; when all have finished, rank 0 renames it into place
(rename is atomic on POSIX) and replaces `checkpoints/latest` atomically, so a kill at any point leaves the previous
checkpoint and `latest` valid. Old checkpoints leave the same way: renamed to `.old-*` first, then deleted, so a kill
while pruning leaves no `step-N/` that looks like a checkpoint and is not one (the next start clears `.old-*`, and
a step directory without meta.json and trainer.pt, an older version's debris, is never a resume point). DCP's index file is a pickle: it is read with an unpickler that builds only DCP's
own metadata classes, torch sizes and dtypes (anything else is refused), and the tensor files with
torch.load(weights_only=True).
`final/` is a Hugging Face directory (safetensors, full state dict), gathered bucket by bucket
(evenrl.distributed.weights.full_weights); with model.lora the adapter in PEFT's format (loaded onto model.path by
peft or vLLM as is), and with log.save_merged the base with the adapter merged by peft in `final/merged/`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from evenrl.distributed import collectives as dist
from evenrl.distributed.weights import full_weights
from evenrl.engines.versions import fsync_dir
from evenrl.errors import RunStopped, UsageError
from evenrl.models.lora import adapter_config, has_adapters, is_adapter, save_adapter
from evenrl.planner.reproducibility import recorded
from evenrl.rollout import carry_check
# the step directories' layout (torch-free, for the launcher); latest and read_meta are this module's API too
from evenrl.train.optimizer import forget_steps
from evenrl.train.checkpoint_dirs import (EARLIER, STEP_DIR, discard, is_complete, latest, read_meta,  # noqa: F401
                                          retired)


def _dcp():
    """torch.distributed.checkpoint, imported when a checkpoint is first saved or read, not with the trainer: it
    brings DTensor, torch.fx's symbolic shapes and sympy (0.6-0.9 s of CPU per process on this machine, 4 s on a
    loaded one), which a process that never checkpoints (a reserved rollout rank, a run stopped by bad input) pays
    for nothing."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.api
    import torch.distributed.checkpoint.metadata
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - submodules dcp.* reads

    return dcp


def _trained_options():
    """Loading checks that every tensor of the template (_trained_state) is in the checkpoint (DCP) before
    set_state_dict, which may then leave the frozen ones out."""
    return _dcp().state_dict.StateDictOptions(ignore_frozen_params=True, strict=False)


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


class Checkpointed(Protocol):
    """What a checkpoint holds of a trainer (evenrl.train.trainer.Trainer): its trained models with their
    optimizers by name ("policy", "critic"), its small state (no tensors of the models) and its weight sync, which
    adds the policy versions the next steps sample from."""

    step: int
    sync: Any

    def trained(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def save(ckpt_root: str | os.PathLike, state: Checkpointed, *, keep: int = 2) -> Path:
    """Write checkpoint `state.step` atomically and prune all but the newest `keep`. Every rank calls it
    (collective)."""
    step = state.step
    root = Path(ckpt_root)
    name = f"step-{step:06d}"
    final = root / name
    tmp = root / f".tmp-{name}-{_run_token()}"
    if dist.is_main():
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    tensors, groups = {}, {}
    models = _prefixed(state.trained())
    # an optimizer that has not stepped yet (rollout.partial: steps before any group finished train nothing):
    # reading its state initializes it with a zero step (DCP's _init_optim_state), which would make Adam's next
    # step the second; it is put back as it was after the save, and a resume from here does the same
    fresh = [prefix for prefix, (_, opt) in models.items() if not opt.state]
    for prefix, (m, opt) in models.items():
        model_state, optim_state = _trained_state(m, opt)
        tensors.update({f"{prefix}model": model_state, f"{prefix}optimizer": optim_state["state"]})
        groups[f"{prefix}param_groups"] = optim_state["param_groups"]
    groups["fresh_optimizers"] = fresh
    dcp = _dcp()
    try:
        with dist.guard("checkpoint save"), _single_process_is_meant():
            dcp.save(tensors,
                     storage_writer=dcp.FileSystemWriter(str(tmp / "state"), single_file_per_rank=True),
                     no_dist=dist.world() == 1,
                     process_group=dist.trainer_group())  # reserved rollout ranks: not theirs
    except dcp.api.CheckpointException as e:  # a BaseException: it would pass every `except Exception` on the way
        reasons = sorted({_last_line(f) for f in e.failures.values()}) or [_last_line(e)]
        raise RunStopped(f"checkpoint {name}: writing {tmp / 'state'} failed ({'; '.join(reasons)[:200]}); "
                         f"the previous checkpoint stays the latest") from None
    for prefix in fresh:
        forget_steps(models[prefix][1])
    small = state.state_dict()  # on every rank: it may gather (rollout.partial's samples)
    if dist.is_main():
        torch.save({**small, **groups}, tmp / "trainer.pt")
        versions = state.sync.keep(tmp, step) if state.sync is not None else []
        cfg = getattr(state, "cfg", None)  # what a bitwise resume compares (planner.reproducibility)
        settings = {} if cfg is None else {"settings": recorded(cfg)}
        (tmp / "meta.json").write_text(json.dumps({"step": step, "time": time.time(), "world": dist.world(),
                                                   "versions": versions, **settings}))
        fsync_dir(tmp)
        old = retired(final) if final.exists() else None  # a re-run of the same step (after a resume) replaces it
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _write_text_atomic(root / "latest", name + "\n")
        fsync_dir(root)
        steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                       if p.is_dir() and (m := STEP_DIR.fullmatch(p.name)))
        for _, old in steps[:-keep]:  # by number: step-1000000 is newer than step-999999
            discard(old)
    dist.barrier()
    return final


@contextlib.contextmanager
def _single_process_is_meant():
    """DCP warns at every save and load of one process without a group; that is what evenrl means by one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _run_token() -> str:
    """The same temporary-directory suffix on every rank (rank 0's pid, agreed through the group)."""
    return str(dist.all_gather_object(os.getpid())[0])


def read_state(path: str | os.PathLike) -> dict:
    """A checkpoint's trainer.pt (the trainer's small state and the optimizers' param_groups), checked to be what
    evenrl train writes for the step in meta.json; every problem is a one-line UsageError naming the file."""
    path = Path(path)
    step = read_meta(path)["step"]
    try:
        trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as e:
        raise UsageError(f"{path / 'trainer.pt'}: unreadable checkpoint ({e.__class__.__name__}); "
                         f"{EARLIER}") from None
    if not isinstance(trainer_state, dict) or not isinstance(trainer_state.get("param_groups"), list):
        raise UsageError(f"{path / 'trainer.pt'}: holds a {type(trainer_state).__name__} without param_groups; "
                         f"expected the trainer state evenrl train writes; {EARLIER}")
    if "step" in trainer_state and trainer_state["step"] != step:
        raise UsageError(f"{path / 'trainer.pt'}: saved at step {trainer_state['step']!r} but meta.json says {step}; "
                         f"{EARLIER}")
    return trainer_state


def last_good(ckpt_root: Path, cfg, *, vocab: int, rows: int, eos: set[int]) -> Path | None:
    """The newest complete checkpoint under `ckpt_root` whose carried samples are sound (any, without
    rollout.partial; evenrl.rollout.carry_check.problem); None when there is none."""
    steps = sorted((p for p in Path(ckpt_root).glob("step-*") if STEP_DIR.fullmatch(p.name) and is_complete(p)),
                   key=lambda p: int(p.name[5:]), reverse=True)
    for path in steps:
        if not cfg.rollout.partial:
            return path
        try:
            state = read_state(path)
        except UsageError:
            continue
        if carry_check.problem(state.get("carry"), cfg, step=int(path.name[5:]), vocab=vocab, rows=rows,
                               eos=eos) is None:
            return path
    return None



def load(path: str | os.PathLike, state: Checkpointed) -> int:
    """Restore `state` from the checkpoint at `path`: its models' weights and optimizer state (any number of ranks,
    replicated or sharded; every rank calls it), then its small state. Returns the checkpoint's step. The metadata
    is checked before anything is read into a model; every problem is a one-line UsageError naming the file."""
    path = Path(path)
    step = read_meta(path)["step"]
    trainer_state = read_state(path)
    models = _prefixed(state.trained())
    for prefix in models:
        if prefix and not isinstance(trainer_state.get(f"{prefix}param_groups"), list):
            raise UsageError(f"{path}: holds no {prefix[:-1]} (saved by a run without one?); resume with the same "
                             f"settings, or {EARLIER}")
    # The model's own (sharded or whole) tensors are the templates DCP reads into, each rank the pieces it holds.
    tensors = {}
    for prefix, (m, opt) in models.items():
        model_state, optim_state = _trained_state(m, opt)
        tensors.update({f"{prefix}model": model_state, f"{prefix}optimizer": optim_state["state"]})
    index = path / "state" / ".metadata"
    dcp = _dcp()
    try:  # the index alone first: a refused or unreadable one is named here, not inside DCP's per-rank report
        _safe_reader(str(path / "state")).read_metadata()
    except _Refused as e:
        raise UsageError(f"{index}: refused checkpoint index ({e}); {EARLIER}") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, pickle.UnpicklingError) as e:
        raise UsageError(f"{index}: unreadable checkpoint ({e.__class__.__name__}); {EARLIER}") from None
    try:
        with _single_process_is_meant():
            dcp.load(tensors, storage_reader=_safe_reader(str(path / "state")), no_dist=dist.world() == 1,
                     process_group=dist.trainer_group())
    except (dcp.api.CheckpointException, Exception) as e:  # DCP reports a rank's failure as a CheckpointException
        text = _last_line(e)
        if "Missing key" in text or "size" in text.lower() or "mismatch" in text.lower():
            raise UsageError(f"{path}: checkpoint does not match model.path ({text[:160]}); resume with the same "
                             "model and model.lora") from None
        raise UsageError(f"{path / 'state'}: unreadable checkpoint ({e.__class__.__name__}: {text[:160]}); "
                         f"{EARLIER}") from None
    try:
        for prefix, (m, opt) in models.items():
            groups = _with_kernels(trainer_state[f"{prefix}param_groups"], opt)
            dcp.state_dict.set_state_dict(m, opt, model_state_dict=tensors[f"{prefix}model"],
                                          optim_state_dict={"state": tensors[f"{prefix}optimizer"],
                                                            "param_groups": groups},
                                          options=_trained_options())
    except (KeyError, ValueError, RuntimeError) as e:
        raise UsageError(f"{path}: checkpoint does not match this model or optimizer ({_last_line(e)[:160]}); "
                         "resume with the same model and settings") from None
    for prefix in trainer_state.get("fresh_optimizers", []):  # saved before its first step: as it was (save)
        forget_steps(models[prefix][1])
    try:
        state.load_state_dict(trainer_state)
    except UsageError as e:  # the state read and found damaged (a partial run's carried samples)
        raise UsageError(f"{path / 'trainer.pt'}: {e}; {EARLIER}") from None
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise UsageError(f"{path / 'trainer.pt'}: does not fit this run ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120] if str(e) else 'missing state'}); it was saved by "
                         "another model or optimizer, or is damaged") from None
    return step


# how the optimizer runs, not what it has learned: this run's choice stands (a tensor-parallel run steps each tensor
# on its own where a checkpoint from one process used the fused kernel)
_KERNEL_KEYS = ("fused", "foreach", "triton")


def _with_kernels(saved: list[dict], optimizer) -> list[dict]:
    mine = optimizer.param_groups
    return [{**g, **{k: mine[min(i, len(mine) - 1)][k] for k in _KERNEL_KEYS if k in mine[0]}}
            for i, g in enumerate(saved)]


def _trained_state(model, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts of what trains: a LoRA policy's frozen base is model.path's, not saved (also
    under a tied name, which DCP's ignore_frozen_params keeps: it looks the frozen tensors up by their first name)."""
    model_state, optim_state = _dcp().state_dict.get_state_dict(model, optimizer, options=_trained_options())
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_state.items() if k not in frozen}, optim_state


def _prefixed(trained: dict) -> dict:
    """Trained models by their key prefix in a checkpoint: the policy's tensors are "model"/"optimizer", another
    model's "<name>_model"/"<name>_optimizer"."""
    return {("" if name == "policy" else f"{name}_"): pair for name, pair in trained.items()}


class _Refused(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records, torch sizes, dtypes, layouts and memory formats, and nothing else: a
    checkpoint's index cannot run code."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise _Refused(f"it names {module}.{name}")


_SAFE_GLOBALS = {("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                 ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("torch.serialization", "_get_layout")}  # looks a layout up by name


@functools.cache
def _safe_reader_class():
    """DCP's file reader with its index read by _MetadataUnpickler (allowed globals only), made when first needed
    (it subclasses a DCP class: _dcp says why not at import)."""
    dcp = _dcp()

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp.metadata.StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _safe_reader(path: str):
    return _safe_reader_class()(path)


def _last_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__


def save_final(model, tokenizer, out: Path, image_processor=None, *, merged: bool = False) -> None:
    """The trained model as a Hugging Face directory (safetensors, full state dict), written atomically by rank 0,
    with its tokenizer and a vision-language model's image processor (with the run's pixel bounds). With LoRA
    adapters: the adapter alone in PEFT's format, and with `merged` the base with the adapter merged in out/merged/.
    Every rank calls it: a sharded model's tensors are gathered bucket by bucket (only rank 0 keeps them)."""
    lora = has_adapters(model)
    skip = frozenset(name for name in model.state_dict() if not is_adapter(name)) if lora else frozenset()
    full, copies = {}, {}
    for bucket in full_weights(model, skip=skip):
        if dist.is_main():  # tied names share one copy, so save_pretrained sees them tied and writes one
            full.update((name, copies.setdefault(id(t), t.to("cpu", copy=True))) for name, t in bucket)
    if dist.is_main():
        tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        if lora:  # PEFT's files (the experts' adapters in peft's target_parameters layout)
            tmp.mkdir(parents=True)
            save_adapter(adapter_config(model), full.items(), tmp)
            if model.can_generate():  # as transformers' save_pretrained writes beside an adapter
                model.generation_config.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict=full)  # safetensors by default
        tokenizer.save_pretrained(tmp)
        if image_processor is not None:
            image_processor.save_pretrained(tmp)
        if lora and merged:
            _save_merged(tmp, [tokenizer, image_processor], model.dtype)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    dist.barrier()


def _save_merged(adapter_dir: Path, processors: list, dtype: torch.dtype) -> None:
    """The base (model.path, as the adapter names it) with the adapter in `adapter_dir` merged by peft, as a plain
    Hugging Face model in adapter_dir/merged/, with the tokenizer (and image processor) beside it."""
    from peft import PeftConfig, PeftModel

    from evenrl.models.loading import load_policy

    base, _ = load_policy(PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path, dtype=dtype)
    PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().save_pretrained(adapter_dir / "merged")
    for processor in processors:
        if processor is not None:
            processor.save_pretrained(adapter_dir / "merged")
