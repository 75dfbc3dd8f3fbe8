"""The built-in rewards by name (REGISTRY) and `resolve`, which turns a config's reward name or a user's
"package.module:function" into the function. Every reward is `fn(completion: str, sample: dict) -> float`; `sample`
is the dataset row (each task module lists the fields it reads). What each built-in reads model output with:
docs/rewards.md.
"""

from __future__ import annotations

import importlib
from typing import Callable

from evenrl.errors import bad, describe_error
from evenrl.rewards.arithmetic import exact_match_reward
from evenrl.rewards.countdown import countdown_reward
from evenrl.rewards.format import format_reward, strict_format_reward
from evenrl.rewards.knights_knaves import kk_reward
from evenrl.rewards.math import math_reward  # binds evenrl.rewards.math: never `import math` here

RewardFn = Callable[[str, dict], float]

REGISTRY: dict[str, RewardFn] = {
    "math": math_reward,
    "format": format_reward,
    "format_strict": strict_format_reward,
    "countdown": countdown_reward,
    "knights_knaves": kk_reward,
    "exact_match": exact_match_reward,
}


def resolve(spec: str) -> RewardFn:
    """A built-in reward by name (a key of REGISTRY) or a user function given as "package.module:function"."""
    allowed = f"a built-in reward ({', '.join(REGISTRY)}) or 'package.module:function'"
    if not isinstance(spec, str):
        raise bad("reward", spec, allowed)
    if spec in REGISTRY:
        return REGISTRY[spec]
    obj = load_named("reward", spec, allowed)
    if not callable(obj):
        module_name, _, attr = spec.partition(":")
        raise bad("reward", spec, f"{allowed}; {module_name} has no function {attr}")
    return obj


def load_named(field: str, spec: str, allowed: str):
    """What "package.module:name" names (None when the module has none): the module imported, `name` looked up in
    it (dots for nested names). Another form of spec, or a module that fails to import, is a one-line UsageError
    about `field`: rewards and environments are resolved by this one rule."""
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise bad(field, spec, allowed)
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # a user module can fail to import in any way; report it on one line
        raise bad(field, spec, f"{allowed}; importing {module_name} failed: {describe_error(e)}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


def findable(module: str) -> bool:
    """Whether `module`'s top-level package can be found, without importing anything of it (`evenrl plan`: user code
    may be slow or heavy to import)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def reward_name(fn) -> str:
    """The name a reward goes by in stats: its REGISTRY key for a built-in, else its qualified name."""
    for name, builtin in REGISTRY.items():
        if fn is builtin:
            return name
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
