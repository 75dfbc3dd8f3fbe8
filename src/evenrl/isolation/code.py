"""Model-written Python run in a process of its own (the `python` tool): a fresh isolated interpreter (`python -I`) in
a temporary working directory that is deleted afterwards, with a CPU-time cap (RLIMIT_CPU), a memory cap
(RLIMIT_DATA, as for reward workers: docs/rewards.md), a cap on the bytes of output read back, a file-size cap, no
network, and a wall-clock limit after which its whole process group is killed.

No network: the child first moves itself into new user and network namespaces (unshare(2) through libc; only a
loopback device that is down exists there, so every connection fails). Where the kernel refuses unprivileged user
namespaces, it installs an audit hook (PEP 578) that refuses sockets, subprocesses, exec and fork before running the
code: a best effort that code using ctypes can get around, and `run_code` says which of the two held
(`CodeResult.network`). Measured on this project's 2-core machine: start-up to first line of user code ~25 ms.

    result = run_code("print(2 + 2)")        # CodeResult(status="ok", output="4\\n", network="namespace")
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

# Exit codes the bootstrap uses to say which limit the code ran into.
_EXIT_MEMORY, _EXIT_BLOCKED = 90, 91

_BOOTSTRAP = r"""
import ctypes, resource, sys
cpu_s, memory_mib, file_bytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
code = sys.stdin.read()
sys.stdin.close()
isolated = False
try:
    libc = ctypes.CDLL(None, use_errno=True)
    isolated = libc.unshare(0x10000000 | 0x40000000) == 0  # CLONE_NEWUSER | CLONE_NEWNET
except Exception:
    pass
if not isolated:
    refused = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.fork", "os.system", "pty.spawn")
    def _guard(event, args):
        if event.startswith(refused):
            raise PermissionError(f"{event} is not allowed here (no network, no new processes)")
    sys.addaudithook(_guard)
print("namespace" if isolated else "audit-hook", file=sys.__stderr__, flush=True)
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
if memory_mib:
    resource.setrlimit(resource.RLIMIT_DATA, (memory_mib << 20, memory_mib << 20))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.stderr = sys.stdout
try:
    exec(compile(code, "<tool code>", "exec"), {"__name__": "__main__"})
except MemoryError:
    print("MemoryError: the code ran out of memory", flush=True)
    sys.exit(90)
except PermissionError as e:
    print(f"PermissionError: {e}", flush=True)
    sys.exit(91)
except SystemExit:
    raise
except BaseException as e:
    import traceback
    lines = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)).splitlines()
    print("\n".join(lines[-6:]), flush=True)
    sys.exit(1)
"""


class CodeResult(NamedTuple):
    status: str    # ok, error (raised or a non-zero exit), timeout, cpu, memory, output (more than the cap), blocked
    output: str    # stdout and stderr together, at most the output cap, decoded as UTF-8 with replacement
    network: str   # what kept the code off the network: "namespace" or "audit-hook" ("" if it never started)


def run_code(code: str, *, timeout_s: float = 3.0, cpu_s: int = 2, memory_mib: int = 256,
             output_bytes: int = 16_384, file_bytes: int = 1 << 24) -> CodeResult:
    """Run `code` in a new interpreter under the limits; never raises for anything the code does."""
    with tempfile.TemporaryDirectory(prefix="evenrl-code-") as cwd:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOTSTRAP, str(max(1, int(cpu_s))), str(int(memory_mib)), str(file_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env,
            start_new_session=True)
        try:
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
                proc.stdin.close()
            except BrokenPipeError:
                pass
            out, network, status = _read(proc, time.monotonic() + timeout_s, output_bytes)
        except BaseException:  # e.g. the caller's own time limit: never leave the child running
            _kill(proc)
            raise
        if status is None:
            code_ = proc.wait()
            status = ("ok" if code_ == 0 else "memory" if code_ == _EXIT_MEMORY else
                      "blocked" if code_ == _EXIT_BLOCKED else
                      "cpu" if code_ in (-signal.SIGXCPU, -signal.SIGKILL) else "error")
        return CodeResult(status, out.decode("utf-8", "replace"), network)


def _read(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, str, str | None]:
    """(output, network line, status if the process had to be killed) reading both pipes until they close."""
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    status = None
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
            if len(out) > cap:
                status = "output"
                break
    finally:
        sel.close()
        if status is not None:
            _kill(proc)
        proc.stdout.close()
        proc.stderr.close()
    return bytes(out[:cap]), err.decode("utf-8", "replace").split("\n", 1)[0].strip(), status


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
