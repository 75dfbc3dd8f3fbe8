"""Faults injected into `evenrl train` processes from the test side: evenrl's own code has no test hooks. A test
that wants one runs evenrl with this directory on PYTHONPATH (tests/e2e.py: `fault_env`) and one of:

  EVENRL_FAULT_CRASH_AT_STEP=N           a training rank exits (code 17) at the start of RL step N, on a worker's
                                         first attempt only, so that an elastic restart recovers
  EVENRL_FAULT_ROLLOUT_STALLS_AT_STEP=N  a reserved rollout rank hangs before generating step N
  EVENRL_FAULT_TRACKER_FAILS_AT_STEP=N   every experiment tracker raises when it is given step N's metrics

Python imports `sitecustomize` at start-up; this one installs an import hook that wraps the named function of the
evenrl module when that module is first imported (the loop's step, the rollout rank's generation).
"""

import importlib.abc
import importlib.util
import os
import sys
import time


def _crash_at(n):
    def wrap(rl_step):
        def rl_step_or_crash(step, *args, **kwargs):
            if step == n and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os._exit(17)
            return rl_step(step, *args, **kwargs)
        return rl_step_or_crash
    return wrap


def _stall_at(n):
    def wrap(generate_and_send):
        def stall(cfg, engine, prompt_tokens, step, *args, **kwargs):
            if step == n:
                time.sleep(3600)
            return generate_and_send(cfg, engine, prompt_tokens, step, *args, **kwargs)
        return stall
    return wrap


def _tracker_fails_at(n):
    def wrap(start_tracker):
        def start_failing(name, *args, **kwargs):
            tracker = start_tracker(name, *args, **kwargs)
            log = tracker.log

            def log_or_fail(step, values):
                if step >= n:
                    raise ConnectionError(f"tracker server went away at step {step} (injected)")
                return log(step, values)
            tracker.log = log_or_fail
            return tracker
        return start_failing
    return wrap


_PATCHES = {}  # module -> (attribute, wrapper)
if os.environ.get("EVENRL_FAULT_CRASH_AT_STEP"):
    _PATCHES["evenrl.train.loop"] = ("rl_step", _crash_at(int(os.environ["EVENRL_FAULT_CRASH_AT_STEP"])))
if os.environ.get("EVENRL_FAULT_ROLLOUT_STALLS_AT_STEP"):
    _PATCHES["evenrl.train.rollout_rank"] = ("generate_and_send",
                                             _stall_at(int(os.environ["EVENRL_FAULT_ROLLOUT_STALLS_AT_STEP"])))


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)  # find the real module, then wrap its loader
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        self.real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        self.real.exec_module(module)
        attr, wrap = _PATCHES[module.__name__]
        setattr(module, attr, wrap(getattr(module, attr)))


if os.environ.get("EVENRL_FAULT_TRACKER_FAILS_AT_STEP"):
    _PATCHES["evenrl.train.trackers"] = ("start_tracker",
                                         _tracker_fails_at(int(os.environ["EVENRL_FAULT_TRACKER_FAILS_AT_STEP"])))


if _PATCHES:
    sys.meta_path.insert(0, _Patcher())
