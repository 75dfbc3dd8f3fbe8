"""Loading a run config: one YAML file plus dotted overrides, validated against the schema; every failure is one
line naming the file or field, the value and what is allowed. Also the resolved config as dumped into every run
directory. Pure Python: never imports torch.

    cfg = load_config("examples/demo.yaml", ["data.prompts_per_step=512", "rollout.samples_per_prompt=8"])
"""

from __future__ import annotations

import difflib
import os
import typing

import yaml
from pydantic import BaseModel, ValidationError

from evenrl.config.overrides import apply_overrides
from evenrl.config.schema import RunConfig
from evenrl.config.yaml_reader import read_yaml
from evenrl.errors import UsageError


def validation_message(err: ValidationError, source: str = "config", overridden: tuple[str, ...] = ()) -> str:
    """pydantic's report as one line per problem: where it comes from, the field, the value, what is allowed. A
    problem in a field that an override in `overridden` (dotted keys) set is the command line's, not `source`'s.
    Several problems: a first line counting them, then one line each."""
    lines = [f"{_source(e['loc'], source, overridden)}: {_problem(e)}" for e in err.errors()]
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} problems in the config:\n" + "\n".join(f"  {line}" for line in lines)


def _problem(error: dict) -> str:
    loc = ".".join(str(x) for x in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{loc}: unknown key; {_known_keys(error['loc'])}"
    shown = repr(error.get("input"))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{loc}: got {shown}; {error['msg'].lower()}"


def _source(loc: tuple, source: str, overridden: tuple[str, ...]) -> str:
    """'command line' when an override set this field, a section above it or a field inside it; else `source`."""
    key = ".".join(str(x) for x in loc)
    hit = any(key == k or key.startswith(k + ".") or (key and k.startswith(key + ".")) for k in overridden)
    return "command line" if hit else source


# The allowed keys are listed in the message while they fit in this many characters; a larger section (rollout has
# ~40 keys) is pointed to in the config reference instead, so the line stays short.
LISTED_KEYS_CHARS = 100


def _known_keys(loc: tuple) -> str:
    """What an unknown key at `loc` should have been: the closest key of its section (difflib) and where the
    reference lists them all, or with none close the section's keys (listed when short, else that pointer)."""
    keys = _allowed_keys(loc)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if close:
        return f"did you mean {'.'.join([*(str(x) for x in loc[:-1]), close[0]])}? (all keys: docs/config.md)"
    listed = ", ".join(keys)
    section = ".".join(str(x) for x in loc[:-1] if not isinstance(x, int))
    return f"allowed here: {listed}" if len(listed) <= LISTED_KEYS_CHARS else f"all keys of {section}: docs/config.md"


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
    data = apply_overrides(data, list(overrides or []), words=True)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        # without a file every key is the command line's (or a caller's): one source, "config"
        overridden = tuple(o.partition("=")[0].strip() for o in overrides or ()) if path is not None else ()
        raise UsageError(validation_message(e, str(path) if path else "config", overridden)) from None


def config_to_yaml(cfg: RunConfig) -> str:
    """The resolved config, as dumped into every run directory."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
