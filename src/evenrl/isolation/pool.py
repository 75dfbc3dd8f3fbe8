"""Contained calls: each call of user or model code (a reward, an environment's step) in a pool of persistent worker
processes under a CPU-time limit, a memory cap and a wall-clock backstop (inline: the wall clock only), so that code
that raises, hangs, crashes or runs out of memory costs its own result, not the run. The CPU-time limit decides:
code that does the same work uses the same CPU time however busy the machine is. The wall clock stops code that
waits without using CPU; where it fires depends on the machine's load, so every call it ends is counted
(`backstop_hits`, the step's limits/wall_clock_backstop) and warned about. `evenrl.rewards.pool.score_all` and
`evenrl.envs.session` run their calls here. How each limit works, what was measured and why these mechanisms and not
others: docs/rewards.md.
"""

from __future__ import annotations

import atexit
import collections
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from math import inf, isfinite
from typing import Callable, NamedTuple

from evenrl.errors import UsageError, bad
from evenrl.isolation import sandbox
from evenrl.isolation.worker import EXIT_CPU, WORKER_PROCESSES, call, on_alarm


def workers() -> int:
    """The size of this process's worker pool, read when the pool (re)starts: its share of the CPUs it may run on
    (the node's ranks, LOCAL_WORLD_SIZE, share them), at most 4, at least 1. Each worker imports the called
    functions' modules once (an environment library: ~7 s of a core for verifiers), so 8 ranks on 16 cores start 16,
    not 32."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        local = 1
    return max(1, min(4, cpus // local))


# A worker gets this long to start and import the called functions before its jobs are failed.
LOAD_TIMEOUT_S = 60.0

# How a call can fail: raised an exception (or the worker crashed), returned something unusable (the caller's own
# check, or a value that cannot travel back from a worker), ran past the wall-clock limit, allocated past the
# worker's memory cap, used more CPU time than the per-call cap.
FAILURE_KINDS = ("raised", "bad_value", "timeout", "memory", "cpu")

# A job: (job id, index of its function in the list given, the call's arguments).
Job = tuple[int, int, tuple]


def run_contained(fns: list[Callable], jobs: list[Job], limits: Limits, *, isolate: bool = True,
                  what: str = "call") -> tuple[dict[int, tuple[str, object]], bool]:
    """({job id: (kind, value)}, whether worker processes ran any) for `fns[k](*args)` of each job: kind "ok" with
    the returned value, or one of FAILURE_KINDS with a one-line message. In worker processes when `isolate` (and
    the function can be sent to one by reference: a module-level function), else inline in this thread under the
    wall-clock limit only (main thread only). `what` names the calls in errors ("reward", "environment step")."""
    _check_limits(limits, what)
    if limits.sandbox == "all" and isolate:
        sandbox.require("rewards.sandbox")
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
    _count_backstop(results, limits, what)
    return results, bool(pooled)


_backstop = 0  # calls of this process the wall clock ended, since backstop_hits() last read them


def backstop_hits() -> int:
    """Calls this process ran whose wall-clock limit (the backstop) ended them, since the last call of this."""
    global _backstop
    hits, _backstop = _backstop, 0
    return hits


def _count_backstop(results: dict, limits: Limits, what: str) -> None:
    """Count the calls the wall clock ended, and say so: unlike the CPU-time limit's, their fate depended on how
    busy the machine was."""
    global _backstop
    hits = sum(kind == "timeout" for kind, _ in results.values())
    if hits:
        _backstop += hits
        print(f"evenrl: warning: {hits} of {len(results)} {what} calls ran past their wall-clock backstop "
              f"({limits.timeout_s:g} s) and failed; where that limit fires depends on how busy the machine is "
              f"(the CPU-time limit, {limits.cpu_s:g} s, does not): a call that waits (sleep, lock, socket), or a "
              f"machine loaded far past its cores; raise rewards.timeout_s (rollout.agent_timeout_s for agents) if "
              f"the calls were only slow", flush=True)


def _check_limits(limits: Limits, what: str) -> None:
    if not (isinstance(limits.timeout_s, (int, float)) and limits.timeout_s > 0 and isfinite(limits.timeout_s)):
        raise bad(f"{what} timeout_s", limits.timeout_s, "a finite number of seconds > 0")
    if not (isinstance(limits.cpu_s, (int, float)) and limits.cpu_s > 0 and isfinite(limits.cpu_s)):
        raise bad(f"{what} cpu_time_limit_s", limits.cpu_s, "a finite number of seconds > 0")
    if not (isinstance(limits.memory_mib, int) and limits.memory_mib >= 0):
        raise bad(f"{what} memory_limit_mib", limits.memory_mib, "an integer number of MiB >= 0 (0: no cap)")


class Limits(NamedTuple):
    timeout_s: float          # wall clock, per call: the backstop
    cpu_s: float              # CPU time, per call (worker only): the limit meant to decide
    memory_mib: int           # the worker's data segment; 0: no cap (worker only)
    sandbox: str = "tools"    # rewards.sandbox, for the python tool run by the calls (evenrl.isolation.code.MODE)


def _run_inline(fns, jobs, timeout_s) -> dict[int, tuple[str, object]]:
    # Someone else's ITIMER_REAL (pytest-timeout, a watchdog) is paused while ours runs and re-armed afterwards
    # with the time it had left, so it fires late by at most this batch's duration instead of never.
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        return {job_id: call(fns[k], args, timeout_s) for job_id, k, args in jobs}
    finally:
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:
            left = max(1e-3, outer_delay - (time.monotonic() - started))
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


_WORKER_CODE = (
    "import sys; from multiprocessing.connection import Connection; from evenrl.isolation.worker import worker_main; "
    "worker_main(Connection(int(sys.argv[1])), sys.argv[2] == 'own-namespace')"
)
# The sandbox's /tmp for a worker in it (rewards.sandbox: all).
SANDBOX_TMP_BYTES = 64 << 20


class _Worker:
    """One worker process: in the sandbox (rewards.sandbox: all), else where util-linux `unshare` works as PID 1 of
    its own PID and network namespaces, so that killing the one process the pool started (`unshare`, whose
    --kill-child takes the worker, and the kernel everything in its namespace) leaves nothing behind; else a plain
    process in a session of its own, killed with its process group."""

    def __init__(self, sandboxed: bool):
        self.sandboxed = sandboxed
        self.conn, child = multiprocessing.Pipe()
        paths = [p for p in sys.path if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        worker = [sys.executable, "-c", _WORKER_CODE, str(child.fileno())]
        self.root = None
        if sandboxed:
            self.root = tempfile.mkdtemp(prefix="evenrl-sandbox-")  # stays empty: the sandbox mounts a tmpfs on it
            argv = sandbox.command(self.root, mode="argv", argv=(*worker, "own-namespace"), extra_paths=paths,
                                   limits={"RLIMIT_NPROC": (WORKER_PROCESSES,) * 2, "RLIMIT_CORE": (0, 0)},
                                   tmp_bytes=SANDBOX_TMP_BYTES, env={"PYTHONPATH": env["PYTHONPATH"]})
        elif _namespaces():
            argv = [*_namespaces(), *worker, "own-namespace"]
        else:
            argv = [*worker, "plain"]
        self.proc = subprocess.Popen(argv, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
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
        if self.proc.poll() is None:  # once reaped, its pid may belong to another process
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        self.conn.close()
        if self.root is not None:
            os.rmdir(self.root)


@functools.lru_cache(maxsize=1)
def _namespaces() -> tuple[str, ...] | None:
    """The `unshare` arguments that start a worker in PID and network namespaces of its own, or None where this
    machine refuses them (tried once)."""
    argv = ("unshare", *(() if os.geteuid() == 0 else ("--user", "--map-root-user")), "--pid", "--fork",
            "--kill-child", "--net")
    try:
        return argv if subprocess.run([*argv, "true"], capture_output=True, timeout=30).returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


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
        size = workers()
        if len(self.workers) != size:
            self.close()
            self.workers = [None] * size
        for slot in range(size):
            share = jobs[slot::size]  # interleaved, so one slow function's jobs spread over all workers
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
                    self._replace(worker, blobs, limits, results, *_death(worker.proc, limits))
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
        sandboxed = limits.sandbox == "all"
        if worker is not None and (worker.proc.poll() is not None or worker.sandboxed != sandboxed):
            worker.kill()
            worker = None
        if worker is None:
            worker = self.workers[slot] = _Worker(sandboxed)
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


def _death(proc: subprocess.Popen, limits: Limits) -> tuple[str, str]:
    """(kind, message) for a worker that died mid-job (a segfault, os._exit, the kernel's OOM killer, its CPU-time
    rlimit: evenrl.isolation.worker.EXIT_CPU)."""
    code = _exit_code(proc)
    if code == EXIT_CPU:
        return "cpu", (f"used more than {limits.cpu_s:g} s of CPU time in code no signal interrupts (stuck in C); "
                       f"worker killed")
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
