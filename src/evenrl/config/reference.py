"""The config reference: every field with its default and description, as commented YAML. docs/config.md is this
output (`python -m evenrl.config` prints it; tests/test_docs.py keeps the page current).
"""

from __future__ import annotations

import typing

import yaml
from pydantic import BaseModel

from evenrl.config.schema import RunConfig

def describe(model: type[BaseModel] = RunConfig, indent: int = 0) -> str:
    """Every field with its default and description, as commented YAML (docs/config.md is this output). The fields
    of a list's entries (rewards.functions) follow the list as comments."""
    lines = []
    pad = "  " * indent
    for name, field in model.model_fields.items():
        ann = field.annotation
        section = _model_in(ann)
        if section is not None and typing.get_origin(ann) is not list:
            lines.append(f"{pad}{name}:  # {field.description}")
            lines.append(describe(section, indent + 1))
            continue
        if field.is_required():
            lines.append(f"{pad}{name}: (required)  # {field.description}")
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        if isinstance(default, list):
            default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
        value = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"{pad}{name}: {value}  # {field.description}")
        if section is not None:  # a list of entries: their fields, commented
            lines.append(f"{pad}  # each entry:")
            lines += [f"{pad}  #   {line}" for line in describe(section).splitlines()]
    return "\n".join(lines)


def _model_in(ann) -> type[BaseModel] | None:
    """The section type of a field: the model itself, the model of an optional one, or a list's entry model."""
    for arg in (ann, *typing.get_args(ann)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
