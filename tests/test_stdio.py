"""evenrl.train.stdio: a broken or closed stdout is noted once and never ends the process (each case in a fresh
Python that writes as a run does; the multi-process run with its stdout piped into a reader that went away:
tests/test_faults.py)."""

from __future__ import annotations

import subprocess
import sys

WRITER = """
import os, sys
from evenrl.train import stdio
stdio.install()
for i in range(2000):
    print(f"step {i}: " + "x" * 60)        # past the pipe's buffer: the writes fail while the loop goes on
sys.stdout.flush()
print("still here", file=sys.stderr)
print(os.open(os.devnull, os.O_RDONLY), file=sys.stderr)  # the lowest free descriptor: never 1
print(stdio.tail()[-3][:9], file=sys.stderr)  # the last lines, stdout's too
"""


def test_a_pipe_whose_reader_went_away_is_noted_once_and_the_process_goes_on():
    proc = subprocess.Popen([sys.executable, "-c", WRITER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `evenrl train ... | head -c 200`, head gone before the first line
    err = proc.stderr.read().splitlines()
    assert proc.wait(timeout=60) == 0, err
    assert len(err) == 4 and "Traceback" not in "".join(err), err  # nothing at the exit's last flush either
    assert err[0].startswith("evenrl: stdout is no longer writable: its reader went away (broken pipe); training "
                             "goes on"), err
    assert err[1:] == ["still here", "3", "step 1999"]


def test_a_stdout_closed_at_start_is_noted_and_no_file_takes_its_place():
    proc = subprocess.run(["bash", "-c", 'exec "$0" -c "$1" >&-', sys.executable, WRITER], capture_output=True,
                          text=True, timeout=60)
    err = proc.stderr.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert err[0].startswith("evenrl: stdout was closed at start; training goes on"), err
    assert err[1:] == ["still here", "3", "step 1999"], err  # /dev/null holds descriptor 1, not a file opened later
