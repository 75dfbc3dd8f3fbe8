"""Hostile model-written code sent the way a policy sends it (a `<tool_call>` to the built-in `python` tool): every
attempt to reach outside the sandbox fails or is killed in time, and nothing it started survives the call."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time

import pytest

from evenrl.envs import ToolEnv
from evenrl.envs.tools import python
from evenrl.isolation import code, jail, sandbox, syscalls


class Coder(ToolEnv):
    tools = [python]

    def score(self, answer: str) -> float:
        return 0.0


def tool_call(source: str) -> str:
    """What the tool answers to a reply calling `python` with `source`, parsed and dispatched as in training."""
    reply = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": source}}) + "</tool_call>"
    step = Coder().step(reply)
    assert step.tool_calls == 1
    return step.messages[0]["content"]


def gone(marker: str, within_s: float = 5.0) -> bool:
    """Whether every process with `marker` in its command line has ended within `within_s`: a SIGKILL'd namespace
    takes a moment to be torn down by the kernel (the check right after the kill raced it under load in CI)."""
    deadline = time.monotonic() + within_s
    while running_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running_with(marker) == []


def running_with(marker: str) -> list[int]:
    """Processes on this machine whose command line contains `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


needs_sandbox = pytest.mark.skipif(sandbox.unavailable() is not None, reason=f"{sandbox.unavailable()}")
needs_seccomp = pytest.mark.skipif(not syscalls.program()[0], reason=f"{syscalls.program()[1]}")
needs_landlock = pytest.mark.skipif(jail.landlock_abi() < 4, reason="Landlock ABI < 4 (Linux 6.7+)")


@needs_sandbox
def test_code_cannot_read_write_or_signal_outside_its_sandbox(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("checkpoint")
    secret.chmod(0o600)
    assert "Permission denied" in tool_call("print(open('/etc/shadow').read())")  # root-only: another user
    assert "No such file" in tool_call(f"print(open({str(secret)!r}).read())")  # the trainer's files: not there
    for target in (tmp_path / "escape.txt", "/etc/evenrl-escape", "/usr/evenrl-escape"):
        answer = tool_call(f"open({str(target)!r}, 'w').write('x')")
        assert "Read-only file system" in answer or "No such file" in answer  # under /tmp: the sandbox's own
        assert not os.path.exists(target)
    assert tool_call("open('/tmp/scratch', 'w').write('x'); print(open('/tmp/scratch').read())") == "x\n"
    assert int(tool_call("import os; print(os.getuid())")) not in (0, os.getuid())
    outside = subprocess.Popen(["sleep", "60"])
    try:
        answer = tool_call(f"import os, signal; os.kill({outside.pid}, signal.SIGKILL)")
        assert "ProcessLookupError" in answer
        seen = tool_call("import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
        assert seen == "2\n"  # itself and the sandbox's PID 1
        time.sleep(0.1)
        assert outside.poll() is None  # still running
    finally:
        outside.kill()
        outside.wait()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        answer = tool_call(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert ("Permission denied" if jail.landlock_abi() >= 4 else "unreachable") in answer  # Landlock, else no route


@needs_sandbox
@needs_seccomp
def test_every_system_call_the_filter_refuses_fails_and_ordinary_code_still_runs():
    """Each refused call (zero arguments) fails with EPERM, clone3 with ENOSYS (libc falls back to clone), clone with a
    namespace flag with EPERM; a call through another ABI (x32) kills the code and says so; threads, fork,
    subprocess and numpy, whose threads and processes come from clone without namespace flags, run as before."""
    import pyseccomp

    numbers = {n: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) for n in syscalls.names()}
    numbers = {n: nr for n, nr in numbers.items() if nr >= 0}  # negative: not a call of this architecture
    assert "ptrace" in numbers and "io_uring_setup" in numbers and "bpf" in numbers
    clone = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "clone")
    source = (f"import ctypes, os, subprocess, sys, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              f"def errno(nr, *args):\n    ctypes.set_errno(0)\n    done = libc.syscall(nr, *args)\n"
              f"    return -1 if done != -1 else ctypes.get_errno()\n"
              f"print({{name: errno(nr, 0, 0, 0, 0, 0, 0) for name, nr in {numbers!r}.items()}})\n"
              f"print(errno({clone}, 0x10000000 | 17, 0, 0, 0, 0), errno({clone}, 0x40000000 | 17, 0, 0, 0, 0))\n"
              f"out = []\nt = threading.Thread(target=out.append, args=(1,))\nt.start()\nt.join()\n"
              f"pid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
              f"run = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True)\n"
              f"print(out, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), run.stdout.strip())\n"
              f"try:\n    import numpy\n    print(int(numpy.arange(10).sum()))\nexcept ImportError:\n    print(45)\n")
    result = code.run_code(source, timeout_s=10)
    assert result.status == "ok", result
    refused, cloned, ordinary, summed = result.output.splitlines()
    assert eval(refused) == {n: (38 if n == "clone3" else 1) for n in numbers}  # ENOSYS, EPERM
    assert cloned == "1 1" and ordinary == "[1] 7 42" and summed == "45"
    if platform.machine() == "x86_64":  # the x32 ABI: getpid with the x32 bit, a different architecture to seccomp
        x32 = code.run_code("import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39); print('not reached')")
        assert x32.status == "blocked" and "another ABI" in x32.output and "not reached" not in x32.output


@needs_sandbox
@needs_landlock
def test_landlock_refuses_writes_the_mount_view_allows_and_tcp():
    """A process that makes itself dumpable again owns its /proc files, which the mount view lets it write (checked
    without Landlock: /proc/self/mem opens read-write); Landlock allows writing under /tmp only. TCP bind and
    connect are refused before the network namespace is reached."""
    source = ("import ctypes, socket\nctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE\n"
              "for name in ('/proc/self/mem', '/proc/self/comm'):\n    try:\n        open(name, 'r+b')\n"
              "        print(name, 'opened')\n    except PermissionError as e:\n        print(name, e.strerror)\n"
              "for act in (lambda s: s.bind(('127.0.0.1', 0)), lambda s: s.connect(('127.0.0.1', 9))):\n"
              "    try:\n        act(socket.socket())\n    except OSError as e:\n        print('tcp', e.strerror)\n"
              "open('/tmp/f', 'w').write('kept')\nprint(open('/tmp/f').read())")
    result = code.run_code(source)
    assert result.output.splitlines() == ["/proc/self/mem Permission denied", "/proc/self/comm Permission denied",
                                          "tcp Permission denied", "tcp Permission denied", "kept"], result


@needs_sandbox
@needs_seccomp
def test_a_machine_without_pyseccomp_or_landlock_runs_the_sandbox_and_says_so_once(monkeypatch, capsys):
    """The sandbox runs with the layers it has and the run says once which it lacks and what to install."""
    import pyseccomp

    keyctl = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "keyctl")
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # import pyseccomp raises ImportError
    monkeypatch.setattr(jail, "landlock_abi", lambda: 0)
    for cached in (syscalls.program, sandbox.missing_layers, sandbox.warn_missing):
        cached.cache_clear()
    try:
        sandbox.warn_missing()
        sandbox.warn_missing()
        said = capsys.readouterr().out
        assert said.count("\n") == 1 and said.startswith("evenrl: warning: the sandbox runs without its seccomp")
        assert "pip install pyseccomp" in said and "Landlock (the kernel has none" in said
        result = code.run_code("import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                               f"print(libc.syscall({keyctl}, 0, -3, 0) >= 0 or ctypes.get_errno() != 1, os.getuid())\n"
                               "socket.create_connection(('127.0.0.1', 9), timeout=2)")
        unfiltered, uid = result.output.splitlines()[0].split()
        assert unfiltered == "True" and int(uid) not in (0, os.getuid()) and "unreachable" in result.output
    finally:
        for cached in (syscalls.program, sandbox.missing_layers, sandbox.warn_missing):
            cached.cache_clear()


@needs_sandbox
def test_nothing_the_code_starts_survives_the_call():
    """A daemon (double fork, setsid), a fork bomb and code that closes its pipes and sleeps."""
    marker = f"{time.time_ns() % 10**9}.25"
    daemon = (f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\nprint('started')")
    assert tool_call(daemon) == "started\n"
    bomb = (f"import os\nn = 0\nfor i in range(200):\n    try:\n        pid = os.fork()\n"
            f"    except OSError:\n        break\n"
            f"    if pid == 0:\n        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    n += 1\nprint(n)")
    assert int(tool_call(bomb)) < 200  # RLIMIT_NPROC stopped it
    started = time.monotonic()
    result = code.run_code("import os, time; os.close(1); os.close(2); time.sleep(30)", timeout_s=1)
    assert result.status == "timeout" and time.monotonic() - started < 3
    assert gone(marker)


def test_sandbox_none_runs_the_code_unsandboxed_and_says_so(monkeypatch):
    monkeypatch.setattr(code, "MODE", "none")
    result = code.run_code("import os; print(os.getuid())")
    assert result == ("ok", f"{os.getuid()}\n", "none")


def test_a_machine_without_unshare_refuses_in_one_line(monkeypatch):
    monkeypatch.setattr(code, "MODE", code.MODE)  # EnvSession sets it for the process: restored after
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox.unavailable.cache_clear()
    try:
        result = code.run_code("print(1)")
        assert result.status == "refused" and "\n" not in result.output
        assert "`unshare` is not installed" in result.output and "rewards.sandbox: none" in result.output
        # a run whose environment offers the tool stops before its first step, in the same one line
        from evenrl.config import RunConfig
        from evenrl.envs.session import EnvSession
        from evenrl.errors import UsageError

        with pytest.raises(UsageError, match="^rewards.sandbox: model-written code runs only in a sandbox"):
            EnvSession("calculator", RunConfig().rewards, [python])
        EnvSession("calculator", RunConfig().rewards, [])  # no python tool: nothing to refuse
        EnvSession("calculator", RunConfig.model_validate({"rewards": {"sandbox": "none"}}).rewards, [python])
    finally:
        sandbox.unavailable.cache_clear()


def test_user_modules_that_exit_parse_argv_raise_or_hang_at_import_are_one_line(tmp_path, monkeypatch):
    """rollout.env and rewards name user modules; importing one that ends the interpreter, prints argparse's usage,
    is interrupted or hangs becomes one UsageError line naming the field and the module."""
    from evenrl.envs.registry import resolve as resolve_env
    from evenrl.errors import UsageError
    from evenrl.rewards import registry

    modules = {
        "exits_at_import": ("import sys\nsys.exit(0)\n", "called sys.exit(0)"),
        "script_with_argv": ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--data', required=True)"
                             "\np.parse_args()\n", "the following arguments are required: --data"),
        "interrupted_at_import": ("raise KeyboardInterrupt\n", "interrupted"),
        "hangs_at_import": ("import time\ntime.sleep(60)\n", "took longer than 0.5 s"),
    }
    for name, (source, _) in modules.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "IMPORT_TIMEOUT_S", 0.5)
    for name, (_, needle) in modules.items():
        for load, field in ((resolve_env, "rollout.env"), (registry.resolve, "reward")):
            sys.modules.pop(name, None)
            with pytest.raises(UsageError) as caught:
                load(f"{name}:thing")
            message = str(caught.value)
            assert message.startswith(f"{field}: ") and name in message and needle in message, message
            assert "\n" not in message and "usage:" not in message


@needs_sandbox
@pytest.mark.parametrize("mode", ["tools", "all"])
def test_environment_steps_leave_no_process_behind(mode, monkeypatch):
    """Steps that fork 200 children escaping their process group, then return, hang, or swallow their time limit:
    each step ends within its limit (the last one killed from outside) and nothing it started survives; in the
    sandbox (rewards.sandbox: all) the process cap also stops the forks."""
    from evenrl.config import RunConfig
    from evenrl.envs.session import EnvSession

    from evenrl.isolation import pool

    marker = f"{time.time_ns() % 10**9}.5"
    row = {"prompt": "p"}
    monkeypatch.setattr(pool, "WORKER_PROCESSES", 64)  # the sandbox's cap (RLIMIT_NPROC), small enough to reach
    monkeypatch.setattr(code, "MODE", code.MODE)  # EnvSession sets it for the process: restored after

    def session(timeout_s):
        rewards = RunConfig.model_validate({"rewards": {"timeout_s": timeout_s, "sandbox": mode}}).rewards
        return EnvSession("toy_envs:Spawner", rewards)

    (kind, value), = session(10.0).steps([(None, row, 0, f"fork 200 {marker}")])
    assert kind == "ok", value
    step = value[1]
    # a root trainer's workers are exempt from RLIMIT_NPROC (uid 0); the sandbox's unprivileged uid is not
    assert int(step[0][0]["content"]) == 200 if mode == "tools" else int(step[0][0]["content"]) < 64
    started = time.monotonic()
    results = session(0.5).steps([(None, row, 1, f"hang 5 {marker}"), (None, row, 2, f"swallow 5 {marker}")])
    assert [kind for kind, _ in results] == ["timeout", "timeout"], results
    assert "worker killed" in results[1][1] and time.monotonic() - started < 5
    assert gone(marker)


@needs_sandbox
def test_orphans_of_each_call_are_reaped_so_the_process_cap_holds_step_after_step(monkeypatch):
    """Killed orphans left as zombies would count against the sandbox's RLIMIT_NPROC until no call could fork."""
    from evenrl.isolation import pool
    from evenrl.rewards.pool import score_all
    from toy_rewards import orphans

    monkeypatch.setattr(pool, "WORKER_PROCESSES", 64)
    pool._pool().close()
    for _ in range(3):
        scores, stats = score_all([(orphans, 1.0)], ["40"], [{}], timeout_s=10, sandbox="all")
        assert scores == [40.0] and stats["failures"] == 0
    pool._pool().close()
    assert gone("77.25")


@pytest.mark.parametrize("mode", ["plain", "tools", "all"])
def test_what_a_step_writes_to_its_file_descriptors_is_capped_and_forks_print_nothing(mode, monkeypatch, capfd):
    """An environment step that writes 500 MB straight to file descriptor 1 costs the run's log at most the output
    cap; one that forks 1,000 children and is stopped by its time limit prints no traceback (none from at-fork
    hooks the limit interrupts, none from a child). In every mode of the workers: a plain process (no
    namespaces on the machine), PID and network namespaces of its own (rewards.sandbox: tools), the sandbox (all)."""
    from evenrl.config import RunConfig
    from evenrl.envs.session import EnvSession
    from evenrl.isolation import pool
    from evenrl.isolation.worker import CALL_OUTPUT_CHARS

    if mode != "plain" and sandbox.unavailable() is not None:
        pytest.skip(sandbox.unavailable())
    if mode == "plain":
        monkeypatch.setattr(pool, "_namespaces", lambda: None)
    monkeypatch.setattr(code, "MODE", code.MODE)  # EnvSession sets it for the process: restored after
    pool._pool().close()  # fresh workers, started with this test's file descriptors
    row = {"prompt": "p"}

    marker = f"{time.time_ns() % 10**9}.75"

    def steps(env, timeout_s, reply):
        rewards = RunConfig.model_validate({"rewards": {"timeout_s": timeout_s,
                                                        "sandbox": "all" if mode == "all" else "tools"}}).rewards
        return EnvSession(f"toy_envs:{env}", rewards).steps([(None, row, 0, reply)])

    try:
        (kind, value), = steps("Flood", 30.0, "500")
        assert kind == "ok" and value[1][2] == 1.0, value
        (kind, value), = steps("Spawner", 1.0, f"hang 1000 {marker}")  # forks, then sleeps past the limit
        assert kind == "timeout", value
    finally:
        pool._pool().close()
    if mode == "plain":  # a plain worker cannot end what escapes its process group (docs/rewards.md)
        for pid in running_with(marker):
            os.kill(pid, 9)
    assert gone(marker)
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 4 * CALL_OUTPUT_CHARS, (len(out), len(err), err[-2000:])
    assert "Traceback" not in out + err and "Exception ignored" not in out + err, err[-2000:]


@needs_sandbox
def test_memory_the_cap_cannot_see_is_refused_and_what_it_counts_is_capped(monkeypatch):
    """The 256 MiB cap counts what the code can really hold: shared anonymous memory (mmap MAP_SHARED |
    MAP_ANONYMOUS, which RLIMIT_DATA does not count) fails past it; memory that no process maps (a memfd written
    with write(), SysV shared memory detached after filling) is refused outright; 200 MiB of ordinary memory, and
    numpy with 100 MiB, still work."""
    hold_shared = ("import mmap\nm = mmap.mmap(-1, 448 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)\n"
                   "for i in range(0, len(m), 4096):\n    m[i] = 1\nprint('held 448 MiB')")
    shared = tool_call(hold_shared)
    assert "held" not in shared and "Cannot allocate memory" in shared, shared
    monkeypatch.setattr(code, "MODE", "none")  # unsandboxed, the same cap
    assert "Cannot allocate memory" in tool_call(hold_shared)
    monkeypatch.undo()
    if syscalls.program()[0]:
        memfd = tool_call("import os\nfd = os.memfd_create('x')\nprint('made one')")
        assert "made one" not in memfd and "PermissionError" in memfd, memfd
        sysv = tool_call("import ctypes\nprint('shmget', ctypes.CDLL(None).shmget(0, 1 << 20, 0o1600))")
        assert "shmget -1" in sysv, sysv
    fine = tool_call("b = bytearray(200 << 20)\nprint(len(b) >> 20)")
    assert fine.strip() == "200", fine
    fine = tool_call("import numpy as np\nb = bytearray(100 << 20)\nprint(len(b) >> 20, int(np.ones(1000).sum()))")
    assert fine.strip() == "100 1000", fine  # numpy's import takes ~120 MiB of address space of the 256
