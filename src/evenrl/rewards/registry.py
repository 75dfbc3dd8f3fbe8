"""The built-in rewards by name (REGISTRY) and `resolve`, which turns a config's reward name or a user's
"package.module:function" into the function. Every reward is `fn(completion: str, sample: dict) -> float`; `sample`
is the dataset row (each task module lists the fields it reads). What each built-in reads model output with:
docs/rewards.md.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import signal
import sys
import threading
import time
from typing import Callable

from evenrl.errors import bad, describe_error, one_line
from evenrl.rewards.arithmetic import exact_match_reward
from evenrl.rewards.countdown import countdown_reward
from evenrl.rewards.format import format_reward, strict_format_reward
from evenrl.rewards.knights_knaves import kk_reward
from evenrl.rewards.math import math_reward  # binds evenrl.rewards.math: never `import math` here

RewardFn = Callable[[str, dict], float]

# Importing a user's module (a reward, rollout.env) may take this long before the run stops with a line naming it.
IMPORT_TIMEOUT_S = 60.0

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
    obj = _import(field, spec, module_name, allowed)
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


class _ImportTimeout(BaseException):
    """Raised into an import that ran past IMPORT_TIMEOUT_S; a BaseException so `except Exception` keeps it."""


def _import(field: str, spec: str, module_name: str, allowed: str):
    """The module imported; anything it raises at import, SystemExit and KeyboardInterrupt too (a script that calls
    sys.exit(0) or parses sys.argv must not end `evenrl train` silently or with argparse's usage), is one line
    naming `field` and the module, with the last line the module printed. On the main thread the import is bounded
    by IMPORT_TIMEOUT_S; a timer already running that ends sooner (a worker call's own limit) is left to end it, a
    later one (pytest-timeout, a watchdog) is paused and re-armed afterwards with the time it had left."""
    printed = io.StringIO()
    outer, interval = signal.getitimer(signal.ITIMER_REAL) if hasattr(signal, "getitimer") else (0.0, 0.0)
    timed = (threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
             and not 0 < outer <= IMPORT_TIMEOUT_S)
    previous = signal.signal(signal.SIGALRM, _on_import_alarm) if timed else None
    started = time.monotonic()
    try:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, IMPORT_TIMEOUT_S)
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            module = importlib.import_module(module_name)
    except _ImportTimeout:
        raise bad(field, spec, f"importing {module_name} took longer than {IMPORT_TIMEOUT_S:g} s (does it "
                               f"run something at import?)") from None
    except BaseException as e:  # a user module can fail to import in any way; report it on one line
        if isinstance(e, SystemExit):
            why = f"importing {module_name} called sys.exit({e.code!r}) (a script, not an importable module?)"
        elif isinstance(e, KeyboardInterrupt):
            why = f"importing {module_name} was interrupted (KeyboardInterrupt)"
        else:
            why = f"importing {module_name} failed: {describe_error(e)}"
        said = [line for line in printed.getvalue().splitlines() if line.strip()]
        tail = f"; it printed: {one_line(said[-1], 100)}" if said else ""
        raise bad(field, spec, f"{allowed}; {why}{tail}") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer > 0:
                signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer - (time.monotonic() - started)), interval)
    sys.stderr.write(printed.getvalue())  # what a module that imported fine printed is the user's, not ours
    return module


def _on_import_alarm(signum, frame):
    raise _ImportTimeout


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
