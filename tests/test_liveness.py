"""evenrl.train.liveness and the launcher's account of failed ranks (evenrl.train.launch): a rank that goes silent
is ended and named with its phase, a long but live phase is not, and a rank that died without an evenrl line is
explained: its Python exception's traceback, or its exit code or signal with its phase and last lines. The same
in real multi-process runs: tests/test_faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from e2e import ENV
from evenrl.train import launch
from evenrl.train.liveness import Watch

RANK = """
import os, signal, sys, time
from evenrl.train import liveness, stdio
stdio.install()
liveness.beat()
from evenrl.distributed import guard
guard.mark("step 7 generate")
print("generating", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:  # a long live phase: the main thread busy in Python half the time, asleep the rest
    t = time.monotonic() + 0.05
    while time.monotonic() < t:
        pass
    time.sleep(0.05)
print("last words", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_stopped_rank_is_ended_and_named_while_a_long_live_phase_is_not():
    """A rank busy for twice the timeout keeps beating (its heartbeat thread runs beside the work); stopped by
    SIGSTOP, it is killed within about the timeout and named with its phase; its record keeps its last lines."""
    timeout = 2.0
    watch = Watch(timeout)
    try:
        watch.start(parent=os.getpid())
        rank = subprocess.Popen([sys.executable, "-c", RANK, str(2 * timeout)], env={**ENV, **watch.env(), "RANK": "0"},
                                stdout=subprocess.PIPE, text=True)
        assert rank.stdout.readline() == "generating\n"
        assert rank.stdout.readline() == "last words\n"  # lived through 2 x the timeout
        assert watch.silent == {}
        t0 = time.monotonic()
        assert rank.wait(timeout=60) == -signal.SIGKILL
        assert time.monotonic() - t0 < timeout + 10
        why = watch.silent[0]
        assert why.startswith("silent for ") and " in step 7 generate: its process is stopped (SIGSTOP" in why, why
        assert why.endswith("the launcher ended it (parallel.liveness_timeout_s=2)"), why
        record = watch.record(0)
        assert record["phase"] == "step 7 generate" and record["tail"][-1] == "last words", record
        # the same rank had it died by itself, without a Python exception (os._exit, a C library's exit(), a signal)
        watch.silent.clear()
        died = SimpleNamespace(exitcode=3, message="To enable traceback see: https://pytorch.org/docs",
                               error_file="<N/A>", local_rank=0)
        why, stack = launch._why(0, died, watch)
        assert stack == "" and why.startswith("exit code 3 in step 7 generate, without a Python exception; its last "
                                              "lines:\n    "), why
        assert why.endswith("\n    generating\n    last words"), why
    finally:
        watch.close()
    assert not watch.dir.exists()


def test_the_launcher_explains_every_failed_rank(tmp_path, capsys):
    """Torch's agent keeps a Python exception's traceback in its error file and prints nothing: the launcher prints
    it once, with the exception and the rank's phase. A rank killed by a signal has no error file, so the lines of
    the ranks beside it are found through their heartbeat records."""
    watch = Watch(0)
    try:
        peer = tmp_path / "error.json"
        peer.write_text(json.dumps({"message": "evenrl train: stopped: step 2: rank 1 in step 2 update: ..."}))
        for rank, record in {0: {"pid": 1, "phase": "step 2 update", "tail": []},
                             1: {"pid": 2, "phase": "step 2 update", "tail": [], "error_file": str(peer)}}.items():
            (watch.dir / f"rank-{rank}").write_text(json.dumps(record))
        stack = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nValueError: broke\n'
        raised = SimpleNamespace(exitcode=1, error_file="<N/A>", local_rank=0,
                                 message={"message": "ValueError: broke", "extraInfo": {"py_callstack": stack}})
        assert launch._report_failures("train", {0: raised}, watch) == 1
        assert capsys.readouterr().err.splitlines() == [
            *stack.splitlines(),
            "evenrl train: rank 0 failed: ValueError: broke (raised in step 2 update; its traceback is above)",
            "evenrl train: rank 1 failed: evenrl train: stopped: step 2: rank 1 in step 2 update: ..."]
        watch.silent[0] = "silent for 61 s in step 2 update: ..."
        killed = SimpleNamespace(exitcode=-9, message="Signal 9 (SIGKILL) received by PID 1", error_file="<N/A>",
                                 local_rank=0)
        assert launch._report_failures("train", {0: killed}, watch) == 1
        assert capsys.readouterr().err.splitlines()[0] == "evenrl train: rank 0 failed: silent for 61 s in step 2 " \
                                                          "update: ..."
    finally:
        watch.close()
