"""The `evenrl` command: a thin dispatcher to the subcommands' own modules.

    evenrl plan CONFIG [overrides] [--nnodes N --nproc-per-node P] [--json] [--fit]
    evenrl train CONFIG [overrides] [--nproc-per-node P] [--resume]
    evenrl sft CONFIG [overrides]
    evenrl report RUN_DIR
    evenrl demo

Subcommand modules are imported only when chosen, so `evenrl plan` never imports torch.
Every user error (evenrl.errors.UsageError) becomes one line on stderr and exit code 2; a run that had to stop
(evenrl.errors.RunStopped) one line and exit code 3. In a worker started by torch's elastic agent the same line goes
to the agent's error file, so the launcher's summary shows it.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import signal
import sys
import time

from evenrl.errors import Interrupted, RunStopped, UsageError

# subcommand -> (module, one-line help). Each module exposes main(argv: list[str]) -> int.
COMMANDS = {
    "plan": ("evenrl.planner.cli", "check a config against a cluster layout before loading anything"),
    "train": ("evenrl.train.launch", "RL post-training (GRPO family) on 1..N processes"),
    "sft": ("evenrl.train.launch", "supervised warm start on the same data core and launcher"),
    "report": ("evenrl.report", "plot a run directory's metrics to PNG"),
    "demo": ("evenrl.demo", "tiny model, synthetic task: SFT warm start then GRPO, on CPU"),
}


def _usage() -> str:
    lines = ["usage: evenrl COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<8}{help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `evenrl COMMAND --help` for a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from evenrl import __version__

        print(f"evenrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"evenrl: error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        if COMMANDS[name][0] == "evenrl.train.launch":
            return int(module.main([name, *rest], worker) or 0)
        return int(module.main(rest) or 0)
    except UsageError as e:
        return _fail(f"evenrl {name}: error: {e}", 2)
    except RunStopped as e:
        return _fail(f"evenrl {name}: stopped: {e}", 3)
    except Interrupted as e:
        if str(e) and _speaks():
            print(f"evenrl {name}: {signal.Signals(e.signum).name}: {e}; "
                  + (f"continue with: {_command(name, rest, '--resume')}" if e.resumable else
                     f"start again with: {_command(name, rest, '--overwrite')}"), file=sys.stderr, flush=True)
        return 128 + e.signum
    except KeyboardInterrupt:
        if _speaks():
            print(f"evenrl {name}: interrupted", file=sys.stderr)
        return 130


def _speaks() -> bool:
    """One process of a multi-process run speaks for all: rank 0 (or the only one)."""
    return os.environ.get("RANK", "0") == "0"


def _command(name: str, rest: list[str], flag: str) -> str:
    """The command that started this run, with `flag` (--resume or --overwrite) instead of either. A worker of
    evenrl's launcher has the launcher's command (EVENRL_COMMAND); one that torchrun or srun started directly says
    so, since its own arguments are not the launch command."""
    launched = os.environ.get("EVENRL_COMMAND")
    if launched is None and "RANK" in os.environ:
        return f"the same launch command with {flag}"
    words = shlex.split(launched) if launched else ["evenrl", name, *rest]
    return shlex.join([w for w in words if w not in ("--resume", "--overwrite")] + [flag])


def _fail(line: str, code: int) -> int:
    """The line on stderr; in a worker of torch's elastic agent also in the agent's error file, and there alone under
    evenrl's launcher, which prints each failed rank's line once (evenrl.train.launch)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torch's elastic agent for each worker
    reported = False
    if error_file:
        try:
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
            reported = "EVENRL_COMMAND" in os.environ
        except OSError:
            pass
    if not reported:
        print(line, file=sys.stderr, flush=True)
    return code


def run() -> None:
    """The `evenrl` program (its console script, `python -m evenrl` and `python -m evenrl.cli`, as every worker of
    evenrl's launcher runs): main(), then the process ends as Python's exit would end it (non-daemon threads joined,
    atexit handlers run, stdio flushed) but without the interpreter's finalization, which tears torch's,
    transformers' and sympy's modules down object by object: 2-5 s of one core per process on a 2-core machine,
    with no system call in it, that a launcher waits for before it returns. Where a child process is still alive
    after the atexit handlers (an engine's own process that a finalizer would stop), the normal exit. main() is
    what tests call in-process; this is for the program alone. A broken or closed stdout or stderr never ends it
    (evenrl.train.stdio)."""
    from evenrl.train import stdio

    stdio.install(speak=sys.argv[1:2] in (["train"], ["sft"], ["demo"]))  # a run notes it; `plan | head` is quiet
    code = main()
    _exit_hooks()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)  # reaps a child that has exited; 0: one is still running
        except ChildProcessError:  # none left
            break
        if pid == 0:
            raise SystemExit(code)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def worker(argv: list[str]) -> None:
    """One worker of evenrl's launcher, in a process that torch's elastic agent forked from the launcher's fork
    server (evenrl.train.launch): main(argv) in a session of its own, as the agent's binary workers are (a terminal's
    Ctrl-C reaches the launcher, which passes it on), ended as run() ends the program. The agent reads a worker's
    success from its return and its failure from the exit code raised here and the error file _fail wrote; the
    process then exits without finalization (multiprocessing's). Ctrl-C's handler is Python's again (the fork server
    ignores and blocks SIGINT, and its children inherit that) and stdout and stderr are guarded (evenrl.train.stdio)."""
    from evenrl.train import stdio

    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # the fork server's mask (launch._start_fork_server)
    stdio.install()
    code = main(argv)
    _exit_hooks()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == 3:
        # stopped, often because a peer died or hung: the agent reports the first failed worker it sees (it looks
        # every 0.1 s), and the peer that failed first is the one to name; this rank's line is read from its error
        # file (evenrl.train.launch._report_failures)
        time.sleep(0.5)
    if code:
        raise SystemExit(code)


def _exit_hooks() -> None:
    """What the interpreter's exit does before finalization: threading's own exit hooks (a ThreadPoolExecutor's,
    which tell its workers to stop: joining those workers without them waits forever, as a colocated vLLM engine's
    did), every non-daemon thread joined, then the atexit handlers; each runs once (a normal exit after it skips
    them)."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()


if __name__ == "__main__":
    run()
