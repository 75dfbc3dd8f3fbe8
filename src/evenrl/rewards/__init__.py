"""Reward functions: the built-in registry, `resolve` for user rewards, and `score_all`, the safe runner.

Every reward is `fn(completion: str, sample: dict) -> float`; `sample` is the dataset row (each task module lists
the fields it reads, e.g. "answer" for math, "numbers"/"target" for countdown, "solution" for knights_knaves).
No reward evaluates model output as code.

How `score_all` keeps reward code from stopping training
--------------------------------------------------------
A reward call that raises, returns something that is not a finite real number, or runs past `timeout_s` scores 0
for that completion and is counted in the stats.  Time limits:

* isolate=True (default): calls run in a small pool of persistent worker processes (`WORKERS` of them, started
  on first use as fresh interpreters that import only evenrl.rewards and the reward's own module).  Inside a
  worker each call runs under an ITIMER_REAL/SIGALRM limit, which interrupts Python loops, sleeps and sympy; the
  parent also kills a worker that has not answered within timeout_s + grace (code stuck in C, such as
  `sum(range(10**13))`, which no signal interrupts, or a reward that swallows BaseException), counts the call as a
  timeout and gives the rest of that worker's calls to a fresh one.  A worker that crashes (segfault, os._exit) is
  replaced the same way.  Threads were rejected: a stuck thread cannot be killed.
* isolate=False: calls run inline in the calling thread under the same SIGALRM limit; cheaper, but nothing
  rescues a call stuck in C.  Signals need the main thread, so off the main thread this falls back to the pool.
Measured on 2 shared CPU cores, 128 short completions x 1 cheap reward: ~0.2 ms inline, ~5 ms through the warm
pool; starting the pool costs ~0.1 s plus whatever the rewards import (math-verify/sympy: ~1 s per worker).
Rewards go to workers by reference, so they must be module-level functions (what `resolve` returns); lambdas,
closures and functions of the __main__ script run inline on the main thread instead.

Why not pebble's ProcessPool (the well-kept library for this): it schedules one future per call, so a step's
hundreds of cheap calls pay one round trip each instead of one per worker; its timeout kills the worker process,
where a SIGALRM inside the worker ends a Python-level overrun and keeps the warm worker (re-importing sympy costs
~1 s); and its workers start from the parent's interpreter state instead of a fresh one that imports only the
reward's module. The pool below is the part of it that those three points need.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import multiprocessing
import multiprocessing.connection
import numbers
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from math import inf, isfinite, nan
from typing import Callable

from evenrl.errors import UsageError, bad
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

# Size of the worker pool; read when the pool (re)starts.
WORKERS = max(1, min(4, os.cpu_count() or 1))
# A worker gets this long to start and import the reward functions before its jobs are failed.
LOAD_TIMEOUT_S = 60.0

FAILURE_KINDS = ("raised", "bad_value", "timeout")


def resolve(spec: str) -> RewardFn:
    """A built-in reward by name (a key of REGISTRY) or a user function given as "package.module:function"."""
    allowed = f"a built-in reward ({', '.join(REGISTRY)}) or 'package.module:function'"
    if not isinstance(spec, str):
        raise bad("reward", spec, allowed)
    if spec in REGISTRY:
        return REGISTRY[spec]
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise bad("reward", spec, allowed)
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # a user module can fail to import in any way; report it on one line
        raise bad("reward", spec, f"{allowed}; importing {module_name} failed: {_describe(e)}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise bad("reward", spec, f"{allowed}; {module_name} has no function {attr}")
    return obj


def score_all(
    fns_with_weights: list[tuple[RewardFn, float]],
    completions: list[str],
    samples: list[dict],
    timeout_s: float = 10.0,
    *,
    isolate: bool = True,
) -> tuple[list[float], dict]:
    """Weighted sum of rewards per completion: scores[i] = sum_k w_k * fn_k(completions[i], samples[i]).

    A failed call contributes 0.  stats:
      "failures", "raised", "bad_value", "timeout": failed calls in total and by kind (ints);
      "by_reward": {name: {"mean": raw mean over completions, failures as 0; "raised", "bad_value", "timeout";
                   "first_error": the first failure's one-line message or None}};
      "seconds": wall time; "isolated": whether worker processes were used.
    """
    if len(completions) != len(samples):
        raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and isfinite(timeout_s)):
        raise bad("reward timeout_s", timeout_s, "a finite number of seconds > 0")
    start = time.perf_counter()
    fns = [fn for fn, _ in fns_with_weights]
    n = len(completions)
    jobs = [(k * n + i, k, c, s) for k in range(len(fns)) for i, (c, s) in enumerate(zip(completions, samples))]
    main_thread = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")

    blobs = [_pickle_by_reference(fn) for fn in fns] if (isolate or not main_thread) else [None] * len(fns)
    pooled = [job for job in jobs if blobs[job[1]] is not None]
    inline = [job for job in jobs if blobs[job[1]] is None]
    if inline and not main_thread:
        names = sorted({_name(fns[k]) for _, k, _, _ in inline})
        raise UsageError(f"reward: {', '.join(names)} cannot be sent to a worker process and score_all is not on "
                         "the main thread; define rewards at module level")
    results: dict[int, tuple[str, object]] = {}
    if pooled:
        results.update(_pool().run(blobs, pooled, timeout_s))
    if inline:
        results.update(_run_inline(fns, inline, timeout_s))
    return _summarise(fns_with_weights, n, results, time.perf_counter() - start, bool(pooled))


# ---------------------------------------------------------------------------------------------------------------------
# One guarded call (used inline and inside workers)
# ---------------------------------------------------------------------------------------------------------------------


class _Timeout(BaseException):
    """Raised into a reward call by SIGALRM; a BaseException so a reward's `except Exception:` cannot swallow it."""


_alarm_armed = False


def _on_alarm(signum, frame):
    if _alarm_armed:  # a late signal after the call finished must not hit our own bookkeeping
        raise _Timeout


def _call(fn: RewardFn, completion, sample, timeout_s: float) -> tuple[str, object]:
    """Run one reward call under an ITIMER_REAL limit (main thread, SIGALRM handler installed) -> (kind, value)."""
    global _alarm_armed
    try:
        try:
            _alarm_armed = True
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            value = fn(completion, sample)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _alarm_armed = False
    except _Timeout:
        return "timeout", f"took longer than {timeout_s:g} s"
    except (Exception, SystemExit) as e:  # SystemExit too: a reward calling sys.exit() must not end training
        return "raised", _describe(e)
    if isinstance(value, numbers.Real):
        try:
            value = float(value)
        except (OverflowError, TypeError, ValueError):
            value = nan
        if isfinite(value):
            return "ok", value
    return "bad_value", f"returned {_short_repr(value)}"


def _run_inline(fns, jobs, timeout_s) -> dict[int, tuple[str, object]]:
    # Someone else's ITIMER_REAL (pytest-timeout, a watchdog) is paused while ours runs and re-armed afterwards
    # with the time it had left, so it fires late by at most this batch's duration instead of never.
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        return {job_id: _call(fns[k], c, s, timeout_s) for job_id, k, c, s in jobs}
    finally:
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:
            left = max(1e-3, outer_delay - (time.monotonic() - started))
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


# ---------------------------------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------------------------------


def _worker_main(conn) -> None:
    """Worker loop: receive (pickled fns, jobs, timeout_s); reply "loaded", then one (job_id, kind, value) per job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the trainer, which kills us
    signal.signal(signal.SIGALRM, _on_alarm)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        blobs, jobs, timeout_s = message
        fns = []
        for blob in blobs:
            try:
                fns.append(pickle.loads(blob) if blob is not None else None)
            except Exception as e:
                fns.append(_Unloadable(f"cannot load the reward in a worker process: {_describe(e)}"))
        conn.send("loaded")
        for job_id, k, completion, sample in jobs:
            fn = fns[k]
            result = ("raised", fn.message) if isinstance(fn, _Unloadable) else _call(fn, completion, sample, timeout_s)
            conn.send((job_id, *result))


class _Unloadable:
    def __init__(self, message: str):
        self.message = message


# The worker is a fresh interpreter that imports only evenrl.rewards: multiprocessing's "spawn" would re-run the
# parent's __main__ script (disastrous without an `if __name__ == "__main__"` guard), and fork is unsafe in a
# process holding CUDA or OpenMP threads.
_WORKER_CODE = (
    "import sys; from multiprocessing.connection import Connection; from evenrl.rewards import _worker_main; "
    "_worker_main(Connection(int(sys.argv[1])))"
)


class _Worker:
    def __init__(self):
        self.conn, child = multiprocessing.Pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, str(child.fileno())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env,
        )
        child.close()
        self.pending: collections.deque = collections.deque()
        self.loaded = False
        self.deadline = inf

    def submit(self, blobs, jobs, timeout_s) -> None:
        self.pending = collections.deque(jobs)
        self.loaded = False
        self.deadline = time.monotonic() + LOAD_TIMEOUT_S
        # A large batch fills the pipe before a fresh worker reads it; sending from a thread keeps the parent's
        # deadline loop running even if that worker never comes up.
        threading.Thread(target=self._send, args=((blobs, list(jobs), timeout_s),), daemon=True).start()

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except Exception:  # the worker died or was killed mid-send; the parent's loop has already dealt with it
            pass

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class _Pool:
    def __init__(self):
        self.workers: list[_Worker | None] = []
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def run(self, blobs, jobs, timeout_s) -> dict[int, tuple[str, object]]:
        # The parent's limit is a backstop for calls the worker's own SIGALRM cannot stop; leave that one room.
        hard_limit = timeout_s + max(0.5, 0.5 * timeout_s)
        results: dict[int, tuple[str, object]] = {}
        with self.lock:
            try:
                self._run(blobs, jobs, timeout_s, hard_limit, results)
            except BaseException:
                self.close()  # e.g. Ctrl-C: workers may still be busy with this batch; never hand them another
                raise
        return results

    def _run(self, blobs, jobs, timeout_s, hard_limit, results) -> None:
        """Deal jobs to the workers, collect one answer per job, replace workers that die or overrun."""
        if len(self.workers) != WORKERS:
            self.close()
            self.workers = [None] * WORKERS
        for slot in range(WORKERS):
            share = jobs[slot::WORKERS]  # interleaved, so one slow reward's jobs spread over all workers
            if share:
                self._submit(slot, blobs, share, timeout_s)
        busy = [w for w in self.workers if w is not None and w.pending]
        while busy:
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            for conn in multiprocessing.connection.wait([w.conn for w in busy], wait_s):
                worker = next(w for w in busy if w.conn is conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._replace(worker, blobs, timeout_s, results, "raised",
                                  f"reward worker died (exit code {_exit_code(worker.proc)})")
                    continue
                if message == "loaded":
                    worker.loaded = True
                else:
                    job_id, kind, value = message
                    results[job_id] = (kind, value)
                    worker.pending.popleft()
                worker.deadline = time.monotonic() + hard_limit
            now = time.monotonic()
            for worker in busy:
                if worker in self.workers and worker.pending and now > worker.deadline:
                    limit = hard_limit if worker.loaded else LOAD_TIMEOUT_S
                    self._replace(worker, blobs, timeout_s, results, "timeout",
                                  f"no answer within {limit:g} s; worker killed")
            busy = [w for w in self.workers if w is not None and w.pending]

    def _submit(self, slot, blobs, jobs, timeout_s) -> None:
        worker = self.workers[slot]
        if worker is None or worker.proc.poll() is not None:
            worker = self.workers[slot] = _Worker()
        worker.submit(blobs, jobs, timeout_s)

    def _replace(self, worker, blobs, timeout_s, results, kind, message) -> None:
        """Kill a stuck or dead worker, fail its current job (all of them if it never loaded), resubmit the rest."""
        worker.kill()
        slot = self.workers.index(worker)
        self.workers[slot] = None
        if not worker.loaded:
            for job in worker.pending:
                results[job[0]] = ("raised", f"reward worker failed to start: {message}")
            return
        results[worker.pending.popleft()[0]] = (kind, message)
        if worker.pending:
            self._submit(slot, blobs, list(worker.pending), timeout_s)

    def close(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.kill()
        self.workers = []


def _exit_code(proc: subprocess.Popen) -> int | None:
    try:
        return proc.wait(timeout=1.0)  # the pipe closes a moment before the process is reaped
    except subprocess.TimeoutExpired:
        return None


_POOL: _Pool | None = None


def _pool() -> _Pool:
    global _POOL
    if _POOL is None or _POOL.pid != os.getpid():  # a forked child must not share its parent's pipes
        _POOL = _Pool()
        atexit.register(_POOL.close)
    return _POOL


# ---------------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------------


def _pickle_by_reference(fn) -> bytes | None:
    """Pickled fn if a worker could import it by name; None for lambdas, closures, other local objects and
    anything defined in the __main__ script (a worker does not run the parent's script)."""
    if getattr(fn, "__module__", None) == "__main__":
        return None
    try:
        return pickle.dumps(fn)
    except Exception:
        return None


def _summarise(fns_with_weights, n, results, seconds, isolated) -> tuple[list[float], dict]:
    scores = [0.0] * n
    stats: dict = {kind: 0 for kind in FAILURE_KINDS}
    stats["by_reward"] = {}
    for k, (fn, weight) in enumerate(fns_with_weights):
        name = _name(fn)
        while name in stats["by_reward"]:  # the same function listed twice
            name += "'"
        entry = {"mean": 0.0, **{kind: 0 for kind in FAILURE_KINDS}, "first_error": None}
        total = 0.0
        for i in range(n):
            kind, value = results[k * n + i]
            if kind == "ok":
                total += value
                scores[i] += weight * value
            else:
                entry[kind] += 1
                stats[kind] += 1
                entry["first_error"] = entry["first_error"] or value
        entry["mean"] = total / n if n else 0.0
        stats["by_reward"][name] = entry
    stats["failures"] = sum(stats[kind] for kind in FAILURE_KINDS)
    stats["seconds"] = seconds
    stats["isolated"] = isolated
    return scores, stats


def _name(fn) -> str:
    for name, builtin in REGISTRY.items():
        if fn is builtin:
            return name
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _describe(e: BaseException) -> str:
    try:
        return _one_line(f"{type(e).__name__}: {e}")
    except Exception:  # a user exception whose __str__ fails
        return type(e).__name__


def _short_repr(value) -> str:
    try:
        return _one_line(repr(value))
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text[: 2 * limit].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
