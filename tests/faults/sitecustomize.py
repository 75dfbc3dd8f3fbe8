"""Faults injected into `evenrl train` processes from the test side: evenrl's own code has no test hooks. A test
that wants one runs evenrl with this directory on PYTHONPATH (tests/e2e.py: `fault_env`) and one of:

  EVENRL_FAULT_CRASH_AT_STEP=N           a training rank exits (code 17) at the start of RL step N, on a worker's
                                         first attempt only, so that an elastic restart recovers
  EVENRL_FAULT_SIGNAL_AT_STEP=N:SIG:WHO  at the start of RL step N rank 0 sends signal SIG (INT, TERM) to itself
                                         (WHO=self) or to its parent, the launcher (WHO=parent): Ctrl-C mid-run
  EVENRL_FAULT_ROLLOUT_STALLS_AT_STEP=N  a reserved rollout rank hangs before generating step N
  EVENRL_FAULT_TRACKER_FAILS_AT_STEP=N   every experiment tracker raises when it is given step N's metrics
  EVENRL_FAULT_DEVICE_MEMORY_GIB=R:G     rank R reports a device of G GiB at start (a card with less memory)
  EVENRL_FAULT_SLOW_RANK=R:F             rank R computes F times slower: each training forward and each
                                         generation call sleeps (F - 1) times its own duration afterwards (a slower
                                         card; on a shared 2-core machine, where every process already runs on one
                                         thread, fewer threads cannot make one rank reliably slower)

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


def _signal_at(spec):
    n, sig, who = spec.split(":")

    def wrap(rl_step):
        def rl_step_signalled(step, *args, **kwargs):
            if step == int(n) and os.environ.get("RANK", "0") == "0":
                import signal

                os.kill(os.getpid() if who == "self" else _launcher(), getattr(signal, f"SIG{sig}"))
            return rl_step(step, *args, **kwargs)
        return rl_step_signalled
    return wrap


def _launcher():
    """The launcher's process: this worker's parent, or its grandparent where the parent is the launcher's fork
    server (multiprocessing's, evenrl.train.launch)."""
    pid = os.getppid()
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"multiprocessing.forkserver" in f.read():
            with open(f"/proc/{pid}/stat") as g:
                pid = int(g.read().rsplit(")", 1)[1].split()[1])
    return pid


def _stall_at(n):
    def wrap(generate_and_send):
        def stall(cfg, engine, prompt_tokens, step, *args, **kwargs):
            if step == n:
                # SIGTERM's default action, not evenrl's stop-after-the-step handler (which a sleep outlasts): the
                # trainers see the same silence, and torch's agent ends the hung rank once they have failed instead
                # of waiting its fixed 30 s (PContext.close) for it, a wait that is torch's and not under test
                import signal

                signal.signal(signal.SIGTERM, signal.SIG_DFL)
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


def _rank_spec(name):
    """V when this process is rank R of an R:V variable, else None. Read when the wrapped function is called, not
    when this module runs: a worker forked from the launcher's fork server learns its rank after that."""
    rank, _, value = os.environ.get(name, "").partition(":")
    return float(value) if rank and int(rank) == int(os.environ.get("RANK", "0")) else None


def _reports_memory(name):
    def wrap(probe_device):
        def smaller(*args, **kwargs):
            import dataclasses

            found, gib = probe_device(*args, **kwargs), _rank_spec(name)
            return found if gib is None else dataclasses.replace(found, memory_gib=gib)
        return smaller
    return wrap


def _slowed(name):
    def slow(fn):
        def slower(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            factor = _rank_spec(name)
            if factor is not None:
                time.sleep((factor - 1) * (time.perf_counter() - t0))
            return out
        return slower
    return slow


def _slow_generation(name):
    def wrap(engine_class):
        engine_class.generate = _slowed(name)(engine_class.generate)
        return engine_class
    return wrap


_PATCHES = {}  # module -> (attribute, wrapper)
if os.environ.get("EVENRL_FAULT_CRASH_AT_STEP"):
    _PATCHES["evenrl.train.loop"] = ("rl_step", _crash_at(int(os.environ["EVENRL_FAULT_CRASH_AT_STEP"])))
if os.environ.get("EVENRL_FAULT_SIGNAL_AT_STEP"):
    _PATCHES["evenrl.train.loop"] = ("rl_step", _signal_at(os.environ["EVENRL_FAULT_SIGNAL_AT_STEP"]))
if os.environ.get("EVENRL_FAULT_ROLLOUT_STALLS_AT_STEP"):
    _PATCHES["evenrl.train.rollout_rank"] = ("generate_and_send",
                                             _stall_at(int(os.environ["EVENRL_FAULT_ROLLOUT_STALLS_AT_STEP"])))
if os.environ.get("EVENRL_FAULT_TRACKER_FAILS_AT_STEP"):
    _PATCHES["evenrl.train.trackers"] = ("start_tracker",
                                         _tracker_fails_at(int(os.environ["EVENRL_FAULT_TRACKER_FAILS_AT_STEP"])))
if os.environ.get("EVENRL_FAULT_DEVICE_MEMORY_GIB"):
    _PATCHES["evenrl.distributed.ops"] = ("probe_device", _reports_memory("EVENRL_FAULT_DEVICE_MEMORY_GIB"))
if os.environ.get("EVENRL_FAULT_SLOW_RANK"):
    _PATCHES["evenrl.models.forward"] = ("response_logits", _slowed("EVENRL_FAULT_SLOW_RANK"))
    _PATCHES["evenrl.engines.hf"] = ("HFEngine", _slow_generation("EVENRL_FAULT_SLOW_RANK"))


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


if _PATCHES:
    sys.meta_path.insert(0, _Patcher())
