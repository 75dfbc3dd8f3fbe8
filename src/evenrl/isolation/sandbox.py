"""The sandbox for code evenrl did not write: the command that starts a process in it (`command`), whether this
machine can make one (`unavailable`), and the one line that says what to do where it cannot (`refusal`).

Built from what the kernel and every Linux distribution provide: util-linux `unshare` (in Debian's and Ubuntu's
essential set, and in the base system of nearly every other distribution) makes new PID, mount, network, IPC and UTS namespaces (and a
user namespace when the trainer is not root), and evenrl.isolation.jail, run as that namespace's PID 1, builds a
read-only file system view, drops to an unprivileged uid, restricts the code with Landlock (the kernel's, where it
has it) and loads a seccomp filter that libseccomp compiled here (evenrl.isolation.syscalls, through pyseccomp).
bubblewrap would do the same but is one more package to install and keep; it too takes its seccomp program compiled.
A machine without Landlock or libseccomp still gets the other layers, and the run says so once (`warn_missing`).
What each layer stops, and what was measured: docs/sandbox.md.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from evenrl.errors import UsageError
from evenrl.isolation import jail, syscalls

# Host directories the code sees, read-only (those that exist); plus the Python installation evenrl runs on.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Unprivileged uids for sandboxes started by a root trainer: numbers no account uses, one drawn per sandbox so two
# sandboxes never share a process count (RLIMIT_NPROC counts per uid).
_UID_BASE, _UID_SPAN = 2_100_000_000, 1 << 24

_JAIL_SOURCE = Path(jail.__file__).read_text()


def python_paths() -> list[str]:
    """The directories the sandbox's Python needs: its installation and the environment's packages (read-only)."""
    found = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    found.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        found.add(os.path.realpath(sysconfig.get_paths()[key]))
    return sorted(p for p in found if not any(p != q and p.startswith(q + "/") for q in found))


def command(root: str, *, mode: str, limits: dict, tmp_bytes: int, extra_paths: tuple = (), argv: tuple = (),
            env: dict | None = None, memory_bytes: int = 0) -> list[str]:
    """argv that runs jail as PID 1 of new namespaces, building its file system at `root` (an empty directory).
    mode "code": Python read from stdin; "argv": exec `argv`. limits: rlimit name -> value for the code;
    memory_bytes: what the code may hold (jail.cap_memory), 0: no cap."""
    outside_root = os.geteuid() == 0
    system = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    wanted = sorted({os.path.realpath(p) for p in (*python_paths(), *extra_paths) if os.path.exists(p)})
    covered = [os.path.realpath(p) for p in system]
    extra = []
    for path in wanted:  # sorted: a directory comes before what is under it, which it then covers
        if not any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered + extra):
            extra.append(path)
    settings = {"root": root, "paths": system + extra,
                "tmp_bytes": tmp_bytes, "limits": limits, "mode": mode, "argv": list(argv), "env": env or {},
                "memory_bytes": memory_bytes,
                "seccomp": syscalls.program()[0].hex(), "landlock": jail.landlock_abi(),
                "uid": _UID_BASE + secrets.randbelow(_UID_SPAN) if outside_root else None}
    user = [] if outside_root else ["--user", "--map-root-user"]
    return ["unshare", *user, "--pid", "--fork", "--kill-child", "--mount", "--net", "--ipc", "--uts",
            sys.executable, "-I", "-c", _JAIL_SOURCE, json.dumps(settings)]


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why this machine cannot make a sandbox (one clause), or None when it can: tried once, by starting one."""
    if shutil.which("unshare") is None:
        return "util-linux `unshare` is not installed (apt-get install util-linux)"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="evenrl-sandbox-") as root:
        try:
            done = subprocess.run(command(root, mode="code", limits={}, tmp_bytes=1 << 20), input=b"pass",
                                  capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"starting one failed ({e})"
    if done.returncode == 0:
        return None
    said = (done.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return f"the kernel refused to make one ({said[:160]})"


def refusal(field: str, why: str) -> str:
    """The one line for a run that needs a sandbox this machine cannot make."""
    return (f"{field}: model-written code runs only in a sandbox, and {why}; allow unprivileged user namespaces "
            f"(sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces>0; in Docker run with "
            f"--security-opt seccomp=unconfined or as root) or set {field}: none to run it unsandboxed knowingly")


def require(field: str) -> None:
    """At the start of a run that will sandbox code: stop with `refusal` if this machine cannot make a sandbox, else
    say once which of its layers it lacks (`warn_missing`)."""
    if (why := unavailable()) is not None:
        raise UsageError(refusal(field, why))
    warn_missing()


# What each Landlock ABI below the one evenrl uses lacks, and the kernel that brings it.
_LANDLOCK_SINCE = ((4, "TCP rules", "6.7"), (6, "signal and abstract-socket scoping", "6.12"))


@functools.lru_cache(maxsize=1)
def missing_layers() -> str | None:
    """What this machine's sandboxes run without, of the seccomp filter and Landlock (one clause; None: nothing)."""
    missing = []
    program, why = syscalls.program()
    if why is not None:
        missing.append(f"{'part of ' if program else ''}its seccomp filter ({why})")
    abi = jail.landlock_abi()
    if abi == 0:
        missing.append("Landlock (the kernel has none: Linux 5.13+ with landlock in its lsm= list)")
    missing += [f"Landlock's {what} (Landlock ABI {abi} < {needs}: Linux {kernel}+)"
                for needs, what, kernel in _LANDLOCK_SINCE if 0 < abi < needs]
    return " and without ".join(missing) or None


@functools.lru_cache(maxsize=1)
def warn_missing() -> None:
    """Say once per process, at the start of a run that uses the sandbox, which of its layers this machine lacks."""
    if (missing := missing_layers()) is not None:
        print(f"evenrl: warning: the sandbox runs without {missing}; its namespaces, read-only view, uid and "
              f"rlimits still hold (docs/sandbox.md)", flush=True)
