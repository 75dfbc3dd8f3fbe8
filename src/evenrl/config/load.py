"""Loading a run config: one YAML file plus dotted overrides, validated against the schema; every failure is one
line naming the file or field, the value and what is allowed. Also the resolved config as dumped into every run
directory. Pure Python: never imports torch.

    cfg = load_config("examples/demo.yaml", ["data.prompts_per_step=512", "rollout.samples_per_prompt=8"])
"""

from __future__ import annotations

import os
import typing

import yaml
from pydantic import BaseModel, ValidationError

from evenrl.config.overrides import apply_overrides
from evenrl.config.schema import RunConfig
from evenrl.config.yaml_reader import read_yaml
from evenrl.errors import UsageError


def validation_message(err: ValidationError, source: str = "config") -> str:
    """Turn pydantic's multi-line report into one line: field, value, what is allowed (+ how many more)."""
    errors = err.errors()
    first = errors[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        msg = f"{loc}: unknown key; allowed here: {', '.join(_allowed_keys(first['loc']))}"
    else:
        shown = repr(first.get("input"))
        if len(shown) > 60:
            shown = shown[:57] + "..."
        msg = f"{loc}: got {shown}; {first['msg'].lower()}"
    more = len(errors) - 1
    if more:
        msg += f" (and {more} more problem{'s' if more > 1 else ''})"
    return f"{source}: {msg}"


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys of the section an unknown key sits in; list items (`functions.0`) step into the item type."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if typing.get_origin(ann) is list:
            ann = typing.get_args(ann)[0]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            break
    return sorted(model.model_fields)


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a RunConfig from a YAML file (or defaults when path is None) plus dotted overrides."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UsageError(validation_message(e, str(path) if path else "config")) from None


def config_to_yaml(cfg: RunConfig) -> str:
    """The resolved config, as dumped into every run directory."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
