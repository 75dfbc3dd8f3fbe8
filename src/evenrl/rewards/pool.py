"""`score_all`, the safe runner: every reward call under a wall-clock limit and, in a pool of persistent worker
processes, a CPU-time limit and a memory cap, so that a reward that raises, hangs, crashes or runs out of memory
costs its completion's score, not the run. How each limit works, what was measured and why these mechanisms and
not others: docs/rewards.md.
"""

from __future__ import annotations

import atexit
import collections
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
from typing import NamedTuple

from evenrl.errors import UsageError, bad
from evenrl.rewards.registry import RewardFn, describe_error, one_line, reward_name

# Size of the worker pool; read when the pool (re)starts.
WORKERS = max(1, min(4, os.cpu_count() or 1))
# A worker gets this long to start and import the reward functions before its jobs are failed.
LOAD_TIMEOUT_S = 60.0

# How a call can fail: raised an exception (or the worker crashed), returned a non-number, ran past the wall-clock
# limit, allocated past the worker's memory cap, used more CPU time than the per-call cap.
FAILURE_KINDS = ("raised", "bad_value", "timeout", "memory", "cpu")
# The memory cap is RLIMIT_DATA, not RLIMIT_AS: see docs/rewards.md.
_MEMORY_RLIMIT = resource.RLIMIT_DATA


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
        names = sorted({reward_name(fns[k]) for _, k, _, _ in inline})
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
        return "memory", f"ran out of memory ({describe_error(e)})"
    except (Exception, SystemExit) as e:  # SystemExit too: a reward calling sys.exit() must not end training
        return "raised", describe_error(e)
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
                fns.append(_Unloadable("memory", f"loading the reward in a worker ran out of memory ({describe_error(e)})"))
            except Exception as e:
                fns.append(_Unloadable("raised", f"cannot load the reward in a worker process: {describe_error(e)}"))
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


# The worker is a fresh interpreter that imports only evenrl.rewards (this pool and the built-in rewards):
# multiprocessing's "spawn" would re-run the parent's __main__ script (disastrous without an
# `if __name__ == "__main__"` guard), and fork is unsafe in a process holding CUDA or OpenMP threads.
_WORKER_CODE = (
    "import sys; from multiprocessing.connection import Connection; from evenrl.rewards.pool import _worker_main; "
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
        name = reward_name(fn)
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


def _short_repr(value) -> str:
    try:
        return one_line(repr(value))
    except Exception:
        return f"<unprintable {type(value).__name__}>"
