"""Each rank's heartbeat for evenrl's launcher, outside the collectives, and what a rank that died left behind.

A worker of the launcher keeps one small file, DIR/rank-R (DIR: EVENRL_LIVENESS_DIR, which the launcher makes): a
thread of its own rewrites it every EVENRL_LIVENESS_PERIOD_S seconds, and as soon as the rank's phase changes
(evenrl.distributed.guard.mark) or it writes a line (evenrl.train.stdio), with its pid, its phase and its last
lines. The launcher's `Watch` reads the files: a rank whose file has not changed for parallel.liveness_timeout_s
while its process exists is silent (stopped by SIGSTOP or a debugger, frozen where no thread of it runs, holding
Python's interpreter lock all that time), and the launcher kills it and names it with its phase, which ends the job
at once (its peers' collectives fail on the dead connection) instead of after parallel.collective_timeout_s. A long
but live phase (a 10-minute generation, a slow save) keeps beating: the thread runs beside it. A rank that dies
without a Python exception is explained from its file: the phase it was in and the last lines it wrote.

Only the launcher's own workers beat: workers started by torchrun or srun have the collective timeout alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

DIR_ENV, PERIOD_ENV = "EVENRL_LIVENESS_DIR", "EVENRL_LIVENESS_PERIOD_S"


def period_for(timeout_s: float) -> float:
    """Seconds between beats for a timeout: six beats per timeout (at most 10 s apart), so that a loaded machine
    that delays a few of them does not make a rank look silent."""
    return min(timeout_s / 6.0, 10.0)


# ------------------------------------------------------------------------------------------------ a worker's side

def beat() -> None:
    """In a worker of evenrl's launcher (EVENRL_LIVENESS_DIR set): start the beating thread. Elsewhere nothing."""
    folder, period = os.environ.get(DIR_ENV), os.environ.get(PERIOD_ENV)
    if not folder or not period:
        return
    from evenrl.distributed import guard
    from evenrl.train import stdio

    heart = _Heart(Path(folder) / f"rank-{os.environ.get('RANK', '0')}", float(period))
    stdio.listeners.append(heart.write)  # a line written, and a new phase, are in the record at once
    guard.on_mark.append(heart.write)
    heart.write()
    threading.Thread(target=heart.run, name="evenrl-liveness", daemon=True).start()


class _Heart:
    def __init__(self, path: Path, period: float):
        self.path, self.period, self.lock = path, period, threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)

    def run(self) -> None:
        while True:
            time.sleep(self.period)
            self.write()

    def write(self) -> None:
        """The record in place (one write; the launcher reads it whole or retries): pid, phase, last lines."""
        from evenrl.distributed.mesh import G
        from evenrl.train import stdio

        with self.lock:
            data = json.dumps({"pid": os.getpid(), "phase": G.phase, "tail": stdio.tail(),
                               "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE")}).encode()
            try:
                os.pwrite(self.fd, data, 0)
                os.ftruncate(self.fd, len(data))
            except OSError:  # the launcher removed the folder on its way out
                pass


# ------------------------------------------------------------------------------------------------ the launcher's

class Watch:
    """The launcher's side: a folder for its workers' files (its environment variables, `env`), a thread that ends
    a rank silent for `timeout_s` (0: no thread) and remembers why (`silent`), and each rank's last record."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="evenrl-ranks-"))
        self.silent: dict[int, str] = {}  # rank -> why the launcher ended it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        period = period_for(self.timeout_s) if self.timeout_s else 10.0  # without a watch, still the records
        return {DIR_ENV: str(self.dir), PERIOD_ENV: repr(period)}

    def start(self, parent: int | None) -> None:
        """Watch the workers (`parent`: their parent's pid, the fork server's: a process whose pid a record names
        is only ever killed when it is one of them)."""
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._run, args=(parent,), name="evenrl-watch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def record(self, rank: int) -> dict | None:
        """What rank `rank` last wrote (pid, phase, tail, the agent's error file for it), or None."""
        for _ in range(3):  # a record being rewritten reads as a cut JSON object: read it again
            try:
                data = json.loads((self.dir / f"rank-{rank}").read_bytes())
                return data if isinstance(data, dict) else None
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                time.sleep(0.01)
        return None

    def records(self) -> dict[int, dict]:
        """Every rank's record on this node."""
        ranks = sorted(int(p.name[5:]) for p in self.dir.glob("rank-*") if p.name[5:].isdigit())
        return {r: rec for r in ranks if (rec := self.record(r)) is not None}

    def _run(self, parent: int | None) -> None:
        seen: dict[str, tuple[int, float]] = {}  # file -> (its mtime_ns, when this thread saw it change)
        poll = min(1.0, period_for(self.timeout_s))
        last = time.monotonic()
        while not self._stop.wait(poll):
            now = time.monotonic()  # this thread's clock: a wall-clock jump makes no rank silent
            if now - last > max(10 * poll, self.timeout_s / 2):
                # this thread was itself held up (the whole job suspended and resumed, by Slurm or a SIGSTOP to
                # all of it; a machine so loaded that it ran late): the ranks get a whole timeout from now
                seen = {name: (mtime, now) for name, (mtime, _) in seen.items()}
            last = now
            for path in self.dir.glob("rank-*"):
                try:
                    mtime = path.stat().st_mtime_ns
                except OSError:
                    continue
                if seen.get(path.name, (None,))[0] != mtime:
                    seen[path.name] = (mtime, now)
                    continue
                quiet = now - seen[path.name][1]
                if quiet > self.timeout_s:
                    self._end(int(path.name.split("-")[1]), quiet, parent)
                    seen[path.name] = (mtime, float("inf"))  # once

    def _end(self, rank: int, quiet: float, parent: int | None) -> None:
        record = self.record(rank) or {}
        pid = record.get("pid")
        state = _state(pid) if isinstance(pid, int) else None
        if state is None or state[0] in "ZX" or (parent is not None and state[1] != parent):
            return  # exited (the agent sees that) or not one of this launcher's workers
        why = {"T": "its process is stopped (SIGSTOP, a debugger)", "t": "its process is stopped by a tracer",
               "D": "its process is stuck in the kernel (uninterruptible I/O)"}.get(
            state[0], "its process runs but no thread of it does (e.g. a C extension holding Python's lock)")
        self.silent[rank] = (f"silent for {quiet:.0f} s in {record.get('phase', 'start')}: {why}; the launcher ended "
                             f"it (parallel.liveness_timeout_s={self.timeout_s:g})")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process from /proc (Linux), None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None
