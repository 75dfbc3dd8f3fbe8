"""`python -m evenrl.cli ARGS` for the end-to-end tests, forked from a server process that has imported what every
evenrl process imports (torch, transformers' common model classes, the training loop, the CLI), instead of started
as a new Python that imports them again: ~3 s of a core for each of the suite's ~130 one-process runs and ~1.5 s
for each launcher of its ~160 multi-process runs. The product does the same for its workers (evenrl.train.launch
forks them from a fork server that imported evenrl.train.preload); this is that, one level up, for the tests alone.

What a child gets is what `python -m evenrl.cli ARGS` gets: evenrl.cli run as __main__ (runpy, as -m does), its
argv, the caller's working directory, environment, CPU affinity and output files, stdin from /dev/null, a session
of its own, and sys.path as that environment's PYTHONPATH makes it. What differs: modules the server imported are
not imported again (their import-time warnings are not printed, and an environment variable read at import is the
server's). So a job is forked only when its environment equals the server's but for PYTHONPATH, and no directory
on its PYTHONPATH holds a sitecustomize (tests/faults injects faults so); any other job starts a new Python
(tests/e2e.py Job). tests/test_warm_start.py checks a forked run against a started one.

Protocol, one Unix-socket connection per job: the client sends a JSON request and its stdout and stderr file
descriptors; the server forks, answers the child's pid, then, when the child has exited, its wait status."""

from __future__ import annotations

import array
import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from pathlib import Path

TESTS = Path(__file__).resolve().parent
_SERVER: dict = {}  # this test process's server: {"proc": Popen, "path": socket path, "env": its environment}
_STARTUP: dict = {}  # in the server: its warning filters and signal handlers once imported (a new Python's)


class ForkedJob:
    """The part of subprocess.Popen that tests/e2e.py's Job uses (pid, poll, wait, returncode), for a child of the
    server: its exit status comes over the job's connection."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int):
        self.args, self.pid, self.returncode, self._conn, self._buf = args, pid, None, conn, b""

    def _read(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return
            data = self._conn.recv(64)
            if not data:  # the server died before the child: what the child did is unknown
                self.returncode = -9
                self._conn.close()
                return
            self._buf += data
            if b"\n" in self._buf:
                self.returncode = os.waitstatus_to_exitcode(int(self._buf.split(b"\n")[0]))
                self._conn.close()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def can_fork(env: dict) -> bool:
    """Whether a job with this environment may be forked from the server (see the module's docstring)."""
    base = _SERVER.get("env") or _server_env()
    if {k: v for k, v in env.items() if k != "PYTHONPATH"} != {k: v for k, v in base.items() if k != "PYTHONPATH"}:
        return False
    return not any((Path(d) / name).exists() for d in env.get("PYTHONPATH", "").split(os.pathsep) if d
                   for name in ("sitecustomize.py", "usercustomize.py"))


def start(args: list[str], env: dict, stdout, stderr) -> ForkedJob:
    """Fork `python -m evenrl.cli ARGS` (args without the `python -m evenrl.cli`) from this process's server."""
    path = _server()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {"argv": list(args), "cwd": os.getcwd(), "pythonpath": env.get("PYTHONPATH", ""),
               "cpus": sorted(os.sched_getaffinity(0))}
    socket.send_fds(conn, [json.dumps(request).encode()], [stdout.fileno(), stderr.fileno()])
    line = b""
    while not line.endswith(b"\n"):
        data = conn.recv(64)
        if not data:
            raise RuntimeError(f"tests/warm_start.py's server did not fork the job; its log: {_SERVER['log']}")
        line += data
    return ForkedJob([sys.executable, "-m", "evenrl.cli", *args], conn, int(line))


def _server_env() -> dict:
    from e2e import ENV

    return dict(ENV)


def _server() -> str:
    """This test process's server (started on the first job, stopped when this process exits): its socket."""
    if _SERVER and _SERVER["proc"].poll() is None:
        return _SERVER["path"]
    folder = tempfile.mkdtemp(prefix="evenrl-warm-")
    path, log = os.path.join(folder, "socket"), os.path.join(folder, "server.log")
    env = _server_env()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import warm_start; warm_start.serve()", path],
                                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                cwd=str(TESTS), start_new_session=True)
    _SERVER.update(proc=proc, path=path, env=env, log=log)
    atexit.register(shutil.rmtree, folder, True)  # runs after the kill below (atexit: last in, first out)
    atexit.register(proc.kill)
    while not os.path.exists(path + ".ready"):
        if proc.poll() is not None:
            raise RuntimeError(f"tests/warm_start.py's server exited {proc.returncode}: {Path(log).read_text()}")
        time.sleep(0.02)
    return path


def serve() -> None:
    """The server (`python -c 'import warm_start; warm_start.serve()' SOCKET`): import, then fork a child for each
    request; single-threaded, so that a fork copies no other thread's half-held lock. Exits with its parent."""
    import evenrl.cli  # noqa: F401
    import evenrl.train.preload  # noqa: F401

    _STARTUP["filters"] = list(warnings.filters)  # what a new Python has once it imported the same
    _STARTUP["handlers"] = {s: signal.getsignal(s) for s in signal.valid_signals()
                            if s not in (signal.SIGKILL, signal.SIGSTOP)}
    path, parent = sys.argv[1], os.getppid()
    base = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    Path(path + ".ready").touch()
    waiting: dict[int, socket.socket] = {}  # child pid -> its job's connection
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for c in waiting.values():
                    c.close()
                _child(json.loads(msg), fds, base)  # never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(b"%d\n" % pid)
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(b"%d\n" % status)
                except OSError:  # the test stopped waiting
                    pass
                conn.close()


def _child(request: dict, fds: list[int], base: list[str]) -> None:
    """In the forked child: become `python -m evenrl.cli ARGV` as started from the caller, run it, and end as that
    program ends (evenrl.cli.run exits without finalization; where it raises SystemExit, the interpreter's own
    exit, finalization included)."""
    import runpy

    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.sched_setaffinity(0, request["cpus"])
        extra = [p for p in request["pythonpath"].split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = request["pythonpath"]
        sys.path[:] = [os.getcwd(), *extra, *base]
        sys.argv = [str(Path(sys.modules.pop("evenrl.cli").__file__)), *request["argv"]]  # -m imports it anew
        _fork_the_fork_server()
        runpy.run_module("evenrl.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            raise SystemExit(code)  # noqa: B012  (the child must end here, never run the server's loop)


def _fork_the_fork_server() -> None:
    """In a child: multiprocessing's fork server (which a multi-process run's launcher starts, evenrl.train.launch)
    forked from this child instead of started as a new Python that imports evenrl.train.preload again, which this
    child has imported (measured on a 3-process run of the tests' config: 17.1 -> 11.0 s of CPU, 13.5 -> 8.2 s wall;
    the suite has ~160 multi-process runs). What the new Python has is
    made so: its own `__main__` (a worker imports the launcher's main module anew, as __mp_main__), the warning
    filters and signal handlers a new Python has once it imported the same modules, no file descriptor but its
    standard ones, the listener and the alive pipe. Where the launcher has started a thread by then (a fork copies
    no other thread) or asks for other modules, the fork server starts as multiprocessing starts it."""
    from multiprocessing import connection, forkserver, resource_tracker

    server = forkserver._forkserver
    started = server.ensure_running

    def ensure_running() -> None:
        if (server._forkserver_pid is not None or threading.active_count() > 1
                or server._preload_modules != ["evenrl.train.preload"]):
            return started()
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    keep = {0, 1, 2, listener.fileno(), alive_r}
                    for fd in map(int, os.listdir("/proc/self/fd")):
                        if fd not in keep:
                            try:
                                os.close(fd)
                            except OSError:  # the listing's own descriptor, closed by now
                                pass
                    sys.modules["__main__"] = types.ModuleType("__main__")
                    warnings.filters[:] = _STARTUP["filters"]
                    warnings._filters_mutated()
                    for sig, handler in _STARTUP["handlers"].items():
                        if handler is not None:
                            signal.signal(sig, handler)
                    forkserver.main(listener.fileno(), alive_r, server._preload_modules)
                    code = 0  # main returns only by SystemExit, when no client is left
                except SystemExit:
                    code = 0
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(code)  # never the launcher's exit handlers
            os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid

    server.ensure_running = forkserver.ensure_running = ensure_running
