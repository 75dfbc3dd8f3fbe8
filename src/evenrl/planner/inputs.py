"""The planner's rules on a run's inputs, read as `evenrl train` reads them: the dataset (its first rows, every
column), the model's files, the trackers' clients. Each is a `Plan -> list[Finding]` listed in
evenrl.planner.rules.RULES. Pure Python: never imports torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from evenrl.config import RunConfig
from evenrl.data import hub
from evenrl.data.readers import Fields, read_rows
from evenrl.errors import UsageError
from evenrl.models.files import LEAN_ARCHS, check_tokenizer_files, check_weights, no_config_fix, read_model_config
from evenrl.planner.text import plural
from evenrl.planner.types import Finding, Plan


def rule_data(p: Plan) -> list[Finding]:
    d = p.config.data
    if not d.path:
        return [Finding("warning", "data-path", "data.path is empty: no prompts to train on",
                        "data.path=FILE.jsonl (or .parquet, a dataset directory, or a hub dataset ORG/NAME@SPLIT)")]
    out = []  # every problem at once: a bad data.path does not hide a bad eval.path
    if missing := not_here(d.path, "data.path"):
        out.append(Finding("error", "data-path", *missing))
    elif p.dataset_rows == 0:
        out.append(Finding("error", "data-path", f"data.path {d.path!r} has no rows", "use a non-empty dataset"))
    elif problem := dataset_problem(p.config, d.path, "data.path"):
        out.append(Finding("error", "data-file", *problem))
    elif p.dataset_rows is not None and p.dataset_rows < d.prompts_per_step:
        out.append(Finding("warning", "prompts-exceed-dataset",
                           f"{plural(d.prompts_per_step, 'prompt')} per step from a dataset of "
                           f"{plural(p.dataset_rows, 'row')}: every step repeats prompts",
                           f"data.prompts_per_step={p.dataset_rows}"))
    e = p.config.eval.path
    if e and (missing := not_here(e, "eval.path")):
        out.append(Finding("error", "eval-path", missing[0], missing[1] + "; or eval.path=''"))
    elif e and (problem := dataset_problem(p.config, e, "eval.path")):
        out.append(Finding("error", "eval-file", problem[0], problem[1] + "; or eval.path=''"))
    return out


# How much of a dataset the plan reads: the rows evenrl train would refuse are usually near the top (a wrong
# field name, a header line); the trainer reads the rest, before it writes anything.
PLAN_DATA_BYTES = 16 * 1024**2  # of each .jsonl file
PLAN_DATA_ROWS = 1000  # of each parquet / Arrow table, after its schema
PLAN_IMAGE_ROWS = 64  # rows whose images are decoded (a Geometry3K image takes milliseconds)
_DATA_FIX = ("fix the file (evenrl train reads it the same way); or point {key} at another .jsonl/.parquet file "
             "or dataset directory, or set data.prompt_field / data.answer_field to its columns")


def not_here(path: str, key: str) -> tuple[str, str] | None:
    """(Why evenrl train would not find the dataset `key` names, its fix), or None: a local path that does not exist,
    or a hub dataset id the `datasets` cache does not hold (the plan never downloads; evenrl train does)."""
    ds = hub.parse(path)
    if ds is None:
        return None if Path(path).expanduser().exists() else (
            f"{key} {path!r} does not exist", f"point {key} at a local .jsonl/.parquet file or dataset directory, "
                                              f"or a hub dataset {hub.SYNTAX}")
    try:
        if not hub.is_cached(ds, key):
            return (f"{key} {path!r} is not in the Hugging Face datasets cache ({hub.where()}); evenrl plan never "
                    "downloads", f"`evenrl train` downloads it (unless HF_HUB_OFFLINE is set); or python -c "
                                 f"\"import datasets; {ds.load_call()}\"")
        hub.cached_files(ds, key)
    except UsageError as e:  # several cached configurations and none named, a split it does not have
        return str(e), f"{key}={hub.SYNTAX} naming a configuration and split the cache holds"
    return None


def dataset_problem(cfg: RunConfig, path: str, key: str) -> tuple[str, str] | None:
    """(What evenrl train would refuse in the dataset at `path`, its fix) or None: its first rows, every column."""
    try:
        fields = Fields(cfg.data.prompt_field, cfg.data.answer_field, tuple(cfg.data.extra_fields),
                        cfg.data.image_key or None, cfg.data.max_images_per_prompt)
        read_rows(str(Path(path).expanduser()), fields, max_bytes=PLAN_DATA_BYTES, max_rows=PLAN_DATA_ROWS,
                  image_rows=PLAN_IMAGE_ROWS)
    except UsageError as e:  # an image's own fix (evenrl.data.images.ImageError), else the file's
        return str(e), getattr(e, "fix", None) or _DATA_FIX.format(key=key)
    return None


def rule_model(p: Plan) -> list[Finding]:
    m = p.config.model
    path = Path(m.path).expanduser() if m.path else None
    if path is not None and not path.is_dir():
        return [Finding("error", "model-path", f"model.path {m.path!r} is not a local directory",
                        "a local Hugging Face model directory, or a hub id (org/name, e.g. "
                        "Qwen/Qwen2.5-0.5B-Instruct)")]
    if path is not None and not (path / "config.json").is_file():
        return [Finding("error", "model-path", f"model.path {m.path!r} has no config.json; {no_config_fix(path)}",
                        "point model.path at a Hugging Face model directory (config.json, weights, tokenizer)")]
    out = []
    if path is not None:  # what load_policy checks before transformers sees the directory
        out += _decoder_findings(p.config, str(path))
        for rule, check, fix in (
                ("model-config", read_model_config, "point model.path at a decoder-only Hugging Face model"),
                ("model-tokenizer", check_tokenizer_files, "save the tokenizer into model.path "
                                                           "(tokenizer.save_pretrained(model.path))"),
                ("model-weights", check_weights, "re-download the model, or save it again with save_pretrained")):
            try:
                check(str(path))
            except UsageError as e:
                out.append(Finding("error", rule, str(e), fix))
    if p.dims and p.dims.max_positions and p.sample_tokens > p.dims.max_positions:
        field = "max_trajectory_tokens" if p.config.multi_turn() else "max_new_tokens"
        out.append(Finding("warning", "max-positions",
                           f"max_prompt_tokens + {field} = {p.sample_tokens:,} exceeds the model's "
                           f"max_position_embeddings {p.dims.max_positions:,}",
                           f"rollout.{field}={max(1, p.dims.max_positions - p.config.data.max_prompt_tokens)}"))
    return out


def _decoder_findings(c: RunConfig, path: str) -> list[Finding]:
    r = c.rollout
    if r.engine != "hf" or r.decoder not in ("lean", "static"):
        return []
    try:
        archs = read_model_config(path).get("architectures") or []
    except UsageError:
        return []  # model-config says what is wrong with it
    if any(a in LEAN_ARCHS for a in archs):
        return []
    return [Finding("error", "rollout-decoder", f"rollout.decoder={r.decoder} runs {', '.join(LEAN_ARCHS)}; "
                    f"{path}/config.json names {archs}", "rollout.decoder=auto")]


def rule_trackers(p: Plan) -> list[Finding]:
    """Trackers whose client is not installed: the run would stop at its start (evenrl.train.trackers)."""
    log, out = p.config.log, []
    need = {"wandb": ["wandb"], "mlflow": ["mlflow"] + ([] if log.mlflow.tracking_uri else ["sqlalchemy", "alembic"])}
    for name in log.trackers:
        missing = [m for m in need.get(name, []) if importlib.util.find_spec(m) is None]
        if missing:
            why = " (the local SQLite store of an empty log.mlflow.tracking_uri)" if "mlflow" not in missing else ""
            out.append(Finding("error", "tracker-missing", f"log.trackers names {name}, but {', '.join(missing)} "
                               f"{'is' if len(missing) == 1 else 'are'} not installed here{why}",
                               f"pip install -e '.[trackers]'; or leave {name} out of log.trackers"))
    return out
