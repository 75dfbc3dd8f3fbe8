"""Hugging Face hub datasets as prompt datasets: `data.path: hiyouga/geometry3k@train` (what EasyR1's and verl's
scripts write), read from the `datasets` library's cache, downloaded by that library where allowed.

    ORG/NAME[:CONFIG][@SPLIT]     hiyouga/geometry3k@train   openai/gsm8k:main@test   (split default: train)

CONFIG names one of a dataset's configurations (the `name` of `datasets.load_dataset(path, name, split=...)`), needed
where a dataset has several (openai/gsm8k: main, socratic); `@` and the train default are EasyR1's. A path that
exists is a path; so is anything ending in .jsonl, .json, .parquet or .arrow.

Cache first: the split's Arrow files are found by `datasets`' own lookup of its cache (HF_DATASETS_CACHE, else
~/.cache/huggingface/datasets; the Cache builder `load_dataset` itself falls back on offline), with no network call,
so a dataset that `load_dataset`, TRL, verl or EasyR1 prepared is found where they put it. `evenrl train` downloads
a dataset that is not there (`fetch`: `datasets.load_dataset`, once, in the launcher, with its progress bars) unless
HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set; `evenrl plan` never downloads and counts rows from the cached
dataset_info.json. Either way a problem is one line naming the id. The rows are then read as every Arrow table is
(evenrl.data.readers), so the trainer and the planner check them alike.

Imports neither torch nor (until a hub id whose directory is in the cache is read) `datasets`; `datasets` itself does not import torch (checked
by tests/test_hub_datasets.py). `datasets` is an extra: pip install -e '.[hub]'.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from evenrl.errors import UsageError, first_line

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")  # org/name, as the hub spells ids
_SPEC = re.compile(rf"(?P<repo>{REPO_ID.pattern})(?::(?P<config>[\w.-]+))?(?:@(?P<split>[\w.-]+))?")
SYNTAX = "ORG/NAME[:CONFIG][@SPLIT]"
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")  # a missing file, not a hub id
DEFAULT_CACHE = "~/.cache/huggingface/datasets"


@dataclass(frozen=True)
class HubDataset:
    repo: str  # org/name
    config: str | None  # one of the dataset's configurations; None: its only one
    split: str

    def __str__(self) -> str:
        return f"{self.repo}{f':{self.config}' if self.config else ''}@{self.split}"

    def load_call(self) -> str:
        """The Python call that puts this split into the cache."""
        name = f", {self.config!r}" if self.config else ""
        return f"datasets.load_dataset({self.repo!r}{name}, split={self.split!r})"


def offline() -> bool:
    """HF_HUB_OFFLINE (or the datasets / transformers variant) set: nothing is downloaded."""
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def parse(path: str) -> HubDataset | None:
    """The hub dataset `path` names, or None where it is a local path (existing, or a file name)."""
    if not path or path.lower().endswith(FILE_SUFFIXES) or Path(path).expanduser().exists():
        return None
    m = _SPEC.fullmatch(path)
    return HubDataset(m["repo"], m["config"], m["split"] or "train") if m else None


def cache_dir() -> str | None:
    """HF_DATASETS_CACHE as it is now (`datasets` reads it once, at import)."""
    return os.environ.get("HF_DATASETS_CACHE") or None


@contextlib.contextmanager
def _quiet():
    """`datasets`' lookup logs a warning per call ("Found the latest cached dataset configuration ..."): not ours."""
    from datasets.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _require_datasets(ds: HubDataset, field: str) -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise UsageError(f"{field}: {str(ds)!r} is a Hugging Face dataset id; reading one needs the datasets library: "
                         "pip install -e '.[hub]' (or a local .jsonl/.parquet file)") from None


def _cache_root() -> Path:
    """Where `datasets` keeps prepared datasets: its config's HF_DATASETS_CACHE, from the same variables."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(cache_dir() or os.path.join(os.path.expanduser(home), "datasets")).expanduser()


def _absent(ds: HubDataset) -> bool:
    """No directory of `ds` in the cache (ORG___NAME, NAME in datasets' snake case), so nothing for `datasets`'
    lookup to find there (it globs under that directory): the answer costs a stat, not an import of `datasets`
    (~1 s of CPU, most of a plan's)."""
    org, name = ds.repo.split("/", 1)
    name = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)).lower()
    return not (_cache_root() / f"{org}___{name}").is_dir()


def _builder(ds: HubDataset, field: str):
    """`datasets`' builder of the latest cached copy of `ds`'s configuration (no network), or None when the cache
    holds none; several cached configurations and no CONFIG is a UsageError naming them."""
    if _absent(ds):
        return None
    _require_datasets(ds, field)
    from datasets.packaged_modules.cache.cache import Cache

    with _quiet():
        try:
            return Cache(cache_dir=cache_dir(), repo_id=ds.repo, dataset_name=ds.repo.split("/")[1],
                         config_name=ds.config, version="auto", hash="auto")
        except ValueError as e:  # "Couldn't find cache for ..." or "There are multiple ... configurations"
            several = re.search(r"configurations in the cache: (.+)", str(e))
            if several:
                names = sorted(several[1].split(", "))
                raise UsageError(f"{field}: {str(ds)!r}: the cache holds several configurations of {ds.repo} "
                                 f"({', '.join(names)}); name one: {ds.repo}:{names[0]}@{ds.split}") from None
            return None
        except (OSError, KeyError):  # a cache entry without its dataset_info.json (or config_name): no copy
            return None


def is_cached(ds: HubDataset, field: str) -> bool:
    """Whether the cache holds a copy of `ds`'s configuration (no network); several and no CONFIG: UsageError."""
    return _builder(ds, field) is not None


def where() -> str:
    return cache_dir() or DEFAULT_CACHE


def _not_cached(ds: HubDataset, field: str) -> UsageError:
    how = ("HF_HUB_OFFLINE is set" if offline() else "`evenrl train` downloads it") + \
        f"; or cache it: python -c \"import datasets; {ds.load_call()}\""
    return UsageError(f"{field}: {str(ds)!r} is neither a local file nor a dataset in the Hugging Face datasets "
                      f"cache ({where()}); {how}")


def _split_info(ds: HubDataset, builder, field: str):
    splits = builder.info.splits or {}
    if ds.split not in splits:
        raise UsageError(f"{field}: {str(ds)!r}: {ds.repo} has no split {ds.split!r} (its splits: "
                         f"{', '.join(sorted(splits)) or 'none recorded'}); e.g. {ds.repo}@{next(iter(splits), 'train')}")
    return splits[ds.split]


def cached_rows(ds: HubDataset) -> int | None:
    """The split's row count from the cached dataset_info.json, or None when it is not cached (or unreadable)."""
    try:
        builder = _builder(ds, "data.path")
        return None if builder is None else _split_info(ds, builder, "data.path").num_examples
    except UsageError:
        return None


def cached_files(ds: HubDataset, field: str) -> list[str]:
    """The split's Arrow files in the cache, in order; not cached is a one-line UsageError saying how to get it."""
    builder = _builder(ds, field)
    if builder is None:
        raise _not_cached(ds, field)
    _split_info(ds, builder, field)
    with _quiet():
        try:
            return [f["filename"] for f in builder.as_dataset(split=ds.split).cache_files]
        except Exception as e:  # a cache entry missing its Arrow files, or files the library cannot map
            raise UsageError(f"{field}: {str(ds)!r}: cannot read its cached copy in {builder.cache_dir} "
                             f"({type(e).__name__}: {first_line(e)})") from None


def fetch(ds: HubDataset, field: str) -> None:
    """`ds` into the cache: nothing when its configuration is there (load_dataset prepares every split at once; a
    split it lacks is cached_files' line), else downloaded and prepared by `datasets.load_dataset` (refused in one
    line when offline or when the hub says no)."""
    if is_cached(ds, field):
        return
    if offline():
        raise _not_cached(ds, field)
    _require_datasets(ds, field)
    import datasets

    print(f"evenrl: {field}: downloading {ds} from the Hugging Face hub (once; then from its cache)", flush=True)
    try:
        datasets.load_dataset(ds.repo, ds.config, split=ds.split, cache_dir=cache_dir())
    except Exception as e:  # no network, no such dataset or split, a config to name, a gated dataset: one line
        text = " ".join(str(e).split())[:200] or type(e).__name__
        raise UsageError(f"{field}: could not download {str(ds)!r} ({type(e).__name__}: {text}); give "
                         "ORG/NAME[:CONFIG][@SPLIT] of a hub dataset, or a local .jsonl/.parquet file") from None


def fetch_datasets(cfg) -> None:
    """Every hub dataset `cfg` (a RunConfig) reads into the cache: data.path and eval.path."""
    for field, path in (("data.path", cfg.data.path), ("eval.path", cfg.eval.path)):
        if (ds := parse(path)) is not None:
            fetch(ds, field)
