"""The peers' knowledge as data (peers/data/<peer>.yaml and the key lists beside them) and the one reader of it.

Each table says, for one peer: its versions (and the keys that tell one from another), which checks each version
has, the flags' older spellings (OpenRLHF), the keys that map onto an evenrl field (enumerations value by value,
the peer's own defaults where they differ from evenrl's), and why the rest are not applicable or have no evenrl
equivalent. The translators (verl.py, easyr1.py, trl.py, openrlhf.py) keep what is arithmetic: batch checks and
layouts. `account` then puts every key of the user's file in exactly one place: mapped (beside its evenrl field),
read (the layout and the peer's checks), not applicable, no evenrl equivalent, or unknown to the peer.
A mapping onto an evenrl field or value this evenrl does not have yet is a note naming the key, never an error.
Never imports torch.
"""

from __future__ import annotations

import copy
import functools
import re
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from evenrl.config import RunConfig, flatten, validation_message, with_settings
from evenrl.errors import UsageError

DATA = Path(__file__).parent / "data"
STATUSES = ("mapped", "read", "not_applicable", "no_equivalent", "unknown")


@functools.cache
def table(peer: str) -> dict:
    return yaml.safe_load((DATA / f"{peer}.yaml").read_text(encoding="utf-8"))


@functools.cache
def known_keys(peer: str, version: str) -> frozenset[str]:
    text = (DATA / table(peer)["versions"][version]["keys"]).read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


@functools.cache
def trainer_command(peer: str) -> tuple[re.Pattern, str]:
    """The peer's trainer in a launch script: (a pattern on its module or script, what was looked for in words)."""
    spec = table(peer)["command"]
    return re.compile(spec["pattern"]), spec["looked_for"]


@functools.cache
def accelerate_configs() -> dict:
    """TRL's bundled examples/accelerate_configs: {label, files: {name: settings}}."""
    return yaml.safe_load((DATA / "trl-accelerate-configs.yaml").read_text(encoding="utf-8"))


def base_config(peer: str) -> tuple[str, dict] | None:
    """The peer's bundled base config (EasyR1's examples/config.yaml): (its label, a copy of its settings)."""
    base = table(peer).get("base")
    if not base:
        return None
    return base["label"], copy.deepcopy(_base_settings(base["file"]))


@functools.cache
def _base_settings(name: str) -> dict:
    return yaml.safe_load((DATA / name).read_text(encoding="utf-8"))


def version_label(peer: str, version: str) -> str:
    return table(peer)["versions"][version]["label"]


def version_name(peer: str, version: str) -> str:
    """The release's short name ("verl 0.8.0.dev", "Logic-RL's verl fork")."""
    return version_label(peer, version).split(" (")[0].split(",")[0]


def detect_version(peer: str, keys: set[str], asked: str | None, own: set[str] = frozenset()) -> tuple[str, str]:
    """(version, how it was chosen): --peer-version, else the first version one of whose tell-tale keys (`detect`:
    keys no other version has) the file sets, else the first whose `hints` (its era's spellings, which later
    releases still read) it sets and which knows every one of the file's own keys `own` (a file with a key that
    version lacks is not for it), else the table's default."""
    versions = table(peer)["versions"]
    if asked:
        if asked not in versions:
            raise UsageError(f"--peer-version {asked}: not a {peer} version evenrl knows; allowed: "
                             f"{', '.join(versions)}")
        return asked, "--peer-version"
    for name, v in versions.items():
        hit = next((k for k in v.get("detect", []) if k in keys), None)
        if hit:
            return name, f"detected from {hit}"
    for name, v in versions.items():
        hit = next((k for k in v.get("hints", []) if k in keys), None)
        known = known_keys(peer, name)
        if hit and all(k in known or _prefix_known(k, known) for k in own):
            return name, f"detected from {hit}, with every key of the file one it knows"
    return table(peer)["default_version"], "no key tells the version apart; the current release's rules"


def peer_default(peer: str, version: str, key: str, fallback: Any) -> Any:
    """The peer's default for a key in this version, where the table says it changed between versions."""
    return table(peer).get("defaults", {}).get(key, {}).get(version, fallback)


def check_applies(peer: str, version: str, tag: str) -> bool:
    """A check tagged with a version text applies to the versions the table lists for that text (untagged: all)."""
    listed = table(peer).get("check_versions", {}).get(tag)
    return not tag or listed is None or version in listed


def dealias(peer: str, flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """OpenRLHF's dotted flags to their flat names: (settings by flat name, flat name -> the file's spelling)."""
    aliases = table(peer).get("aliases", {})
    out, spelled = {}, {}
    for key, value in flat.items():
        name = aliases.get(key, key.replace(".", "_").replace("-", "_") if key not in aliases else key)
        out[name] = value
        spelled[name] = key
    return out, spelled


@functools.cache
def _fields() -> frozenset[str]:
    return frozenset(flatten(RunConfig().model_dump(mode="json")))


def _refuse(peer: str, key: str, field: str, value: Any) -> None:
    """A peer value evenrl's field cannot hold on any settings: one line naming the peer's key (exit 2)."""
    try:
        with_settings(RunConfig(), {field: value})
    except ValidationError as e:
        raise UsageError(validation_message(e, f"{peer} {key} -> evenrl")) from None


def _accepts(settings: dict, field: str, value: Any) -> bool:
    """Whether evenrl takes field=value beside the settings mapped so far (some fields depend on others)."""
    try:
        with_settings(RunConfig(), {**settings, field: list(value) if isinstance(value, tuple) else value})
        return True
    except (ValidationError, ValueError, TypeError, UsageError):
        return False


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def apply_maps(peer: str, version: str, src, t) -> None:
    """The table's `map`: each key the file sets (or the peer's default for this version) onto its evenrl field,
    unless the translator already set that field; anything evenrl cannot take is a note naming key and value."""
    for key, spec in table(peer).get("map", {}).items():
        field = spec["to"]
        if field in t.settings:
            if src.given(key) and key not in re.findall(r"[A-Za-z0-9_.+-]+", t.source.get(field, key)):
                t.unused[key] = f"unused: {field} follows {t.source[field]}"  # e.g. a loss mode's own aggregation
            continue
        off = ("when" in spec and not _truthy(src.raw(spec["when"]))) or \
            ("when_not" in spec and _truthy(src.raw(spec["when_not"])))
        if off:
            cond = spec.get("when") or spec["when_not"]
            t.unused[key] = f"unused: {peer} reads it only when {cond} is {'on' if 'when' in spec else 'off'}"
            continue
        present = src.has(key)
        value = src.raw(key) if present else (spec.get("default") or {}).get(version)
        if value is None:
            continue
        shown = f"{key}={_text(value)}" + ("" if present else f" ({version_name(peer, version)}'s default)")
        targets: dict[str, Any] = {}
        if "values" in spec or "notes" in spec:
            v = _enumerated(peer, spec, key, _text(value), shown, t)
            if v is None:
                continue
            targets[field] = spec["values"][v]
            for extra, to in (("level", "algo.importance_level"), ("policy", "algo.policy_loss"),
                              ("aggregation", "algo.loss_aggregation")):
                if v in spec.get(extra, {}):
                    targets[to] = spec[extra][v]
        else:
            value = _coerce(peer, key, field, value)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "min" in spec:
                value = max(value, spec["min"])
            if "evenrl_max" in spec and isinstance(value, (int, float)) and value > spec["evenrl_max"]:
                t.notes.append(f"{shown}: {spec['over_max']}")  # a setting evenrl plans but cannot run yet
                continue
            targets[field] = list(value) if isinstance(value, tuple) else value
        for to, v in targets.items():
            if to not in _fields():
                t.notes.append(f"{shown}: this evenrl has no {to} yet; the plan runs without it")
            elif not _accepts({}, to, v) and not spec.get("values"):
                _refuse(peer, key, to, v)
            elif not _accepts(t.settings, to, v):
                t.notes.append(f"{shown}: evenrl does not take {to}={_text(v)} beside the other settings; the plan "
                               f"keeps {to}'s default")
            else:
                t.set(to, v, key)
                if not present and v != RunConfig().model_dump(mode="json").get(to.split(".")[0], {}).get(
                        to.split(".", 1)[1]):
                    t.notes.append(f"{key} is not set: {_text(value)} is {version_name(peer, version)}'s default, "
                                   f"so {to}={_text(v)}")
        if spec.get("note") and present:
            t.notes.append(f"{shown}: {spec['note']}")


def apply_constants(peer: str, version: str, t) -> None:
    """The table's `constants`: numbers inside the peer's code that evenrl has a field for (TRL's std epsilon),
    set unless the file's keys set that field; a note when it differs from evenrl's default."""
    defaults = RunConfig().model_dump(mode="json")
    for field, spec in table(peer).get("constants", {}).items():
        value = spec["values"].get(version)
        if value is None or field in t.settings or field not in _fields():
            continue
        if any(t.settings.get(k, _default(defaults, k)) != v for k, v in spec.get("when", {}).items()):
            continue
        t.settings[field] = value  # no key of the file says so: listed in the notes, not beside a key
        if value != _default(defaults, field):
            t.notes.append(f"{spec['why']}: {field}={_text(value)}")


def _default(defaults: dict, field: str) -> Any:
    section, name = field.split(".", 1)
    return defaults.get(section, {}).get(name)


def _enumerated(peer: str, spec: dict, key: str, text: str, shown: str, t) -> str | None:
    """The value of an enumeration evenrl maps (a `multi` list: the first such), each other value a note."""
    parts = [p.strip().strip("'\"") for p in text.split(spec["multi"])] if "multi" in spec else [text]
    chosen = None
    for v in parts:
        where = f"{key}={v}" if len(parts) > 1 else shown
        if v in spec.get("notes", {}):
            t.notes.append(f"{where}: {spec['notes'][v]}")
        if v in spec.get("values", {}) and chosen is None:
            chosen = v
        elif v in spec.get("values", {}):
            t.notes.append(f"{where}: evenrl applies one of the listed criteria, {chosen}; not this one too")
        elif v not in spec.get("notes", {}):
            allowed = ", ".join(list(spec.get("values", {})) + list(spec.get("notes", {})))
            t.notes.append(f"{where}: not a value {peer} has ({allowed}); evenrl keeps its default {spec['to']}")
    return chosen


def rejection_options(peer: str) -> dict[str, str]:
    """The peer's rollout-correction rejection options -> evenrl's algo.rejection criteria (the values of the map
    entry whose field is algo.rejection)."""
    return next(dict(spec["values"]) for spec in table(peer)["map"].values() if spec["to"] == "algo.rejection")


def forced_aggregation(peer: str, loss_mode: str) -> str | None:
    """The aggregation the peer's loss mode imposes whatever its aggregation key says (verl's gspo, sapo,
    geo_mean), or None."""
    for spec in table(peer).get("map", {}).values():
        if spec.get("to") == "algo.policy_loss" and "aggregation" in spec:
            return spec["aggregation"].get(loss_mode)
    return None


def _coerce(peer: str, key: str, field: str, value: Any) -> Any:
    """A peer value as the evenrl field's type ("3e-7" from a command line is a number); a wrong one is one line
    naming the peer's key."""
    section, name = field.split(".", 1)
    default = RunConfig().model_dump(mode="json").get(section, {}).get(name)
    try:
        if isinstance(default, bool):
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if not isinstance(value, bool):
                raise ValueError
        elif isinstance(default, (int, float)) and not isinstance(value, bool):
            number = float(value)
            if isinstance(default, int) and not isinstance(default, bool):
                return int(number) if number.is_integer() else number
            return number
    except (TypeError, ValueError):
        raise UsageError(f"{peer} {key}: got {value!r}; need "
                         f"{'true or false' if isinstance(default, bool) else 'a number'}") from None
    return value


def _truthy(v: Any) -> bool:
    return v not in (None, False, 0, "", "false", "False", "0", "none", "None", "null")


def _reason(rules: dict[str, str], key: str) -> str | None:
    for pattern, why in rules.items():
        if fnmatchcase(key, pattern):
            return why
    return None


def account(peer: str, version: str, user: dict[str, Any], spelled: dict[str, str], t, reads: set[str],
            unresolved: dict[str, str], added: set[str] = frozenset()) -> list[dict]:
    """Every key of the user's file, in one place each: {key, value, status, evenrl, why}."""
    tab = table(peer)
    mapped: dict[str, list[str]] = {}
    for f, source in t.source.items():
        for token in re.findall(r"[A-Za-z0-9_.+-]+", source):
            mapped.setdefault(token, []).append(f)
    known = known_keys(peer, version) | {spelled.get(k, k) for k in known_keys(peer, version)}
    rows = []
    for name, value in user.items():
        key = spelled.get(name, name)
        row: dict[str, Any] = {"key": key, "value": value, "status": "", "evenrl": [], "why": ""}
        fields = mapped.get(name, [])
        if name in unresolved:
            row.update(status="no_equivalent", why=f"unresolved: {unresolved[name]}")
        elif fields:
            row.update(status="mapped", evenrl=[f"{f}={_text(t.settings[f])}" for f in fields])
        elif name in t.unused and name not in reads:
            row.update(status="not_applicable", why=t.unused[name])
        elif (why := _reason(tab.get("not_applicable", {}), name) or _reason(tab.get("not_applicable", {}), key)):
            if why.startswith("read") and name not in reads:
                why = f"unused with this file's other settings ({why})"
            row.update(status="read" if name in reads and why.startswith("read") else "not_applicable", why=why)
        elif name in reads:
            noted = any(name in n or key in n for n in t.notes)
            row.update(status="read", why="read (see the notes)" if noted else
                       f"read for the layout and the peer's checks")
        elif (why := _reason(tab.get("no_equivalent", {}), name) or _reason(tab.get("no_equivalent", {}), key)):
            row.update(status="no_equivalent", why=why)
        elif name in known or key in known or _prefix_known(name, known):
            row.update(status="no_equivalent", why="a setting evenrl does not model")
        elif name in added or any(name.startswith(a + ".") for a in added):
            row.update(status="no_equivalent", why=f"added with + (not in {version_name(peer, version)}'s own "
                                                    "config: read by the run's own code, e.g. its reward)")
        else:
            row.update(status="unknown", why=f"not a key of {version_label(peer, version)} (a typo?)")
        rows.append(row)
    return rows


def _prefix_known(key: str, known: frozenset[str]) -> bool:
    """A key inside a free-form mapping the peer declares (e.g. verl's engine_kwargs.vllm.*)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in known for i in range(len(parts) - 1, 0, -1))


def apply_precision(peer: str, src, t) -> None:
    """The table's `precision`: the peer's weights-dtype and optimizer keys read together onto
    model.weights_dtype (the first case whose `when` matches every key: a listed value, `null` for a key the file
    leaves out), with the case's note. Nothing when the file sets none of the keys; a key of the case that the
    file sets is mapped beside the field."""
    cases = table(peer).get("precision") or []
    keys = sorted({k for case in cases for k in case["when"]})
    given = {k: _text(src.raw(k)) for k in keys if src.given(k)}
    if not given or "model.weights_dtype" in t.settings:
        return
    case = next((c for c in cases if all(given.get(k) in [None if v is None else _text(v) for v in allowed]
                                         for k, allowed in c["when"].items())), None)
    if case is None:
        return
    shown = " ".join(f"{k}={v}" for k, v in given.items())
    if "to" in case and _accepts(t.settings, "model.weights_dtype", case["to"]):
        t.set("model.weights_dtype", case["to"], " ".join(k for k in case["when"] if k in given))
    if case.get("note"):
        t.notes.append(f"{shown}: {case['note']}")
