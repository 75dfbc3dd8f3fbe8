"""Dotted overrides (`data.prompts_per_step=64`) and dotted settings applied to a config, and the reverse:
nested sections flattened to dotted keys. Pure Python: never imports torch.
"""

from __future__ import annotations

from typing import Any

import yaml

from evenrl.config.schema import RunConfig
from evenrl.config.yaml_reader import MAX_YAML_BYTES, parse_yaml
from evenrl.errors import UsageError


def _parse_value(text: str, source: str = "override", words: bool = False) -> Any:
    """Override values are YAML scalars/lists: `8`, `1e-6`, `true`, `[1, 2]`, `null`, `my text`; text that is
    not YAML stays text, and nothing (`eval.path=`) is the empty string, as a shell's `key=''` arrives. Read with
    the same bounds as a config file; `words`: yes/no/on/off stay words, as in evenrl's config files (parse_yaml)."""
    if not text.strip():
        return text
    if len(text) > MAX_YAML_BYTES:
        raise UsageError(f"{source}: a value of {len(text):,} characters; the limit is {MAX_YAML_BYTES:,}")
    try:
        return parse_yaml(text, source, words=words)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str], *, words: bool = False) -> dict:
    """Apply `a.b.c=value` overrides to a nested dict (a copy). Unknown keys are caught by validation. `words`:
    yes/no/on/off are kept as written (evenrl's own settings, parse_yaml's words=True); without it they are YAML
    1.1's booleans (a peer's settings, as its own loader reads them)."""
    out = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise UsageError(f"override {item!r}: expected key=value, e.g. data.prompts_per_step=64")
        key, _, raw = item.partition("=")
        if not all(key.strip().split(".")):
            raise UsageError(f"override {item!r}: empty key segment; expected e.g. rollout.samples_per_prompt=8")
        set_dotted(out, key.strip(), _parse_value(raw, f"override {key.strip()}", words), what=f"override {key}")
    return out


def set_dotted(data: dict, key: str, value: Any, *, what: str = "") -> None:
    """data["a"]["b"]["c"] = value for key "a.b.c", in place; missing sections are created (validation catches
    unknown keys). A value where a section should be is a UsageError, named by `what` (default: the key)."""
    *path, last = key.split(".")
    node = data
    for part in path:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise UsageError(f"{what or key}: {part} is a value, not a section")
        node = nxt
    node[last] = value


def with_settings(cfg: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """A validated copy of cfg with dotted settings ({"data.prompts_per_step": 64}) applied; cfg is unchanged.
    Only the fields cfg was given are copied (the rest come back as defaults), so the copy still tells a given
    field from a default one (rule_lora's lora-off reads model_fields_set)."""
    data = cfg.model_dump(exclude_unset=True)
    for key, value in settings.items():
        set_dotted(data, key, value)
    return RunConfig.model_validate(data)


def flatten(data: dict, prefix: str = "", sep: str = ".") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested sections to joined keys, leaves (lists included) as they are."""
    out = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}{sep}", sep))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d
