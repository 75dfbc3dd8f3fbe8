"""Model-written Python (the `python` tool) run in the sandbox (evenrl.isolation.sandbox, docs/sandbox.md): as its own
unprivileged user, in its own PID, mount, network, IPC and UTS namespaces, seeing a read-only system and a private
size-capped /tmp only, under Landlock rules and a seccomp filter where the machine has them, under rlimits on
processes, CPU time, memory, open files and file size, with its output (whatever it writes to file descriptors 1 and
2) read up to a cap and a wall-clock limit enforced from here: at the limit, at the output cap or when the code's
main process ends, the whole PID namespace is killed, whatever the code did with its pipes or its children.

    result = run_code("print(2 + 2)")        # CodeResult(status="ok", output="4\\n", sandbox="namespaces")

Where this machine cannot make a sandbox, the code is not run (status "refused"); the trainer refuses such a run at
start (evenrl.envs.session). With sandbox="none", set knowingly in config (rewards.sandbox), the code runs in a plain
`python -I` process with the same rlimits and wall-clock limit and none of the namespaces.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from evenrl.isolation import jail, sandbox

# How `rewards.sandbox` reaches the tool inside a worker process: set by the worker per batch (evenrl.isolation.pool)
# and by the trainer for inline calls.
MODE = "tools"
# One thread for numeric libraries: the CPU-time limit counts every thread, and OpenBLAS reserves address space
# (which the memory cap counts) per thread it starts, one per core: ~40 MiB more per core for `import numpy`.
_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class CodeResult(NamedTuple):
    status: str    # ok, error (raised, non-zero exit), timeout, cpu, memory, output (past the cap), blocked, refused
    output: str    # what it wrote to stdout and stderr, at most the output cap, decoded as UTF-8 with replacement
    sandbox: str   # "namespaces", or "none" where rewards.sandbox is none


def run_code(code: str, *, timeout_s: float = 10.0, cpu_s: int = 2, memory_mib: int = 256,
             output_bytes: int = 16_384, file_bytes: int = 1 << 24, processes: int = 32,
             open_files: int = 64) -> CodeResult:
    """Run `code` under the limits; never raises for anything the code does. cpu_s (RLIMIT_CPU of each process)
    decides; timeout_s is the wall-clock backstop for code that waits (a sleep, a pipe), generous because starting
    the sandbox takes longer on a loaded machine, and said in a warning line when it fires: where it fires depends
    on that load."""
    cpu = max(1, int(cpu_s))
    limits = {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_FSIZE": (file_bytes, file_bytes), "RLIMIT_CORE": (0, 0),
              "RLIMIT_NPROC": (processes, processes), "RLIMIT_NOFILE": (open_files, open_files)}
    if MODE == "none":
        return _unsandboxed(code, limits, memory_mib << 20, timeout_s, output_bytes)
    why = sandbox.unavailable()
    if why is not None:
        return CodeResult("refused", sandbox.refusal("rewards.sandbox", why), "namespaces")
    root = tempfile.mkdtemp(prefix="evenrl-sandbox-")  # stays empty: the sandbox mounts its own tmpfs over it
    try:
        argv = sandbox.command(root, mode="code", limits=limits, tmp_bytes=file_bytes, memory_bytes=memory_mib << 20,
                               env=_ONE_THREAD)
        return CodeResult(*_run(argv, code, timeout_s, output_bytes), "namespaces")
    finally:
        os.rmdir(root)


def _backstop_fired(timeout_s: float) -> None:
    print(f"evenrl: warning: the python tool's code ran past its wall-clock backstop ({timeout_s:g} s) and was "
          f"killed; where that limit fires depends on how busy the machine is (its CPU-time limit does not)",
          flush=True)


def _unsandboxed(code: str, limits: dict, memory_bytes: int, timeout_s: float, output_bytes: int) -> CodeResult:
    """rewards.sandbox: none — the rlimits, the memory cap and the wall clock only, in a temporary directory deleted
    afterwards."""
    setup = "".join(f"resource.setrlimit(resource.{k}, {v!r}); " for k, v in limits.items() if k != "RLIMIT_NPROC")
    runner = (f"import resource, sys; {setup}sys.path.insert(0, {os.path.dirname(jail.__file__)!r}); "
              f"import jail; jail.cap_memory({memory_bytes}); jail.run_code(sys.stdin.read())")
    cwd = tempfile.mkdtemp(prefix="evenrl-code-")
    try:
        return CodeResult(*_run([sys.executable, "-I", "-c", runner], code, timeout_s, output_bytes, cwd), "none")
    finally:
        shutil.rmtree(cwd, ignore_errors=True)


def _run(argv: list[str], code: str, timeout_s: float, cap: int, cwd: str | None = None) -> tuple[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd or "/tmp", "TMPDIR": cwd or "/tmp",
           **_ONE_THREAD}
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=cwd, env=env, start_new_session=True)
    try:
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out, status = _read(proc, deadline, cap)
        if status is None:
            try:  # the pipe can close long before the process ends (code that closes fds 1 and 2, then sleeps)
                code_ = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                status = _status(code_)
                if code_ in (128 + signal.SIGSYS, -signal.SIGSYS):  # the seccomp filter's kill: say so
                    out += b"[killed: a system call through another ABI, which the sandbox refuses]\n"
            except subprocess.TimeoutExpired:
                status = "timeout"
    finally:
        _kill(proc)
    if status == "timeout":
        _backstop_fired(timeout_s)
    return status, out.decode("utf-8", "replace")


def _status(code: int) -> str:
    if code == 0:
        return "ok"
    if code == jail.EXIT_MEMORY:
        return "memory"
    if code in (jail.EXIT_BLOCKED, 128 + signal.SIGSYS, -signal.SIGSYS):
        return "blocked"
    if code == jail.EXIT_SETUP:
        return "refused"
    if code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL, -signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
    return "error"


def _read(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, str | None]:
    """(output, status if the limit or the cap ended it) reading the pipe until it closes."""
    out = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out[:cap]), "timeout"
            if not sel.select(left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return bytes(out), None
            out.extend(chunk)
            if len(out) > cap:
                return bytes(out[:cap]), "output"
    finally:
        sel.close()
        proc.stdout.close()


def _kill(proc: subprocess.Popen) -> None:
    """End the sandbox: SIGKILL to `unshare` takes its child, the namespace's PID 1, and with it every process in the
    namespace (unshare --kill-child, then the kernel). Its process group too, for sandbox none."""
    if proc.poll() is None:  # once reaped, its pid may belong to another process
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
