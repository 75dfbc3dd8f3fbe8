"""Hostile model-written code sent the way a policy sends it (a `<tool_call>` to the built-in `python` tool): every
attempt to reach outside the sandbox fails or is killed in time, and nothing it started survives the call."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from evenrl.envs import ToolEnv
from evenrl.envs.tools import python
from evenrl.isolation import code, sandbox


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
        assert "unreachable" in tool_call(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)")


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
