"""Faults end the run fast, name their cause in one line and lose nothing: a non-finite loss, a stopped or dead
peer, a launcher killed under its workers, a run directory that holds another run, restarts without checkpoints,
and a run that learns nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from e2e import ENV, Saved, copy_checkpoint, evenrl
from evenrl import cli


STARTUP_S = 60  # generous for 2 processes loading a tiny model on a loaded 2-core machine (~10 s when idle)


def one_line(capsys) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


# ---------------------------------------------------------------------------------------------- run directory

def test_a_run_directory_belongs_to_one_run(assets, tmp_path, capsys):
    used = tmp_path / "used"
    (used / "checkpoints").mkdir(parents=True)
    (used / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(p.name for p in used.rglob("*"))
    assert cli.main(["train", str(assets["cfg"]), f"log.run_dir={used}"]) == 2
    line = one_line(capsys)
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert cli.main(["train", str(assets["cfg"]), f"log.run_dir={used}", "--resume"]) == 2  # no checkpoint in it
    assert "holds metrics.jsonl but no checkpoint" in one_line(capsys)
    assert cli.main(["train", str(assets["cfg"]), f"log.run_dir={tmp_path / 'new'}", "--resume"]) == 2
    assert "no checkpoint" in one_line(capsys)
    half = tmp_path / "half"
    (half / "checkpoints" / "step-000010").mkdir(parents=True)  # a step directory without its files
    assert cli.main(["train", str(assets["cfg"]), f"log.run_dir={half}", "--resume"]) == 2
    assert "no checkpoint" in one_line(capsys)
    assert cli.main(["train", str(assets["cfg"]), f"log.run_dir={used}", "--resume", "--overwrite"]) == 2
    assert "give one" in one_line(capsys)
    assert cli.main(["sft", str(assets["cfg"]), f"log.run_dir={used}"]) == 2
    assert "already holds a run" in one_line(capsys)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert cli.main(["train", str(assets["cfg"]), f"log.run_dir={blocker / 'run'}"]) == 2
    assert "is a file, not a directory" in one_line(capsys)
    assert sorted(p.name for p in used.rglob("*")) == before and not (tmp_path / "new").exists()


def test_overwrite_replaces_the_old_run_and_cleans_killed_saves(assets, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step-000004-123").mkdir(parents=True)  # a save killed half-way
    (run / "checkpoints" / "step-000009").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 9}\n')
    (run / "notes.txt").write_text("mine")  # not evenrl's: stays
    evenrl("train", assets["cfg"], f"log.run_dir={run}", "train.steps=1", "--overwrite")
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and '"step": 1' in steps[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert (run / "notes.txt").read_text() == "mine"


def test_restarts_need_periodic_checkpoints(assets, tmp_path, capsys):
    args = ["train", str(assets["cfg"]), f"log.run_dir={tmp_path / 'r'}", "--nproc-per-node", "2",
            "checkpoint.every_steps=0", "checkpoint.every_minutes=0"]
    assert cli.main([*args, "--max-restarts", "2"]) == 2
    line = one_line(capsys)
    assert "--max-restarts 2" in line and "checkpoint.every_steps" in line
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------------------------- training faults

@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(assets, shared_runs, tmp_path):
    """Two good steps (shared_runs.one's step-2 checkpoint), then resumed with a reward whose advantages overflow:
    the run stops at step 3 with one line and keeps step 2 as its latest checkpoint, its weights finite."""
    from evenrl.models.loading import load_policy
    from evenrl.train import checkpoint

    run = copy_checkpoint(shared_runs.one, 2, tmp_path / "run")
    common = [assets["cfg"], f"log.run_dir={run}", "checkpoint.every_steps=1", "rewards.isolate=false"]
    proc = evenrl("train", *common, "train.steps=4", "--resume", "algo.advantage=dr_grpo",
                  "rewards.functions=[{name: 'fault_rewards:huge'}]", check=False)
    err = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "stopped: step 3:" in err[0] and "non-finite" in err[0] and "step-000002" in err[0], err[0]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert not any(p.name.startswith("step-00000") and p.name > "step-000002" for p in (run / "checkpoints").iterdir())
    model, _ = load_policy(assets["model"])
    saved = Saved({"policy": (model, torch.optim.AdamW(model.parameters()))})
    step = checkpoint.load(run / "checkpoints" / "step-000002", saved)
    assert step == 2 and all(bool(p.isfinite().all()) for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stop_rank_1", "freeze_rank_1", "kill_rank_1"])
def test_a_stopped_or_dead_peer_ends_the_job_naming_it(assets, tmp_path, fault):
    """A peer that hangs but lives (its heartbeat goes on): the others wait --collective-timeout-s, then rank 0 stops
    with one line naming its phase and where rank 1 was, and the launcher never takes the live rank for a hung one
    (its liveness timeout, 2 s, is the shorter); a frozen one (SIGSTOP): no heartbeat, the launcher ends it after
    parallel.liveness_timeout_s, naming it, its phase and its state, long before the collective timeout; a dead one:
    the launcher sees it exit at once and ends the job, naming it, its phase and that it left no Python exception.
    Either way the launcher's summary lists each failed rank with its own reason, not torch's banner."""
    seconds = {"stop_rank_1": 8, "freeze_rank_1": 120, "kill_rank_1": 600}[fault]
    t0 = time.monotonic()
    proc = evenrl("train", assets["cfg"], f"log.run_dir={tmp_path / 'run'}", "--nproc-per-node", 2,
                  "--collective-timeout-s", seconds, "rewards.isolate=false", "parallel.liveness_timeout_s=2",
                  f"rewards.functions=[{{name: 'fault_rewards:{fault}'}}]", check=False)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    summary = {line.split(" failed: ")[0].rsplit(" ", 1)[-1]: line.split(" failed: ", 1)[1]
               for line in proc.stderr.splitlines() if line.startswith("evenrl train: rank ")}
    rank_0 = "evenrl train: stopped: step 1: rank 0 in step 1 "
    if fault == "stop_rank_1":
        why = summary.get("0", "")
        assert why.startswith(rank_0), proc.stderr[-3000:]
        assert f"failed after {seconds} s" in why or f"failed after {seconds + 1} s" in why, why
        assert "rank 1 was last in step 1 reward" in why, why
        assert "silent" not in proc.stderr, proc.stderr[-3000:]  # 8 s of a live hang, 4 times the liveness timeout
        # start-up (two processes load the model) + the timeout (the stopped rank dies on the agent's SIGTERM:
        # tests/fault_rewards.py); without a timeout of its own the job would wait 600 s
        assert took < STARTUP_S + seconds, f"the job took {took:.0f} s to end"
    elif fault == "freeze_rank_1":
        why = summary.get("1", "")
        assert why.startswith("silent for ") and " in step 1 reward: its process is stopped (SIGSTOP" in why, \
            proc.stderr[-3000:]
        assert summary.get("0", "").startswith(rank_0), proc.stderr[-3000:]  # its collective failed at once
        assert took < STARTUP_S + 10, f"the job took {took:.0f} s to end"
    else:
        assert summary.get("1", "").startswith("exit code 9 in step 1 reward, without a Python exception"), \
            proc.stderr[-3000:]
        assert summary.get("0", "").startswith(rank_0), proc.stderr[-3000:]
        assert took < STARTUP_S, f"the job took {took:.0f} s to end"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_killing_the_launcher_ends_its_workers(assets, tmp_path):
    """kill -9 of the launcher: its workers stop after the step in progress and save it (their parent, the fork
    server, exits at once, without Python's finalization, and its death signals them), judged in steps, not
    seconds (they trained ~50 more steps before, while the server finalized torch): at most 4 after the last one
    logged before the kill. Alone they stop within 2; in a fresh-clone run of the whole suite (load ~10 on 2 cores,
    each wake-up on the way, the server's and each worker's, waiting its turn, a step of the tiny model ~0.2 s) one
    stopped 3 steps on. The resource tracker unlinks the agent's semaphores without a warning; nothing on stderr but
    the workers' two lines."""
    run, err = tmp_path / "run", tmp_path / "stderr.txt"
    launcher = _launcher(assets, run, err, "train.steps=100000")
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.5)  # the workers have trained a step: they are up
        workers = _descendants(launcher.pid)  # the fork server, its resource tracker, the workers, their pools
        assert len(workers) >= 2, "workers did not start"
        trained = len((run / "metrics.jsonl").read_text().splitlines())
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _wait_gone(workers, 300)  # a step and a save on a loaded machine: the test's judgement is in steps
        assert not any(_alive(p) for p in workers), "workers outlived their launcher"
        saved = int((run / "checkpoints" / "latest").read_text().strip().split("-")[1])
        assert saved <= trained + 4, f"the workers trained from step {trained} to {saved} without their launcher"
        lines = [x for x in err.read_text().splitlines() if x.strip()]
        assert len(lines) == 2 and lines[1].startswith(f"evenrl train: SIGTERM: stopped after step {saved}; saved "), \
            lines
    finally:
        _kill(workers + _descendants(launcher.pid) + [launcher.pid])


@pytest.mark.slow
def test_ctrl_c_while_the_fork_server_imports_is_one_line(assets, tmp_path):
    """A terminal's Ctrl-C reaches its whole process group, which holds the launcher's fork server while it imports
    torch and the training code: the server ignores SIGINT (its workers take Python's handler back), so the
    launcher's line is all there is (a 30-line KeyboardInterrupt traceback from the server before), exit 130."""
    launcher = _launcher(assets, tmp_path / "run", tmp_path / "stderr.txt", start_new_session=True)
    everyone: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                any(b"forkserver" in _cmdline(p) for p in _descendants(launcher.pid))
                and not _ignores_sigint(launcher.pid)):  # the launcher's own handler is back
            time.sleep(0.02)
        everyone = _descendants(launcher.pid)
        os.killpg(launcher.pid, signal.SIGINT)  # what the terminal does
        assert launcher.wait(timeout=120) == 130
        _wait_gone(everyone, 120)  # the server ends once it has imported and sees its launcher gone
        lines = [x for x in (tmp_path / "stderr.txt").read_text().splitlines() if x.strip()]
        assert lines == ["evenrl train: interrupted"], lines
    finally:
        _kill(everyone + _descendants(launcher.pid) + [launcher.pid])


@pytest.mark.slow
def test_a_broken_stdout_never_ends_training(assets, tmp_path):
    """`evenrl train ... --nproc-per-node 2 | head -c 200` with head gone: one note on stderr, and every rank trains
    to the end (it ended with a BrokenPipeError traceback on rank 0 and c10d's on rank 1, the run lost)."""
    import warm_start

    read, write = os.pipe()
    os.close(read)  # the reader went away before the first line
    args = ["train", str(assets["cfg"]), f"log.run_dir={tmp_path / 'run'}", "--nproc-per-node", "2"]
    with os.fdopen(write, "w") as out, open(tmp_path / "stderr.txt", "w+") as err:
        if warm_start.can_fork(ENV):
            job = warm_start.start(args, ENV, out, err)
        else:
            job = subprocess.Popen([sys.executable, "-m", "evenrl.cli", *args], env=ENV, stdout=out, stderr=err)
        assert job.wait(timeout=600) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    lines = [x for x in (tmp_path / "stderr.txt").read_text().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("evenrl: stdout is no longer writable: its reader went away"), lines
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def _launcher(assets, run, stderr, *more, **popen) -> subprocess.Popen:
    """`evenrl train` of the assets' config on 2 processes, started as a new Python (so its fork server imports,
    as from a terminal), its stderr to a file."""
    with open(stderr, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "evenrl.cli", "train", str(assets["cfg"]), f"log.run_dir={run}",
                                 "--nproc-per-node", "2", *more], env=ENV, stdout=subprocess.DEVNULL, stderr=f, **popen)


def _wait_gone(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    pairs = [(int(a), int(b)) for a, b in zip(out[::2], out[1::2])]
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in pairs if p in frontier]
        found += kids
        frontier = kids
    return found


def _ignores_sigint(pid: int) -> bool:
    """Whether `pid` ignores SIGINT now (its SigIgn mask in /proc): the launcher does while it starts its fork
    server, so that the server starts ignoring it; a Ctrl-C sent then can be lost (see launch._start_fork_server)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("SigIgn:") and int(line.split()[1], 16) & (1 << (signal.SIGINT - 1))
                       for line in f)
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------------------------- silent non-learning

def test_a_run_that_learns_nothing_says_so(assets, tmp_path):
    proc = evenrl("train", assets["cfg"], f"log.run_dir={tmp_path / 'run'}", "train.steps=2", "rewards.isolate=false",
                  "rewards.functions=[{name: 'fault_rewards:constant'}]")
    warnings = [x for x in proc.stdout.splitlines() if "learned nothing" in x]
    assert len(warnings) == 2, proc.stdout[-2000:]  # the first step of the streak, then the run's note
    assert warnings[0].startswith("evenrl: warning: step 1 learned nothing")
    assert warnings[1].startswith("evenrl: note: 2 of 2 steps learned nothing")
