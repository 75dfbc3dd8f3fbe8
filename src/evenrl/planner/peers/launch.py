"""A launch script's (or argument file's) trainer arguments as the peer's settings: verl/EasyR1 `key=value`
arguments layered on the base config they name (EasyR1's bundled examples/config.yaml when the script's is not
here), OpenRLHF/TRL `--flags` (TRL's `--config recipe.yaml` under them); values that need the caller's shell
variables are kept apart as unresolved. Never runs anything; never imports torch.
"""

from __future__ import annotations

import copy
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evenrl.config import apply_overrides, flatten, parse_yaml, read_text_file
from evenrl.errors import UsageError
from evenrl.planner.peers.script import Launch, read_script
from evenrl.planner.peers.shell import MAX_CHARS
from evenrl.planner.peers.tables import accelerate_configs, base_config, trainer_command

NAMES = {"verl": "verl", "easyr1": "EasyR1", "trl": "TRL", "openrlhf": "OpenRLHF", "slime": "slime"}


@dataclass
class Loaded:
    """The peer's settings as its trainer would receive them, and where they came from."""
    data: dict
    notes: list[str] = field(default_factory=list)  # how the file was read (branches, base config, $@)
    launch: Launch | None = None  # a launch script's command and layout
    unresolved: dict[str, str] = field(default_factory=dict)  # key -> its value that needs the caller's variables
    base: str = ""  # the base config the settings were layered on, as the file names it (verl's --config-name)
    added: set[str] = field(default_factory=set)  # keys given with Hydra's + (new to the peer's own config)
    base_keys: set[str] = field(default_factory=set)  # keys that came from the base config, not the file itself


def from_script(framework: str, name: str, path: Path, text: str) -> Loaded:
    """A launch script (or a bare list of flags / key=value overrides) as the trainer's settings. A script that runs
    commands but not this peer's trainer is bad input (one line naming what was looked for), never a plan built
    from the peer's defaults and whatever flags its other commands had."""
    wanted, looked_for = trainer_command(framework)
    launch = read_script(text, str(path), wanted)
    if not launch.program and launch.commands:
        raise UsageError(_no_trainer(framework, name, path, launch, looked_for))
    args = launch.args if launch.program else bare_tokens(text)
    notes = ([f"read the launch script's command `{launch.program}` (not run)"] if launch.program else []) \
        + launch.notes
    if framework in ("verl", "easyr1"):
        data, more, unresolved, base, added, base_keys = _hydra_args(framework, path, args)
    else:
        data, unresolved = parse_tokens(args), {}
        for key, value in list(data.items()):
            if isinstance(value, str) and "$" in value:
                unresolved[key.replace("-", "_")] = value
                del data[key]
        more, base, added, base_keys = _trl_base(path, data) if framework == "trl" else [], "", set(), set()
        if framework == "trl" and launch.launcher_config:
            more.append(_accelerate_config(path, launch))
    if not data and not launch.program:
        raise UsageError(f"{path}: no {name} settings found (no trainer command, no flags); expected "
                         f"the {name} config or its launch script")
    return Loaded(data, notes + more, launch, unresolved, base, added, base_keys)


def _no_trainer(framework: str, name: str, path: Path, launch, looked_for: str) -> str:
    """The one line for a script without this peer's trainer: what was looked for, and whose trainer it runs."""
    for program in launch.ran:
        last = program.split()[-1] if program.split() else ""
        other = next((p for p in NAMES if p != framework and trainer_command(p)[0].search(last)), None)
        if other:
            return (f"{path}: runs `{program}`, {NAMES[other]}'s trainer, not {name}'s ({looked_for}); "
                    f"read it with --from {other}")
    ran = ", ".join(dict.fromkeys(launch.ran or launch.commands))
    return (f"{path}: no {name} trainer command in the script (looked for {looked_for}; it runs {ran}); give the "
            f"script that starts the trainer, or the trainer's config")


def bare_tokens(text: str) -> list[str]:
    if len(text) > MAX_CHARS:  # shlex's time grows with the square of a word's length
        raise UsageError(f"{len(text):,} characters of arguments; at most {MAX_CHARS:,} are read")
    try:
        return [t for t in shlex.split(text.replace("\\\n", " "), comments=True) if t.strip()]
    except ValueError as e:
        raise UsageError(f"a line of the file cannot be read as arguments ({e}); fix the quoting") from None


def _hydra_args(framework: str, path: Path, args: list[str]) -> tuple[dict, list[str], dict, str, set, set]:
    """verl/EasyR1 `key=value` arguments, layered on the base config they name: (settings, notes, unresolved,
    base config name, the keys added with a leading +, the keys only the base config sets)."""
    data: dict = {}
    notes: list[str] = []
    unresolved: dict[str, str] = {}
    overrides, base, i, added, base_keys = [], "", 0, set(), set()
    while i < len(args):
        arg, i = args[i], i + 1
        key, eq, value = arg.partition("=")
        if key in ("--config-name", "--config-path", "-cn", "-cp"):
            if not eq and i < len(args):
                value, i = args[i], i + 1
            if key in ("--config-name", "-cn"):
                base = value.removesuffix(".yaml")
            continue
        if not eq or key.startswith("-"):
            continue
        if key.startswith("~"):
            notes.append(f"{arg}: deletes a key of the base config; the peer's default stands in for it")
            continue
        if key.startswith("+"):
            key = key.lstrip("+")
            added.add(key)
        if "$" in value:
            unresolved[key] = value
            continue
        if framework == "easyr1" and key == "config":
            data = _easyr1_base(path, value, notes)
            base_keys.update(flatten(data))
            continue
        overrides.append(f"{key}={value}")
    if base in ("ppo_trainer", "ppo_megatron_trainer"):
        notes.append(f"--config-name {base}: overrides layered on verl's own {base}.yaml (its keys are bundled "
                     "with their version)")
    elif base:
        notes.append(f"--config-name {base}: a base config of the script's own (not bundled); keys it sets are not "
                     "seen here, verl's defaults stand in for them")
    if framework == "easyr1" and not any(o.startswith("config=") for o in args):
        notes.append("no config=FILE: overrides layered on EasyR1's own defaults")
    base_keys -= {o.partition("=")[0] for o in overrides}  # the file's own value for a base key: the file's
    return apply_overrides(data, overrides), notes, unresolved, base, added, base_keys


def _easyr1_base(path: Path, name: str, notes: list[str]) -> dict:
    """EasyR1's config=FILE: the file next to the script's repository if it is here, else the bundled copy."""
    for root in (Path.cwd(), *path.resolve().parents):
        candidate = root / name
        if candidate.is_file():
            data = parse_yaml(read_text_file(candidate, "the EasyR1 base config", "YAML"), str(candidate))
            notes.append(f"config={name}: overrides layered on {candidate}")
            return data if isinstance(data, dict) else {}
    bundled = base_config("easyr1")
    if bundled and name.endswith("examples/config.yaml"):
        notes.append(f"config={name} is not here: overrides layered on {bundled[0]} (bundled)")
        return bundled[1]
    notes.append(f"config={name} is not here: overrides layered on EasyR1's own defaults")
    return {}


def _trl_base(path: Path, data: dict) -> list[str]:
    """`--config recipe.yaml` of a TRL/open-r1 command: its settings under the command line's flags."""
    name = data.pop("config", None)
    if not isinstance(name, str):
        return []
    for root in (Path.cwd(), *path.resolve().parents):
        candidate = root / name
        if candidate.is_file():
            base = parse_yaml(read_text_file(candidate, "the TRL config", "YAML"), str(candidate))
            if isinstance(base, dict):
                for key, value in base.items():
                    data.setdefault(key, value)
            return [f"--config {name}: read {candidate}, the command line's flags over it"]
    return [f"--config {name} is not here: planned from the command line's flags and TRL's defaults"]


def _accelerate_config(path: Path, launch) -> str:
    """accelerate's --config_file into launch.launcher: the file where it is on this machine, else TRL's bundled
    copy of one of its examples/accelerate_configs; the note says which, or that neither is here."""
    name = launch.launcher_config
    for root in (Path.cwd(), *path.resolve().parents):
        candidate = root / name
        if candidate.is_file():
            data = parse_yaml(read_text_file(candidate, "the accelerate config", "YAML"), str(candidate))
            launch.launcher = data if isinstance(data, dict) else {}
            return f"accelerate --config_file {name}: read {candidate}"
    bundled = accelerate_configs()
    if "accelerate_configs/" in name and Path(name).name in bundled["files"]:
        launch.launcher = copy.deepcopy(bundled["files"][Path(name).name])
        return f"accelerate --config_file {name} is not here: read as {bundled['label']} (bundled)"
    return (f"accelerate --config_file {name} is not here: its sharding, offload and layout are unknown; planned "
            "without them (give the file, or --nnodes / --nproc-per-node)")


def parse_tokens(tokens: list[str]) -> dict:
    """argparse-style `--key value`, `--key=value`, `--flag`, `--key v1 v2` tokens as a mapping."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("--"):
            continue  # the command itself (python3 -m ...)
        key, eq, value = tok[2:].partition("=")
        values = [value]
        if not eq:
            values = []
            while i < len(tokens) and not tokens[i].startswith("--"):  # nargs=2 flags take two
                values.append(tokens[i])
                i += 1
        parsed = [_flag_value(v, key) for v in values]
        out[key.replace("-", "_")] = True if not parsed else parsed[0] if len(parsed) == 1 else parsed
    return out


def _flag_value(text: str, key: str) -> Any:
    try:
        return parse_yaml(text, f"--{key}") if text else True
    except yaml.YAMLError:
        return text  # not YAML: the flag's text as is
