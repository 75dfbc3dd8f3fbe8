"""Reward functions: the built-in registry, `resolve` for user rewards, and `score_all`, the safe runner.

Every reward is `fn(completion: str, sample: dict) -> float`; `sample` is the dataset row (each task module lists
the fields it reads, e.g. "answer" for math, "numbers"/"target" for countdown, "solution" for knights_knaves).

What reads model output, and with what
--------------------------------------
Completions are untrusted text. No built-in reward passes them to eval, exec or compile itself; they are read so:
* exact_match: str.strip and ==.  format: str.find for the tags (linear time).
* knights_knaves: the last <answer> (str.find), then one regular expression built from the puzzle's names
  (re.escape'd): `\\b(name|...)\\s+is\\s+an?\\s+(knight|knave)s?\\b`, case-insensitive.
* countdown: the last <answer>, at most 200 characters, goes to Python's `ast.parse(mode="eval")`: parsed only,
  never compiled or run; a tree with anything but int literals, + - * /, unary minus/plus and parentheses is
  rejected, and a small walker computes the value over exact fractions.
* math: the final answer is found with linear scans (last \\boxed{}, else <answer>, else the last number); one of
  at most 512 characters then goes to math-verify: `parse` reads LaTeX with latex2sympy2_extended (an ANTLR
  grammar that builds sympy objects) and plain expressions with sympy's `parse_expr(evaluate=False)`, which
  rewrites the text as Python and runs it with eval(); math-verify's pattern lets only digits, '.', whitespace and
  + - * × ÷ / ^ ( ) through to it, so no name, call or attribute can be reached. `verify` then compares the sympy
  objects (simplification, numeric evaluation), which can take unbounded time and memory (e.g. 9^{9^{9}}).
* a user reward (`package.module:function`): whatever its code does.

How `score_all` contains reward calls
-------------------------------------
A call that raises, returns something that is not a finite real number, runs past `timeout_s` of wall-clock time,
uses more than `cpu_time_limit_s` of CPU time or allocates past `memory_limit_mib` fails: it contributes 0 for
its completion, is counted in the stats by kind (FAILURE_KINDS) and flags its completion in stats["failed"] (the
trainer then scores the sample 0, or masks it out of learning: rewards.on_failure).  This guards training against
accidents (output that sends a parser into exponential time or memory, a buggy reward); it is not a sandbox: a
reward runs as the trainer's user, with its files and network.

* isolate=True (default): calls run in a small pool of persistent worker processes (`WORKERS` of them, started
  on first use as fresh interpreters that import only evenrl.rewards and the reward's own module).  Inside a
  worker every call runs under
  - a wall-clock limit, ITIMER_REAL/SIGALRM, which interrupts Python loops, sleeps and sympy;
  - a CPU-time limit, ITIMER_PROF/SIGPROF: cpu_time_limit_s seconds of the worker's CPU time (user + system, all
    its threads) from the start of the call. It stops what the wall clock misses: a reward burning several cores
    at once (threads, BLAS) for less than timeout_s, or any call when cpu_time_limit_s is below timeout_s. Not
    RLIMIT_CPU, which counts whole seconds since the process started: a per-call cap set as "used so far + cap",
    rounded up, checked against the kernel's tick-sampled clock (not getrusage's), failed 27 of 40,000 calls of
    ~50 us each with a 0.01 s cap; ITIMER_PROF is relative, failed none, and stops a spin loop within 4 ms of it;
  - a memory cap, RLIMIT_DATA = memory_limit_mib on the worker process as a whole (its heap and every private
    anonymous mapping: Python objects, numpy arrays, sympy's integers), set before the reward's module is loaded.
    An allocation past it raises MemoryError in the call that made it (kind "memory"; the worker lives on and
    frees it). A reward that catches MemoryError itself scores what it then returns (math-verify's parse and verify do).
    Not RLIMIT_AS: that counts reserved address space, not memory. glibc reserves 64 MiB per malloc arena (up to
    8 per core) and torch maps ~0.7 GiB on import; measured on 2 cores, 16 idle threads made 1.2 GiB of address
    space for 0.2 GiB of data, so on a many-core node a library that starts a thread per core fails under a
    2 GiB RLIMIT_AS while using little memory. RLIMIT_DATA does not count shared or file-backed mappings.
  The parent kills a worker that has not answered within timeout_s + grace (code stuck in C, such as
  `sum(range(10**13))`, which no signal interrupts, or a reward that swallows BaseException), counts the call as a
  timeout and gives the rest of that worker's calls to a fresh one.  A worker that dies (segfault, os._exit, the
  kernel's OOM killer) is replaced the same way; its call counts as "raised".
  Threads were rejected: a stuck thread cannot be killed.
* isolate=False: calls run inline in the calling thread under the same wall-clock limit only; cheaper, but nothing
  rescues a call stuck in C, and neither cap applies: the memory cap would cap the trainer itself (model, optimizer,
  CUDA), and the process's CPU time includes the trainer's other threads.  Signals need the main thread, so off the
  main thread this falls back to the pool.
Measured on 2 shared CPU cores, 128 short completions x 1 cheap reward: ~0.4 ms inline, ~4 ms through the warm
pool; the CPU-time limit adds ~1 us per call (two setitimer), the memory cap ~3 us per batch. Starting the
pool costs ~0.1 s plus whatever the rewards import (math-verify/sympy: ~1 s per worker).
Rewards go to workers by reference, so they must be module-level functions (what `resolve` returns); lambdas,
closures and functions of the __main__ script run inline on the main thread instead (wall-clock limit only).

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
import resource
import signal
import subprocess
import sys
import threading
import time
from math import inf, isfinite, nan
from typing import Callable, NamedTuple

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

# How a call can fail: raised an exception (or the worker crashed), returned a non-number, ran past the wall-clock
# limit, allocated past the worker's memory cap, used more CPU time than the per-call cap.
FAILURE_KINDS = ("raised", "bad_value", "timeout", "memory", "cpu")
# The memory cap is RLIMIT_DATA, not RLIMIT_AS: see the module docstring.
_MEMORY_RLIMIT = resource.RLIMIT_DATA


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
    memory_limit_mib: int = 0,
    cpu_time_limit_s: float | None = None,
) -> tuple[list[float], dict]:
    """Weighted sum of rewards per completion: scores[i] = sum_k w_k * fn_k(completions[i], samples[i]).

    Limits per call: `timeout_s` of wall-clock time (always), `cpu_time_limit_s` of CPU time (None: timeout_s) and
    a `memory_limit_mib` cap on the worker process (0: none); the last two hold only in worker processes, never
    for calls run inline in the caller (isolate=False, or a reward that cannot be sent to a worker).

    A failed call contributes 0.  stats:
      "failures", "raised", "bad_value", "timeout", "memory", "cpu": failed calls in total and by kind (ints);
      "failed": per completion, whether any of its calls failed (list of bool);
      "by_reward": {name: {"mean": raw mean over completions, failures as 0; one count per failure kind;
                   "first_error": the first failure's one-line message or None}};
      "seconds": wall time; "isolated": whether worker processes were used.
    """
    if len(completions) != len(samples):
        raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and isfinite(timeout_s)):
        raise bad("reward timeout_s", timeout_s, "a finite number of seconds > 0")
    if cpu_time_limit_s is None:
        cpu_time_limit_s = timeout_s
    if not (isinstance(cpu_time_limit_s, (int, float)) and cpu_time_limit_s > 0 and isfinite(cpu_time_limit_s)):
        raise bad("reward cpu_time_limit_s", cpu_time_limit_s, "a finite number of seconds > 0")
    if not (isinstance(memory_limit_mib, int) and memory_limit_mib >= 0):
        raise bad("reward memory_limit_mib", memory_limit_mib, "an integer number of MiB >= 0 (0: no cap)")
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
        results.update(_pool().run(blobs, pooled, _Limits(timeout_s, cpu_time_limit_s, memory_limit_mib)))
    if inline:
        results.update(_run_inline(fns, inline, timeout_s))
    return _summarise(fns_with_weights, n, results, time.perf_counter() - start, bool(pooled))


class _Limits(NamedTuple):
    timeout_s: float          # wall clock, per call
    cpu_s: float              # CPU time, per call (worker only)
    memory_mib: int           # the worker's data segment; 0: no cap (worker only)


# ---------------------------------------------------------------------------------------------------------------------
# One guarded call (used inline and inside workers)
# ---------------------------------------------------------------------------------------------------------------------


class _Timeout(BaseException):
    """Raised into a reward call by SIGALRM; a BaseException so a reward's `except Exception:` cannot swallow it."""


class _CpuTime(BaseException):
    """Raised into a reward call by SIGPROF (its CPU-time limit ran out); a BaseException too."""


_alarm_armed = False


def _on_alarm(signum, frame):
    if _alarm_armed:  # a late signal after the call finished must not hit our own bookkeeping
        raise _Timeout


def _on_cpu_limit(signum, frame):
    if _alarm_armed:
        raise _CpuTime


def _call(fn: RewardFn, completion, sample, timeout_s: float, cpu_s: float | None = None) -> tuple[str, object]:
    """Run one reward call under an ITIMER_REAL limit (main thread, SIGALRM handler installed) -> (kind, value).

    With cpu_s (worker processes only, SIGPROF handler installed) also under an ITIMER_PROF limit: cpu_s seconds of
    the process's CPU time (user + system, all threads) from the start of the call."""
    global _alarm_armed
    try:
        try:
            _alarm_armed = True
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            if cpu_s is not None:
                signal.setitimer(signal.ITIMER_PROF, cpu_s)
            value = fn(completion, sample)
        finally:
            _alarm_armed = False  # first: a signal handled during the lines below must not raise
            signal.setitimer(signal.ITIMER_REAL, 0)
            if cpu_s is not None:
                signal.setitimer(signal.ITIMER_PROF, 0)
    except _Timeout:
        return "timeout", f"took longer than {timeout_s:g} s"
    except _CpuTime:
        return "cpu", f"used more than {cpu_s:g} s of CPU time"
    except MemoryError as e:
        return "memory", f"ran out of memory ({_describe(e)})"
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


def _set_memory_cap(mib: int) -> None:
    """The worker's data segment (heap, anonymous private mappings) capped at `mib` MiB, 0: back to the hard limit.
    An allocation past it fails with MemoryError inside the call that asked for it."""
    _, hard = resource.getrlimit(_MEMORY_RLIMIT)
    soft = hard if mib == 0 else mib * 1024 * 1024
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(_MEMORY_RLIMIT, (soft, hard))


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
    """Worker loop: receive (pickled fns, jobs, limits); reply "loaded", then one (job_id, kind, value) per job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the trainer, which kills us
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGPROF, _on_cpu_limit)  # its default action would end the worker
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        blobs, jobs, limits = message
        _set_memory_cap(limits.memory_mib)  # before loading: what a reward's module allocates on import counts too
        fns = []
        for blob in blobs:
            try:
                fns.append(pickle.loads(blob) if blob is not None else None)
            except MemoryError as e:
                fns.append(_Unloadable("memory", f"loading the reward in a worker ran out of memory ({_describe(e)})"))
            except Exception as e:
                fns.append(_Unloadable("raised", f"cannot load the reward in a worker process: {_describe(e)}"))
        conn.send("loaded")
        for job_id, k, completion, sample in jobs:
            fn = fns[k]
            kind, value = ((fn.kind, fn.message) if isinstance(fn, _Unloadable)
                           else _call(fn, completion, sample, limits.timeout_s, limits.cpu_s))
            if kind == "memory" and limits.memory_mib:
                value = f"{value}; a reward worker may use {limits.memory_mib} MiB (memory_limit_mib)"
            conn.send((job_id, kind, value))


class _Unloadable:
    def __init__(self, kind: str, message: str):
        self.kind = kind
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

    def submit(self, blobs, jobs, limits: _Limits) -> None:
        self.pending = collections.deque(jobs)
        self.loaded = False
        self.deadline = time.monotonic() + LOAD_TIMEOUT_S
        # A large batch fills the pipe before a fresh worker reads it; sending from a thread keeps the parent's
        # deadline loop running even if that worker never comes up.
        threading.Thread(target=self._send, args=((blobs, list(jobs), limits),), daemon=True).start()

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

    def run(self, blobs, jobs, limits: _Limits) -> dict[int, tuple[str, object]]:
        # The parent's limit is a backstop for calls the worker's own SIGALRM cannot stop; leave that one room.
        hard_limit = limits.timeout_s + max(0.5, 0.5 * limits.timeout_s)
        results: dict[int, tuple[str, object]] = {}
        with self.lock:
            try:
                self._run(blobs, jobs, limits, hard_limit, results)
            except BaseException:
                self.close()  # e.g. Ctrl-C: workers may still be busy with this batch; never hand them another
                raise
        return results

    def _run(self, blobs, jobs, limits, hard_limit, results) -> None:
        """Deal jobs to the workers, collect one answer per job, replace workers that die or overrun."""
        if len(self.workers) != WORKERS:
            self.close()
            self.workers = [None] * WORKERS
        for slot in range(WORKERS):
            share = jobs[slot::WORKERS]  # interleaved, so one slow reward's jobs spread over all workers
            if share:
                self._submit(slot, blobs, share, limits)
        busy = [w for w in self.workers if w is not None and w.pending]
        while busy:
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            for conn in multiprocessing.connection.wait([w.conn for w in busy], wait_s):
                worker = next(w for w in busy if w.conn is conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._replace(worker, blobs, limits, results, *_death(worker.proc))
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
                    self._replace(worker, blobs, limits, results, "timeout",
                                  f"no answer within {limit:g} s; worker killed")
            busy = [w for w in self.workers if w is not None and w.pending]

    def _submit(self, slot, blobs, jobs, limits) -> None:
        worker = self.workers[slot]
        if worker is None or worker.proc.poll() is not None:
            worker = self.workers[slot] = _Worker()
        worker.submit(blobs, jobs, limits)

    def _replace(self, worker, blobs, limits, results, kind, message) -> None:
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
            self._submit(slot, blobs, list(worker.pending), limits)

    def close(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.kill()
        self.workers = []


def _death(proc: subprocess.Popen) -> tuple[str, str]:
    """(kind, message) for a worker that died mid-job (a segfault, os._exit, the kernel's OOM killer)."""
    code = _exit_code(proc)
    if code is not None and code < 0:
        try:
            return "raised", f"reward worker died (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return "raised", f"reward worker died (exit code {code})"


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
    failed = [False] * n
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
                failed[i] = True
                entry[kind] += 1
                stats[kind] += 1
                entry["first_error"] = entry["first_error"] or value
        entry["mean"] = total / n if n else 0.0
        stats["by_reward"][name] = entry
    stats["failures"] = sum(stats[kind] for kind in FAILURE_KINDS)
    stats["failed"] = failed
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
