"""Start `evenrl train` / `evenrl sft` on one process, N local processes, or many nodes.

    evenrl train CONFIG [overrides]                          # one process
    evenrl train CONFIG --nproc-per-node 3                   # 3 local processes via torch's elastic agent
    evenrl train CONFIG --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST --master-port 29500
    torchrun --nproc-per-node 3 -m evenrl.cli train CONFIG   # started by torchrun: runs as a worker
    srun -N2 --ntasks-per-node 8 evenrl train CONFIG         # started by Slurm: runs as a worker (MASTER_ADDR needed)

The flags mean what torchrun's do. The agent forks each worker from a server process that imported torch,
transformers and the training code once (multiprocessing's fork server, started before any device is touched):
a worker started as a new Python spends ~5 s of a core importing them. A process that already has a rank
(torchrun, srun) is a worker and never launches again. Restarts use torch's elastic agent (`--max-restarts`); with
gloo they fail on the shared rendezvous store's stale keys unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(pytorch#135712), so the launcher sets it. A restarted worker resumes from the latest checkpoint, so
--max-restarts needs periodic checkpoints (checkpoint.every_steps or every_minutes > 0, as by default).

The launcher speaks for its workers: it checks the config, the run directory and the plan once before starting
any (bad input: one line, exit 2, as on one process); when workers fail it prints each failed rank's own one-line
error, once for a failure they share, and hides torch's launcher banners. Ctrl-C or SIGTERM reaches the workers
through torch's agent: they finish the step, save, and rank 0 prints how to resume (evenrl.train.stopping); the
launcher exits 130 / 143 with them. A worker is sent SIGTERM when its parent dies (Linux: the parent-death
signal; its parent, the fork server, exits when the launcher does), so killing `evenrl train` never leaves workers
running unsupervised: they stop after the step in progress, or at once on a second signal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import uuid
from pathlib import Path
from typing import Callable

from evenrl.distributed.env import read_env
from evenrl.errors import ArgumentParser, UsageError
from evenrl.train import liveness


def _parser(cmd: str) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=f"evenrl {cmd}", description=__doc__.splitlines()[0])
    p.add_argument("config", help="YAML run config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.prompts_per_step=64")
    p.add_argument("--nproc-per-node", "--num-gpus", type=int, default=1, help="processes on this node")
    p.add_argument("--nnodes", "--num-nodes", type=int, default=1, help="number of nodes")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (0..nnodes-1)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    p.add_argument("--master-port", type=int, default=29500, help="port on node 0")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole worker group on failure")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in log.run_dir")
    if cmd == "train":
        p.add_argument("--rollout-devices", type=int, default=None,
                       help="the last N processes only generate (parallel.rollout_devices)")
    p.add_argument("--collective-timeout-s", type=float, default=None,
                   help="seconds a rank waits for a stopped peer (parallel.collective_timeout_s)")
    return p


def _is_worker() -> bool:
    """Started by torchrun, or one of several Slurm tasks (`launched` in evenrl.distributed.env). A single Slurm
    task, a shell in an allocation (salloc) or a batch script without --ntasks launches instead."""
    e = read_env()
    return e.launched and (e.source == "torchrun" or e.world > 1)


def main(argv: list[str], worker: Callable[[list[str]], None]) -> int:
    """`evenrl train|sft ARGS` (argv[0] is the command); `worker(argv)` runs it in each process the launcher starts
    (evenrl.cli.worker: the CLI's own error lines and exit codes, handed down so that this layer need not import the
    CLI above it)."""
    cmd, rest = argv[0], argv[1:]
    args = _parser(cmd).parse_intermixed_args(rest)  # flags may come between overrides
    for name in ("nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank: got {args.node_rank}; must be in 0..{args.nnodes - 1}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts: got {args.max_restarts}; must be >= 0")
    if args.collective_timeout_s is not None:
        args.overrides.append(f"parallel.collective_timeout_s={args.collective_timeout_s}")
    if getattr(args, "rollout_devices", None) is not None:
        args.overrides.append(f"parallel.rollout_devices={args.rollout_devices}")
    if cmd == "sft" and args.resume:
        raise UsageError("--resume: evenrl sft has no checkpoints to resume from; run it again (with --overwrite)")
    if cmd == "train" and args.resume and _already_finished(args):
        return 0
    if _is_worker():
        _die_with_parent()
        liveness.beat()  # a worker of evenrl's launcher: its heartbeat and last words (elsewhere nothing)
        return run_worker(cmd, args)
    if args.nproc_per_node == 1 and args.nnodes == 1:
        return run_worker(cmd, args)
    return _launch(cmd, args, argv, worker)


def _already_finished(args: argparse.Namespace) -> bool:
    """--resume of a run that has done its train.steps: say so (rank 0) instead of planning and loading for nothing."""
    from evenrl.config import load_config
    from evenrl.train import rundir

    cfg = load_config(args.config, args.overrides)
    step = rundir.finished_step(cfg.log.run_dir, cfg.train.steps)
    if step is not None and os.environ.get("RANK", "0") == "0":
        print(f"evenrl train: {cfg.log.run_dir} has finished: its checkpoint is at step {step} of train.steps="
              f"{cfg.train.steps} and the model is in {Path(cfg.log.run_dir) / 'final'}; nothing to do (to train "
              f"longer: --resume train.steps=N with N > {step})", flush=True)
    return step is not None


def run_worker(cmd: str, args: argparse.Namespace) -> int:
    from evenrl.config import load_config
    from evenrl.data.hub import fetch_datasets
    from evenrl.models.hub import resolve_models

    cfg = resolve_models(load_config(args.config, args.overrides), download=True)
    fetch_datasets(cfg)  # hub dataset ids into the datasets cache (the launcher's workers find them there)
    if cmd == "train":
        from evenrl.train.loop import train

        train(cfg, resume=args.resume, overwrite=args.overwrite, restarted=_restarted())
    else:
        from evenrl.train.sft import sft

        sft(cfg, overwrite=args.overwrite or _restarted())  # sft has no checkpoints: a restart starts over
    return 0


def _die_with_parent() -> None:
    """Linux: this worker gets SIGTERM when its parent (the launcher's fork server, or torchrun's agent) dies, even
    by SIGKILL, instead of training on unsupervised. Elsewhere a no-op."""
    from multiprocessing import forkserver

    # The fork server exits when no process holds the write end of its "alive" pipe, and gives one to each process
    # it forks (so that they could use it in turn): while this worker held it, a killed launcher would leave the
    # server, and so this worker, running
    alive = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect (PID 1 may be the launcher itself)
        os._exit(1)


def _restarted() -> bool:
    """A worker that torchrun's elastic agent started again after a failure."""
    e = read_env()
    return e.source == "torchrun" and e.restart_count > 0


def _launch(cmd: str, args: argparse.Namespace, argv: list[str], worker: Callable[[list[str]], None]) -> int:
    # Validate the config, the run directory and the plan once, before starting N processes that would all fail the
    # same way: the launcher speaks for them (one line, exit 2), in the time `evenrl plan` takes.
    from evenrl.config import load_config
    from evenrl.data.hub import fetch_datasets
    from evenrl.models.hub import resolve_models
    from evenrl.train import rundir
    from evenrl.config.compatibility import SFT_RULES
    from evenrl.planner.compatibility import check_run
    from evenrl.train.preflight import launch_layout, preflight

    cfg = resolve_models(load_config(args.config, args.overrides), download=True)  # downloaded once, here
    rundir.check(cfg.log.run_dir, resume=args.resume, overwrite=args.overwrite)
    fetch_datasets(cfg)  # after the run directory's check: a bad one fails before a download
    if args.max_restarts > 0 and cmd == "train" and not (cfg.checkpoint.every_steps or cfg.checkpoint.every_minutes):
        raise UsageError(f"--max-restarts {args.max_restarts}: checkpoint.every_steps and checkpoint.every_minutes are "
                         "0, so a restarted run would start over from step 1; set checkpoint.every_steps (e.g. 10)")
    if cmd == "train":
        preflight(cfg, launch_layout(args.nnodes, args.nproc_per_node))
    elif cmd == "sft":  # no plan: config.compatibility's rows about the model's split
        check_run(cfg, rollout_devices=0, rules=SFT_RULES)
    if args.resume:  # the checkpoint's small files, as every rank would read them
        from evenrl.train import checkpoint

        checkpoint.read_state(checkpoint.latest(Path(cfg.log.run_dir) / "checkpoints"))
    # every worker's environment, which the fork server takes when it starts and its workers from it
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # torchrun sets 1 thread per process when nothing is set, with a warning on every launch; the same, silently
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from evenrl.train import determinism

    determinism.environment(cfg)  # bitwise: the variables CUDA and vLLM read when they start, for every worker
    os.environ["EVENRL_COMMAND"] = shlex.join(["evenrl", *argv])  # the workers' resume hint names this command
    watch = liveness.Watch(cfg.parallel.liveness_timeout_s)
    os.environ.update(watch.env())
    try:
        code = _launch_workers(cmd, args, worker, watch)
    finally:
        watch.close()
    if code == 0:
        _stop_fork_server()
    return code


def _launch_workers(cmd: str, args: argparse.Namespace, worker: Callable[[list[str]], None],
                    watch: liveness.Watch) -> int:
    server = _start_fork_server()
    watch.start(server)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    # torch's per-launch and per-failure banners (each module's logger has its own level): ours are below
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher",
                            "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    torchrun = [
        f"--nproc-per-node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
        f"--max-restarts={args.max_restarts}",
    ]  # the agent gives its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30) s to stop on a signal: see reliability.md
    if args.nnodes == 1:
        torchrun.append("--standalone")
    else:
        torchrun += [f"--node-rank={args.node_rank}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={args.master_addr}:{args.master_port}"]
    targs = parse_args([*torchrun, "--start-method=forkserver", "-m", "evenrl.cli"])
    if targs.standalone:  # what torchrun's run() does for --standalone
        targs.rdzv_backend, targs.rdzv_endpoint, targs.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(targs)
    worker_argv = [cmd, args.config, *args.overrides] + (["--resume"] if args.resume else []) \
        + (["--overwrite"] if args.overwrite else [])
    try:
        elastic_launch(config, entrypoint=worker)(worker_argv)
    except SignalException as e:  # the workers were sent the same signal, stopped and saved; rank 0 said so
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        return _report_failures(cmd, e.failures, watch)
    return 0


def _start_fork_server() -> int | None:
    """Start multiprocessing's fork server, from which torch's agent forks each worker (one that imported the
    training code once, started fresh and before any device is touched, which CUDA needs: a worker started as
    `python -m evenrl.cli` spends ~5 s of a core importing torch and transformers, every one of them). Started now,
    it imports while this process imports torch and the agent meets its peers. Returns its pid.

    It starts with SIGINT ignored (Python keeps a disposition its parent ignored): it shares the terminal's process
    group while it imports, and a Ctrl-C then would print its KeyboardInterrupt traceback; its workers take Python's
    handler back (evenrl.cli.worker). Its resource tracker, started with it, unlinks what a killed launcher leaves
    (the agent's semaphores) without warning about each."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(["evenrl.train.preload"])
    quiet = "ignore:resource_tracker:UserWarning"  # each process started now gets it as -W (multiprocessing.util)
    sys.warnoptions.append(quiet)
    # blocked as well as ignored: Linux keeps a signal blocked in the thread it is sent to pending even while it is
    # ignored, so a Ctrl-C that comes while the server starts reaches this thread's handler once it is unblocked.
    # Another thread of this process (a library's) may still take it while it is ignored: a Ctrl-C in these few
    # milliseconds can be lost (press it again). The server and its workers inherit the mask: cli.worker unblocks.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.warnoptions.remove(quiet)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _stop_fork_server() -> None:
    """Once every worker has exited 0: the fork server and its resource tracker stopped now, by closing the pipes
    they wait on, so that this process has no child left when evenrl.cli.run ends it, and it ends without the
    interpreter's finalization (a live child makes run() take the normal exit: measured 2 s of a core after the
    workers' last line, in the tests' launchers, which have transformers imported). Not after a failure or a
    signal: the server's exit sends its children their parent-death signal, and a worker may still be saving."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        pid = server._forkserver_pid
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
        if pid is not None:
            os.waitpid(pid, 0)
    resource_tracker._resource_tracker._stop()


def _report_failures(cmd: str, failures: dict, watch: liveness.Watch | None = None) -> int:
    """Each failed rank's own line (the worker writes it to the agent's error file), once for ranks that failed
    the same way, not torch's banner; a rank without one is explained (`_why`). The exit code is the workers' when
    those that exited agree (2: bad input, 3: stopped); ranks the agent stopped after the first failure have a
    negative one. Torch's agent reports the first failed worker it sees (a forked worker's); the other ranks of this
    node that wrote their line are read from their error files beside its."""
    lines: dict[str, list[int]] = {}
    codes = set()
    shown = set()
    for rank, f in sorted(failures.items()):
        if f.exitcode > 0:  # not one the agent stopped after the first failure
            codes.add(f.exitcode)
        why, stack = _why(rank, f, watch)
        if stack and stack not in shown:  # a Python exception's traceback, as one process would have printed it
            shown.add(stack)
            print(stack.rstrip(), file=sys.stderr)
        lines.setdefault(why, []).append(rank)
    for rank, why in _lines_beside(failures, watch).items():
        lines.setdefault(why, []).append(rank)
    for why, ranks in lines.items():
        if why.startswith("evenrl") and len(lines) == 1 and codes == {2}:
            print(why, file=sys.stderr)  # bad input, the same on every rank: as one process would have said it
        else:
            print(f"evenrl {cmd}: rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} failed: {why}",
                  file=sys.stderr)
    return codes.pop() if len(codes) == 1 and codes <= {2, 3} else 1


def _why(rank: int, f, watch: liveness.Watch | None) -> tuple[str, str]:
    """(why rank `rank` failed, a Python traceback to print above the lines or ''): the launcher's own reason for a
    rank it ended (silent), the rank's evenrl line, a Python exception that escaped it (torch's agent keeps its
    traceback in the error file and prints nothing), or, for a rank that died without one (os._exit, a C
    library's exit(), a signal), its exit code or signal with the phase and the last lines from its heartbeat's
    record (evenrl.train.liveness)."""
    if watch is not None and rank in watch.silent:
        return watch.silent[rank], ""
    message = f.message
    if isinstance(message, str) and message.startswith("evenrl"):
        return message, ""
    record = (watch.record(rank) if watch is not None else None) or {}
    where = f" in {record['phase']}" if isinstance(record.get("phase"), str) else ""
    if isinstance(message, dict) and isinstance(message.get("message"), str):
        stack = (message.get("extraInfo") or {}).get("py_callstack")
        stack = stack if isinstance(stack, str) else ""
        return f"{message['message']} (raised{where}{'; its traceback is above' if stack else ''})", stack
    if f.exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-f.exitcode).name}"
        except ValueError:
            how = f"killed by signal {-f.exitcode}"
    else:
        how = f"exit code {f.exitcode}"
    if not record:
        return f"{how}, without a Python exception; its output, if any, is above", ""
    tail = [str(x) for x in record.get("tail") or []][-5:]
    last = ("; its last lines:\n" + "\n".join(f"    {x}" for x in tail)) if tail else \
        "; it wrote no line through Python"
    return f"{how}{where}, without a Python exception{last}", ""


def _lines_beside(failures: dict, watch: liveness.Watch | None = None) -> dict[int, str]:
    """Global rank -> the evenrl line in the error file of each rank of this node not among `failures`: where the
    rank's heartbeat record says its file is (evenrl.train.liveness), or found beside a failed rank's own (the
    agent's directory holds one per local rank: ATTEMPT/LOCAL_RANK/error.json; global ranks are the node's
    consecutive ones). A failed rank killed by a signal has no file, hence the records."""
    files: dict[int, Path] = {}
    for rank, record in (watch.records() if watch is not None else {}).items():
        if isinstance(record.get("error_file"), str):
            files[rank] = Path(record["error_file"])
    for rank, f in failures.items():
        if isinstance(f.error_file, str) and f.error_file.endswith("error.json"):
            for path in Path(f.error_file).parent.parent.glob("*/error.json"):
                if path.parent.name.isdigit():
                    files.setdefault(rank - f.local_rank + int(path.parent.name), path)
    out: dict[int, str] = {}
    for rank, path in sorted(files.items()):
        if rank in failures:
            continue
        try:
            message = json.loads(path.read_text()).get("message")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(message, str) and message.startswith("evenrl"):
            out[rank] = message
    return out
