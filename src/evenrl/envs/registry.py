"""Environments by name (ENVS) and `resolve`, which turns rollout.env into a class: a built-in name or a user's
"package.module:Name", imported the way rewards are (evenrl.rewards.registry). `evenrl plan` only looks the
module up (`unresolvable`), never imports user code."""

from __future__ import annotations

from evenrl.envs.base import Env
from evenrl.envs.builtin import CalculatorEnv, FeedbackEnv
from evenrl.errors import bad
from evenrl.rewards.registry import findable, load_named

ENVS: dict[str, type[Env]] = {"calculator": CalculatorEnv, "feedback": FeedbackEnv}

ALLOWED = f"a built-in environment ({', '.join(ENVS)}) or 'package.module:Name' (a subclass of evenrl.envs.Env)"


def resolve(spec: str) -> type[Env]:
    """The environment class rollout.env names."""
    if spec in ENVS:
        return ENVS[spec]
    obj = load_named("rollout.env", spec, ALLOWED)
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise bad("rollout.env", spec, f"{ALLOWED}; {spec.replace(':', '.')} is not one")
    return obj


def unresolvable(spec: str) -> str | None:
    """Why `resolve` would refuse `spec`, as far as can be told without importing user code; None if it may work."""
    if spec in ENVS:
        return None
    module, sep, attr = spec.partition(":")
    if not (sep and module and attr):
        return "is neither a built-in environment nor 'package.module:Name'"
    return None if findable(module) else f"names module {module!r}, which is not importable here (not on PYTHONPATH?)"
