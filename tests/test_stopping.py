"""Nothing is lost by default: checkpoints by steps and by time, Ctrl-C or SIGTERM stop every rank after the step
in progress with a checkpoint and one line saying how to resume, and the resumed run ends with the parameters of
an uninterrupted one. The launcher speaks for its workers: bad input is refused before they start, a failure
they share is reported once, a finished run resumed says so."""

from __future__ import annotations

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest

from e2e import evenrl, evenrl_here, fault_env, final_params, max_diff, metrics
from evenrl.config import load_config
from evenrl.train import launch, stopping
from evenrl.train.stopping import Stopping


def _cfg(**checkpoint):
    return load_config(None, [f"checkpoint.{k}={v}" for k, v in checkpoint.items()] + ["train.steps=10"])


def test_default_cadence_saves_by_steps_and_by_time():
    cfg = load_config(None, [])
    assert cfg.checkpoint.every_steps > 0 and cfg.checkpoint.every_minutes > 0  # on unless turned off
    s = Stopping(_cfg(every_steps=3, every_minutes=0))
    assert [s.after_step(k) for k in (1, 3, 4, 10)] == [(False, False), (True, False), (False, False), (True, False)]
    by_time = Stopping(_cfg(every_steps=0, every_minutes=0.0001))  # 6 ms
    assert by_time.after_step(1) == (False, False)
    time.sleep(0.02)
    assert by_time.after_step(2) == (True, False)
    by_time.saved()
    assert by_time.after_step(3) == (False, False)  # counted from the last save
    staleness = Stopping(load_config(None, ["checkpoint.every_minutes=0.0001", "rollout.max_staleness=1",
                                            "checkpoint.every_steps=0"]))
    time.sleep(0.02)
    assert staleness.after_step(1) == (False, False)  # its checkpoints carry versions staged for planned saves only


def test_a_signal_stops_after_the_step_and_a_second_one_at_once(monkeypatch, capfd):
    previous = signal.getsignal(signal.SIGINT)
    with Stopping(_cfg(every_steps=0, every_minutes=0)) as s:
        assert s.after_step(1) == (False, False)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # within REPEAT_S: the same request twice, not "stop at once"
        assert s.signal == signal.SIGTERM
        assert s.after_step(2) == (True, True)  # save, then stop
        assert s.after_step(10) == (True, False)  # after the last step the run ends anyway
        monkeypatch.setattr(stopping, "REPEAT_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous  # the handlers are put back
    assert "stopping after the step in progress" in capfd.readouterr().err


def test_a_signal_during_set_up_says_nothing_is_saved(capfd):
    """Before the first step (loading, a checkpoint read that fails on another rank) there is nothing to save, and
    the line at the signal says so instead of promising a checkpoint."""
    with Stopping(_cfg(every_steps=0, every_minutes=0)) as s:
        os.kill(os.getpid(), signal.SIGTERM)
        assert s.before_start()  # the run stops before step 1
    err = capfd.readouterr().err
    assert "SIGTERM: stopping before the first step, once set-up ends; nothing is saved" in err, err
    assert "saving a checkpoint" not in err


@pytest.mark.slow
def test_ctrl_c_on_two_processes_saves_and_resumes_exactly(shared_runs, tmp_path):
    """The shared config on 2 processes: Ctrl-C reaches the launcher (rank 0 sends it at the start of step 3), every
    worker finishes step 3 and saves; one line at the signal and one at the end, exit 130, no traceback or torchrun
    banner. Resumed (on one process: a checkpoint resumes on any number), the run ends with shared_runs.one's
    parameters. (The one-process path is the same loop without the launcher: tests/test_stopping.py's unit tests
    and test_train.py's resume after a crash.)"""
    run = tmp_path / "run"
    args = ["train", *shared_runs.args, f"log.run_dir={run}"]
    proc = evenrl(*args, "--nproc-per-node", "2", env=fault_env(signal_at_step="3:INT:parent"), check=False)
    assert proc.returncode == 130, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == 2 and "stopping after the step in progress" in err[0], err  # at the signal, then at the end
    assert err[1].startswith("evenrl train: SIGINT: stopped after step 3; saved ") and err[1].endswith(
        " --nproc-per-node 2 --resume"), err
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"
    assert not (run / "final").exists()
    evenrl(*args, "--resume")
    assert max_diff(final_params(shared_runs.one), final_params(run)) <= 1e-5
    assert [r["step"] for r in metrics(run)] == [0, 1, 2, 3, 4]


def test_resuming_a_finished_run_says_so(shared_runs, capsys):
    run = shared_runs.one
    before = (run / "metrics.jsonl").read_text()
    code, out, err = evenrl_here(capsys, "train", *shared_runs.args, f"log.run_dir={run}", "--resume")
    assert code == 0 and not err, err
    assert out.splitlines() == [f"evenrl train: {run} has finished: its checkpoint is at step 4 of train.steps=4 and "
                                f"the model is in {run / 'final'}; nothing to do (to train longer: --resume "
                                "train.steps=N with N > 4)"]
    assert (run / "metrics.jsonl").read_text() == before


def test_the_launcher_refuses_bad_input_before_starting_workers(assets, tmp_path, capsys):
    t0 = time.monotonic()
    code, out, err = evenrl_here(capsys, "train", assets["cfg"], f"log.run_dir={tmp_path / 'r'}",
                                 f"model.path={tmp_path / 'nope'}", "--nproc-per-node", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model.path" in err, err
    assert time.monotonic() - t0 < 30  # no worker was started (a spawn of two takes 10-50 s here)
    assert not (tmp_path / "r").exists()


def test_a_failure_every_rank_shares_is_reported_once(capsys, tmp_path):
    def failed(rank, exitcode, message, error_file="<N/A>"):
        return SimpleNamespace(exitcode=exitcode, message=message, error_file=error_file, local_rank=rank)

    same = "evenrl train: error: x.yaml: bad"
    failures = {0: failed(0, 2, same), 1: failed(1, -15, same)}
    assert launch._report_failures("train", failures) == 2
    assert capsys.readouterr().err.splitlines() == [same]
    failures = {0: failed(0, 3, "evenrl train: stopped: step 1: peer"), 1: failed(1, 1, "<N/A>")}
    assert launch._report_failures("train", failures) == 1
    assert capsys.readouterr().err.splitlines() == [
        "evenrl train: rank 0 failed: evenrl train: stopped: step 1: peer",
        "evenrl train: rank 1 failed: exit code 1, without a Python exception; its output, if any, is above"]
    # torch's agent names the first failed worker it saw (rank 1, killed); rank 0's own line is in its error file
    # beside rank 1's, in the agent's directory for the attempt, and is reported too
    for r in (0, 1):
        (tmp_path / "attempt_0" / str(r)).mkdir(parents=True)
    (tmp_path / "attempt_0" / "0" / "error.json").write_text(json.dumps({"message": "evenrl train: stopped: peer"}))
    failures = {1: failed(1, -9, "Signal 9 (SIGKILL)", str(tmp_path / "attempt_0" / "1" / "error.json"))}
    assert launch._report_failures("train", failures) == 1
    assert capsys.readouterr().err.splitlines() == [
        "evenrl train: rank 1 failed: killed by SIGKILL, without a Python exception; its output, if any, is above",
        "evenrl train: rank 0 failed: evenrl train: stopped: peer"]
