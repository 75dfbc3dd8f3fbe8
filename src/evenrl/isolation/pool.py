"""Contained calls: each call of user or model code (a reward, an environment's step) under a wall-clock limit and,
in a pool of persistent worker processes, a CPU-time limit and a memory cap, so that code that raises, hangs,
crashes or runs out of memory costs its own result, not the run. `evenrl.rewards.pool.score_all` and
`evenrl.envs.session` run their calls here. How each limit works, what was measured and why these mechanisms and not
others: docs/rewards.md.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
from math import inf, isfinite
from typing import Callable, NamedTuple

from evenrl.errors import UsageError, bad, describe_error, one_line
from evenrl.isolation import code

# Size of the worker pool; read when the pool (re)starts.
WORKERS = max(1, min(4, os.cpu_count() or 1))
# A worker gets this long to start and import the called functions before its jobs are failed.
LOAD_TIMEOUT_S = 60.0
# What one call may print (Python's sys.stdout and sys.stderr in a worker) before the rest is dropped.
CALL_OUTPUT_CHARS = 16_384

# How a call can fail: raised an exception (or the worker crashed), returned something unusable (the caller's own
# check, or a value that cannot travel back from a worker), ran past the wall-clock limit, allocated past the
# worker's memory cap, used more CPU time than the per-call cap.
FAILURE_KINDS = ("raised", "bad_value", "timeout", "memory", "cpu")
# The memory cap is RLIMIT_DATA, not RLIMIT_AS: see docs/rewards.md.
_MEMORY_RLIMIT = resource.RLIMIT_DATA

# A job: (job id, index of its function in the list given, the call's arguments).
Job = tuple[int, int, tuple]


def run_contained(fns: list[Callable], jobs: list[Job], limits: Limits, *, isolate: bool = True,
                  what: str = "call") -> tuple[dict[int, tuple[str, object]], bool]:
    """({job id: (kind, value)}, whether worker processes ran any) for `fns[k](*args)` of each job: kind "ok" with
    the returned value, or one of FAILURE_KINDS with a one-line message. In worker processes when `isolate` (and
    the function can be sent to one by reference: a module-level function), else inline in this thread under the
    wall-clock limit only (main thread only). `what` names the calls in errors ("reward", "environment step")."""
    _check_limits(limits, what)
    main_thread = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    blobs = [_pickle_by_reference(fn) for fn in fns] if (isolate or not main_thread) else [None] * len(fns)
    pooled = [job for job in jobs if blobs[job[1]] is not None]
    inline = [job for job in jobs if blobs[job[1]] is None]
    if inline and not main_thread:
        names = sorted({getattr(fns[k], "__qualname__", repr(fns[k])) for _, k, _ in inline})
        raise UsageError(f"{what}: {', '.join(names)} cannot be sent to a worker process and is not called on the "
                         f"main thread; define {what}s at module level")
    results: dict[int, tuple[str, object]] = {}
    if pooled:
        results.update(_pool().run(blobs, pooled, limits))
    if inline:
        results.update(_run_inline(fns, inline, limits.timeout_s))
    return results, bool(pooled)


def _check_limits(limits: Limits, what: str) -> None:
    if not (isinstance(limits.timeout_s, (int, float)) and limits.timeout_s > 0 and isfinite(limits.timeout_s)):
        raise bad(f"{what} timeout_s", limits.timeout_s, "a finite number of seconds > 0")
    if not (isinstance(limits.cpu_s, (int, float)) and limits.cpu_s > 0 and isfinite(limits.cpu_s)):
        raise bad(f"{what} cpu_time_limit_s", limits.cpu_s, "a finite number of seconds > 0")
    if not (isinstance(limits.memory_mib, int) and limits.memory_mib >= 0):
        raise bad(f"{what} memory_limit_mib", limits.memory_mib, "an integer number of MiB >= 0 (0: no cap)")


class Limits(NamedTuple):
    timeout_s: float          # wall clock, per call
    cpu_s: float              # CPU time, per call (worker only)
    memory_mib: int           # the worker's data segment; 0: no cap (worker only)
    sandbox: str = "tools"    # rewards.sandbox, for the python tool run by the calls (evenrl.isolation.code.MODE)


# ---------------------------------------------------------------------------------------------------------------------
# One guarded call (used inline and inside workers)
# ---------------------------------------------------------------------------------------------------------------------


class _Timeout(BaseException):
    """Raised into a call by SIGALRM; a BaseException so the code's own `except Exception:` cannot swallow it."""


class _CpuTime(BaseException):
    """Raised into a call by SIGPROF (its CPU-time limit ran out); a BaseException too."""


_alarm_armed = False


def _on_alarm(signum, frame):
    if _alarm_armed:  # a late signal after the call finished must not hit our own bookkeeping
        raise _Timeout


def _on_cpu_limit(signum, frame):
    if _alarm_armed:
        raise _CpuTime


def _call(fn: Callable, args: tuple, timeout_s: float, cpu_s: float | None = None) -> tuple[str, object]:
    """Run one call under an ITIMER_REAL limit (main thread, SIGALRM handler installed) -> (kind, value).

    With cpu_s (worker processes only, SIGPROF handler installed) also under an ITIMER_PROF limit: cpu_s seconds of
    the process's CPU time (user + system, all threads) from the start of the call."""
    global _alarm_armed
    try:
        try:
            _alarm_armed = True
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            if cpu_s is not None:
                signal.setitimer(signal.ITIMER_PROF, cpu_s)
            value = fn(*args)
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
    except (Exception, SystemExit) as e:  # SystemExit too: code calling sys.exit() must not end training
        return "raised", describe_error(e)
    return "ok", value


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
        return {job_id: _call(fns[k], args, timeout_s) for job_id, k, args in jobs}
    finally:
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:
            left = max(1e-3, outer_delay - (time.monotonic() - started))
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


# ---------------------------------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------------------------------


def _deny_network() -> str:
    """No network for the code a worker runs: the worker moves itself into new user and network namespaces (only
    a loopback device, down), or where the kernel refuses that, an audit hook (PEP 578) refuses every socket from
    Python. The pipe to the trainer was opened before and keeps working. Returns which of the two holds."""
    try:
        if ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET
            return "namespace"
    except (OSError, AttributeError):
        pass

    def guard(event, args):
        if event.startswith("socket."):
            raise PermissionError(f"{event}: reward and environment code runs without network")
    sys.addaudithook(guard)
    return "audit-hook"


def _worker_main(conn) -> None:
    """Worker loop: receive (pickled fns, jobs, limits); reply "loaded", then one (job_id, kind, value) per job."""
    _deny_network()  # first: CLONE_NEWUSER needs a process with one thread
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the trainer, which kills us
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGPROF, _on_cpu_limit)  # its default action would end the worker
    sys.stdout = sys.stderr = printed = _CappedOutput(sys.__stderr__)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        blobs, jobs, limits = message
        code.MODE = limits.sandbox
        _set_memory_cap(limits.memory_mib)  # before loading: what a function's module allocates on import counts
        fns = []
        for blob in blobs:
            try:
                fns.append(pickle.loads(blob) if blob is not None else None)
            except MemoryError as e:
                fns.append(_Unloadable("memory", f"loading the function in a worker ran out of memory "
                                                 f"({describe_error(e)})"))
            except Exception as e:
                fns.append(_Unloadable("raised", f"cannot load the function in a worker process: "
                                                 f"{describe_error(e)}"))
        conn.send("loaded")
        for job_id, k, args in jobs:
            printed.begin()
            fn = fns[k]
            kind, value = ((fn.kind, fn.message) if isinstance(fn, _Unloadable)
                           else _call(fn, args, limits.timeout_s, limits.cpu_s))
            if kind == "memory" and limits.memory_mib:
                value = f"{value}; a worker may use {limits.memory_mib} MiB (memory_limit_mib)"
            conn.send_bytes(_answer(job_id, kind, value))


class _CappedOutput(io.TextIOBase):
    """Where a worker's calls print: passed on to the worker's stderr (the trainer's) up to CALL_OUTPUT_CHARS per
    call, then one line saying the rest was dropped, so a call that prints 100 MB costs a line, not the log.
    Python-level output only: C code writing to file descriptor 1 or 2 directly is not capped."""

    def __init__(self, real):
        self.real, self.left, self.cut = real, CALL_OUTPUT_CHARS, False

    def begin(self) -> None:
        self.left, self.cut = CALL_OUTPUT_CHARS, False

    def write(self, text: str) -> int:
        part = text[:max(self.left, 0)]
        if part:
            self.real.write(part)
            self.left -= len(part)
        if len(part) < len(text) and not self.cut:
            self.cut = True
            self.real.write(f"\n[evenrl: output of this call cut at {CALL_OUTPUT_CHARS:,} characters]\n")
        return len(text)

    def flush(self) -> None:
        self.real.flush()


class _Unloadable:
    def __init__(self, kind: str, message: str):
        self.kind = kind
        self.message = message


def _answer(job_id: int, kind: str, value) -> bytes:
    """The answer pickled for the parent's conn.recv(): a value that cannot be pickled is a bad value, not a dead
    worker."""
    try:
        return pickle.dumps((job_id, kind, value))
    except Exception as e:
        return pickle.dumps((job_id, "bad_value", f"returned a value that cannot be sent back ({describe_error(e)})"))


# The worker is a fresh interpreter that imports only this pool and the called function's module:
# multiprocessing's "spawn" would re-run the parent's __main__ script (disastrous without an
# `if __name__ == "__main__"` guard), and fork is unsafe in a process holding CUDA or OpenMP threads.
_WORKER_CODE = (
    "import sys; from multiprocessing.connection import Connection; from evenrl.isolation.pool import _worker_main; "
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

    def submit(self, blobs, jobs, limits: Limits) -> None:
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

    def run(self, blobs, jobs, limits: Limits) -> dict[int, tuple[str, object]]:
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
            share = jobs[slot::WORKERS]  # interleaved, so one slow function's jobs spread over all workers
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
                results[job[0]] = ("raised", f"worker failed to start: {message}")
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
            return "raised", f"worker died (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return "raised", f"worker died (exit code {code})"


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
