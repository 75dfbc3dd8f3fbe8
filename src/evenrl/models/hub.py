"""Hugging Face hub ids as model paths (`model.path: Qwen/Qwen2.5-0.5B-Instruct`), resolved to a local directory
before anything reads them: from the local Hugging Face cache first (huggingface_hub's own lookup, so a model that
transformers, TRL or `hf download` fetched is found where they put it), else downloaded by huggingface_hub with its
progress bars when downloading is allowed (`evenrl train`; not with HF_HUB_OFFLINE=1), else one line naming the
command that downloads it (`evenrl plan`, which never downloads, and offline runs). Torch-free: the planner resolves
the same way.

A path that exists is a path; `org/name` that does not exist is a hub id. Only what evenrl reads is downloaded:
config and tokenizer files, safetensors weights, chat templates.
"""

from __future__ import annotations

import os
from pathlib import Path

from evenrl.data.hub import REPO_ID  # hub ids are spelled alike for models and datasets
from evenrl.errors import UsageError

FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def is_hub_id(path: str) -> bool:
    return bool(path) and not Path(path).expanduser().exists() and REPO_ID.fullmatch(path) is not None


def _cache_dir() -> str | None:
    """HF_HUB_CACHE as it is now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_CACHE") or None


def _offline() -> bool:
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE",
                                                                                   "TRANSFORMERS_OFFLINE"))


def cached(repo_id: str) -> str | None:
    """The local snapshot of `repo_id`'s main revision in the Hugging Face cache, or None."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, cache_dir=_cache_dir(), local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or a cache entry without its snapshot: not here
        return None


def resolve(path: str, field: str, *, download: bool) -> str:
    """`path` itself, or the local directory of the hub id it is (cached, else downloaded when `download`)."""
    if not is_hub_id(path):
        return path
    local = cached(path)
    if local is not None:
        return local
    command = f"hf download {path}"
    if not download or _offline():
        why = "evenrl plan never downloads" if not download else "HF_HUB_OFFLINE is set"
        raise UsageError(f"{field}: {path!r} is neither a local directory nor in the Hugging Face cache "
                         f"({_cache_dir() or '~/.cache/huggingface/hub'}); {why}: download it with `{command}`")
    from huggingface_hub import snapshot_download

    print(f"evenrl: {field}: downloading {path} from the Hugging Face hub (once; then from its cache)", flush=True)
    try:
        return snapshot_download(path, cache_dir=_cache_dir(), allow_patterns=FILES)
    except Exception as e:  # no network, no such repo, a gated model without a token: the hub's reason, one line
        text = " ".join(str(e).split())[:200] or type(e).__name__
        raise UsageError(f"{field}: could not download {path!r} ({type(e).__name__}: {text}); download it with "
                         f"`{command}` (gated models need `hf auth login`), or give a local directory") from None


def resolve_models(cfg, *, download: bool):
    """`cfg` (a RunConfig) with every model path that is a hub id replaced by its local directory: model.path,
    critic.path, and each reward model's and judge's model in rewards.functions."""
    data = cfg.model_dump()
    data["model"]["path"] = resolve(data["model"]["path"], "model.path", download=download)
    data["critic"]["path"] = resolve(data["critic"]["path"], "critic.path", download=download)
    for i, spec in enumerate(data["rewards"]["functions"]):
        if spec.get("model"):
            spec["model"] = resolve(spec["model"], f"rewards.functions.{i}.model", download=download)
        if spec.get("judge") and spec["judge"].get("model"):
            spec["judge"]["model"] = resolve(spec["judge"]["model"], f"rewards.functions.{i}.judge.model",
                                             download=download)
    return cfg if data == cfg.model_dump() else type(cfg).model_validate(data)
