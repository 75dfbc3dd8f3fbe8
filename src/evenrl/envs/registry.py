"""Environments by name (ENVS) and `resolve`, which turns rollout.env into a class: a built-in name or a user's
"package.module:Name", imported the way rewards are (evenrl.rewards.registry). `evenrl plan` only looks the
module up (`unresolvable`), never imports user code."""

from __future__ import annotations

import importlib

from evenrl.envs.base import Env
from evenrl.envs.builtin import CalculatorEnv, FeedbackEnv
from evenrl.errors import bad, describe_error
from evenrl.rewards.registry import findable

ENVS: dict[str, type[Env]] = {"calculator": CalculatorEnv, "feedback": FeedbackEnv}

ALLOWED = f"a built-in environment ({', '.join(ENVS)}) or 'package.module:Name' (a subclass of evenrl.envs.Env)"


def resolve(spec: str) -> type[Env]:
    """The environment class rollout.env names."""
    if spec in ENVS:
        return ENVS[spec]
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise bad("rollout.env", spec, ALLOWED)
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # a user module can fail to import in any way; report it on one line
        raise bad("rollout.env", spec, f"{ALLOWED}; importing {module_name} failed: {describe_error(e)}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise bad("rollout.env", spec, f"{ALLOWED}; {module_name}.{attr} is not one")
    return obj


def unresolvable(spec: str) -> str | None:
    """Why `resolve` would refuse `spec`, as far as can be told without importing user code; None if it may work."""
    if spec in ENVS:
        return None
    module, sep, attr = spec.partition(":")
    if not (sep and module and attr):
        return "is neither a built-in environment nor 'package.module:Name'"
    return None if findable(module) else f"names module {module!r}, which is not importable here (not on PYTHONPATH?)"
