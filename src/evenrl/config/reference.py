"""The config reference: every field with its default and description, as commented YAML. docs/config.md is this
output (`python -m evenrl.config` prints it; tests/test_docs.py keeps the page current).
"""

from __future__ import annotations

import yaml
from pydantic import BaseModel

from evenrl.config.schema import RunConfig

def describe(model: type[BaseModel] = RunConfig, indent: int = 0) -> str:
    """Every field with its default and description, as commented YAML (docs/config.md is this output)."""
    lines = []
    pad = "  " * indent
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.append(f"{pad}{name}:  # {field.description}")
            lines.append(describe(ann, indent + 1))
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        if isinstance(default, list):
            default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
        value = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"{pad}{name}: {value}  # {field.description}")
    return "\n".join(lines)
