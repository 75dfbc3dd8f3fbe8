"""The worker side of evenrl.isolation.pool: one guarded call (`call`: a wall-clock and a CPU-time limit raised into
the code as BaseExceptions, re-raised every 50 ms until the call ends, so code that swallows one does not outlast
it; the pool's parent kills a worker that still does) and the loop of a worker process (`worker_main`). A worker
started in its own PID namespace (the pool's default where util-linux `unshare` works) kills every process its
call started once the call ends. A worker's file descriptors 1 and 2 are a pipe it reads itself (`_Capture`), so
what a call writes there, from Python, C or a child process, reaches the trainer's log only up to a cap. A process
a call forks never returns into the worker and never prints a limit's traceback. docs/rewards.md says how each
limit works and why.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import pickle
import resource
import signal
import sys
import threading
import time
from typing import Callable

from evenrl.errors import describe_error
from evenrl.isolation import code

# What one call may write to file descriptors 1 and 2 (print, C code, the processes it starts), in bytes, before the
# rest is read and dropped.
CALL_OUTPUT_CHARS = 16_384
# Processes (and threads) a worker and what its calls start may have at once: RLIMIT_NPROC, which the kernel applies
# to every user but root (uid 0 is exempt from it, in user namespaces too: measured).
WORKER_PROCESSES = 512
# The memory cap is RLIMIT_DATA, not RLIMIT_AS: see docs/rewards.md.
_MEMORY_RLIMIT = resource.RLIMIT_DATA
# How this worker's network is denied: "namespace" (namespaces of its own: only a loopback device) or "audit-hook";
# evenrl.isolation.loopback reads it.
NETWORK = ""
# After a limit fires, it fires again this often until the call has ended (a handler or an at-fork hook that
# swallowed the first one does not swallow them all).
_REPEAT_S = 0.05
# Code stuck in C (a regex backtracking in the re module, sum(range(10**13))) runs no signal handler of Python's, so
# ITIMER_PROF cannot stop it: RLIMIT_CPU, set before each call to the CPU time used so far + the call's limit + this,
# rounded up to whole seconds, makes the kernel send SIGXCPU, whose handler is libc's _exit itself (no Python runs:
# the worker exits with the signal's number, EXIT_CPU, and the parent reads that as the call's CPU limit).
_RLIMIT_CPU_GRACE_S = 1.0
EXIT_CPU = int(signal.SIGXCPU)


class _Timeout(BaseException):
    """Raised into a call by SIGALRM; a BaseException so the code's own `except Exception:` cannot swallow it."""


class _CpuTime(BaseException):
    """Raised into a call by SIGPROF (its CPU-time limit ran out); a BaseException too."""


_alarm_armed = False


def on_alarm(signum, frame):
    if _alarm_armed:  # a late signal after the call finished must not hit our own bookkeeping
        raise _Timeout


def _on_cpu_limit(signum, frame):
    if _alarm_armed:
        raise _CpuTime


def call(fn: Callable, args: tuple, timeout_s: float, cpu_s: float | None = None) -> tuple[str, object]:
    """Run one call under an ITIMER_REAL limit (main thread, SIGALRM handler installed) -> (kind, value).

    With cpu_s (worker processes only, SIGPROF handler installed) also under an ITIMER_PROF limit: cpu_s seconds of
    the process's CPU time (user + system, all threads) from the start of the call. A child process the call forked
    that comes back out of it (returning, raising, its parent's limit) ends here, silently: it must not go on as
    the worker (or the trainer), answering on their pipes."""
    caller = os.getpid()
    try:
        return _call(fn, args, timeout_s, cpu_s)
    finally:
        if os.getpid() != caller:
            os._exit(0)


def _call(fn: Callable, args: tuple, timeout_s: float, cpu_s: float | None) -> tuple[str, object]:
    global _alarm_armed
    try:
        try:
            _alarm_armed = True
            signal.setitimer(signal.ITIMER_REAL, timeout_s, _REPEAT_S)
            if cpu_s is not None:
                signal.setitimer(signal.ITIMER_PROF, cpu_s, _REPEAT_S)
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


def _disarm_in_child() -> None:
    """(os.register_at_fork, in a child the call forks) no limit of the parent's call raises in the child."""
    global _alarm_armed
    _alarm_armed = False


def _quiet_limits(unraisable) -> None:
    """sys.unraisablehook: a limit that fired inside code whose exceptions cannot propagate (an at-fork hook, a
    finaliser) is dropped silently; it fires again 50 ms later (_REPEAT_S) where it can. Anything else as Python
    reports it."""
    if not isinstance(unraisable.exc_value, (_Timeout, _CpuTime)):
        sys.__unraisablehook__(unraisable)


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


def _exit_at_rlimit_cpu() -> None:
    """SIGXCPU's handler: libc's _exit, called by the kernel with the signal's number (an installed handler, so it
    reaches a worker that is PID 1 of its namespace, which ignores signals left at their default action)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(EXIT_CPU, ctypes.cast(libc._exit, ctypes.c_void_p).value)


def _cpu_rlimit(cpu_s: float | None) -> None:
    """RLIMIT_CPU's soft limit at the CPU time used so far + cpu_s + grace (None: back to the hard limit)."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = hard
    if cpu_s is not None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime + cpu_s + _RLIMIT_CPU_GRACE_S) + 1
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def worker_main(conn, own_namespace: bool) -> None:
    """Worker loop: receive (pickled fns, jobs, limits); reply "loaded", then one (job_id, kind, value) per job.
    own_namespace: started in new PID and network namespaces of its own (the pool's `unshare`, or the sandbox)."""
    global NETWORK
    NETWORK = "namespace" if own_namespace else _deny_network()  # first: CLONE_NEWUSER needs one thread
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (min(WORKER_PROCESSES, hard), hard))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the trainer, which kills us
    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGPROF, _on_cpu_limit)  # its default action would end the worker
    os.register_at_fork(after_in_child=_disarm_in_child)
    _exit_at_rlimit_cpu()
    sys.unraisablehook = _quiet_limits
    printed = _Capture()  # after _deny_network: a second thread would make CLONE_NEWUSER fail
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
        if not _answer_parent(conn, pickle.dumps("loaded")):
            return
        for job_id, k, args in jobs:
            printed.begin()
            fn = fns[k]
            _cpu_rlimit(limits.cpu_s)
            kind, value = ((fn.kind, fn.message) if isinstance(fn, _Unloadable)
                           else call(fn, args, limits.timeout_s, limits.cpu_s))
            _cpu_rlimit(None)
            printed.flush()
            if own_namespace:
                _end_leftovers()
            if kind == "memory" and limits.memory_mib:
                value = f"{value}; a worker may use {limits.memory_mib} MiB (memory_limit_mib)"
            if not _answer_parent(conn, _answer(job_id, kind, value)):
                return


def _answer_parent(conn, data: bytes) -> bool:
    """Send to the trainer; False where it is gone (killed, or crashed by a signal): the worker then ends quietly,
    as when its pipe closes while it waits, not with a BrokenPipeError traceback under the trainer's own line."""
    try:
        conn.send_bytes(data)
    except OSError:
        return False
    return True


def _end_leftovers() -> None:
    """Kill every process the call started (daemons and forked children too) and reap them: in a PID namespace of
    the worker's own, kill(-1) reaches exactly those (never the namespace's PID 1 nor the worker itself)."""
    try:
        os.kill(-1, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


class _Capture:
    """File descriptors 1 and 2 of the worker, and so of every process a call starts, made one pipe that a thread
    here reads: what a call writes (print, C code writing to fd 1, a child's output) is passed on to the trainer's
    stderr up to CALL_OUTPUT_CHARS bytes per call, then one line saying the rest was dropped, and the rest is read
    and dropped, so a call that writes 500 MB costs the log a line. Reading is this process's CPU time: a call that
    floods its output spends its own CPU-time limit on it. With nobody reading, a writer would block at 64 KiB."""

    def __init__(self):
        self.real = os.dup(2)  # the trainer's stderr, inherited
        read, write = os.pipe()
        try:
            fcntl.fcntl(write, 1031, 1 << 20)  # F_SETPIPE_SZ: fewer, larger reads of a flood
        except OSError:
            pass
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self.read = read
        self.lock = threading.Lock()
        self.left, self.cut = CALL_OUTPUT_CHARS, False
        threading.Thread(target=self._pump, name="evenrl-output", daemon=True).start()

    def begin(self) -> None:
        """A new call: its own cap. What an earlier call wrote and is still in the pipe counts as the earlier's."""
        self._drained()
        with self.lock:
            self.left, self.cut = CALL_OUTPUT_CHARS, False

    def flush(self) -> None:
        """After a call: what Python buffered into the pipe, and the pipe read."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed or replaced by the call
                pass
        self._drained()

    def _drained(self, within_s: float = 0.5) -> None:
        """Wait until the pipe is empty (at most within_s: a process left writing keeps it full)."""
        deadline = time.monotonic() + within_s
        waiting = ctypes.c_int(0)
        while time.monotonic() < deadline:
            fcntl.ioctl(self.read, 0x541B, waiting)  # FIONREAD: bytes in the pipe
            if waiting.value == 0:
                return
            time.sleep(0.001)

    def _pump(self) -> None:
        note = f"\n[evenrl: output of this call cut at {CALL_OUTPUT_CHARS:,} bytes]\n".encode()
        while True:
            try:
                chunk = os.read(self.read, 1 << 20)
            except OSError:
                return
            if not chunk:
                return
            with self.lock:
                part = chunk[:max(self.left, 0)]
                self.left -= len(part)
                if len(part) < len(chunk) and not self.cut:
                    self.cut = True
                    part += note
                try:
                    while part:
                        part = part[os.write(self.real, part):]
                except OSError:  # the trainer's stderr is gone: keep reading, or the call would block
                    pass


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
