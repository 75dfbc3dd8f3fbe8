"""tests/warm_start.py: a run forked from the tests' server is the run a new Python gives."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from e2e import ENV, Job, fault_env, final_params, max_diff, metrics


@pytest.mark.parametrize("processes", [1, 2])
def test_a_forked_run_is_the_started_run(assets, tmp_path, processes):
    """2 steps of the assets' config on 1 process (the run in the forked process) and on 2 (a launcher forked, its
    fork server forked from it, the workers from that): forked and started, the same exit codes,
    output lines (but for times), metrics (but for times and speeds) and final weights, bit for bit."""
    args = ["train", assets["cfg"], "train.steps=2", "--nproc-per-node", str(processes)]
    forked = Job(*args, f"log.run_dir={tmp_path / 'forked'}")
    assert isinstance(forked.proc, __import__("warm_start").ForkedJob)
    starting = subprocess.Popen([*forked.args[:3], *map(str, args), f"log.run_dir={tmp_path / 'started'}"], env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = {forked.proc.pid: set(), starting.pid: set()}  # each run's processes' command lines, each its own session
    while not forked.done() or starting.poll() is None:
        for pid in os.listdir("/proc"):
            try:
                sid = os.getsid(int(pid))
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except (ValueError, OSError):
                continue
            if sid in seen:
                seen[sid].add(cmdline)
        time.sleep(0.05)
    out, err = starting.communicate()
    started = subprocess.CompletedProcess(starting.args, starting.returncode, out, err)
    done = forked.wait()
    fork_servers = {sid: any("multiprocessing.forkserver" in c for c in cmdlines) for sid, cmdlines in seen.items()}
    assert fork_servers == {forked.proc.pid: False, starting.pid: processes > 1}  # the forked run forked its own
    assert started.returncode == done.returncode == 0

    def lines(text, run):  # but the phases' times (`  rollout   0.02   6.5`)
        return [x.replace(str(tmp_path / run), "RUN") for x in text.splitlines()
                if not re.fullmatch(r"  \w+\s+[\d.]+\s+[\d.]+", x)]

    assert lines(done.stdout, "forked") == lines(started.stdout, "started")
    assert "  model: RUN/final" in lines(done.stdout, "forked")
    assert done.stderr == started.stderr
    timed = ("time", "tokens_per_s", "_s", "mem")
    a, b = metrics(tmp_path / "forked"), metrics(tmp_path / "started")
    assert [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in a] == \
        [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in b]
    fa, fb = final_params(tmp_path / "forked"), final_params(tmp_path / "started")
    assert fa.keys() == fb.keys() and all(fa[k].equal(fb[k]) for k in fa)
    start = load_file(str(Path(assets["model"]) / "model.safetensors"))
    assert max_diff(fa, start) > 1e-5, "training did not move the model: weak test"


def test_a_forked_run_given_a_bad_setting_says_one_line_and_exits_2(assets):
    bad = Job("train", assets["cfg"], "train.stepz=2")
    assert isinstance(bad.proc, __import__("warm_start").ForkedJob)
    done = bad.wait(check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "train.stepz" in done.stderr, done.stderr


def test_jobs_with_their_own_environment_start_a_new_python():
    import warm_start

    assert warm_start.can_fork(ENV) and warm_start.can_fork({**ENV, "PYTHONPATH": "/elsewhere"})
    assert not warm_start.can_fork(fault_env(crash_at_step=2))  # tests/faults/sitecustomize.py must run at start
    assert not warm_start.can_fork({**ENV, "HF_HOME": "/tmp/hub"})  # read when transformers is imported
