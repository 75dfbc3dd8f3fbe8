"""Experiment trackers (log.trackers): W&B offline runs and a local MLflow store, read back with the trackers' own
formats and client, hold the metrics.jsonl series, once per step, across a resume; a tracker that fails mid-run
does not stop training; one that cannot start is one line before training."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import pytest

from e2e import Job, evenrl, evenrl_here, fault_env, metrics
from evenrl.config import load_config
from evenrl.train.trackers import Trackers, numbers


def wandb_runs(run_dir: Path) -> dict[str, dict]:
    """{run id: {"config", "history" {step: {key: value}}, "summary", "files": n}} from the offline runs under
    RUN_DIR/wandb, read from W&B's own transaction log with its own protobuf records (wandb 0.31 ships no Python
    reader of that log: its Go core reads it). The log is LevelDB's format: 32 KiB blocks of records, each a 7-byte
    header (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last piece) and its bytes; W&B's file starts with
    a 7-byte header of its own (":W&B", magic, version)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs: dict[str, dict] = {}
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data = Path(path).read_bytes()
        assert data[:4] == b":W&B", path
        pos, piece = 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
            if kind == 0:
                break
            piece = chunk if kind in (1, 2) else piece + chunk
            if kind not in (1, 4):
                continue
            record = pb.Record()
            record.ParseFromString(piece)
            which = record.WhichOneof("record_type")
            if which == "run":
                run = runs.setdefault(record.run.run_id, {"config": {}, "history": {}, "summary": {}, "files": 0})
                run["files"] += 1
                run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif which == "summary":
                run["summary"].update({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                       for i in record.summary.update})
            elif which == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                run["history"].setdefault(int(items["_step"]), {}).update(
                    {k: v for k, v in items.items() if not k.startswith("_")})
    return runs


def mlflow_run(run_dir: Path):
    """(client, the run) of the local MLflow store under RUN_DIR/mlflow, through MLflow's own client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "evenrl"]
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def assert_series_match(run_dir: Path, keys=("reward/mean", "policy/loss", "grad_norm", "eval/reward")):
    """Every tracker holds each metrics.jsonl step once, with its values (timings aside: a re-run step's were
    logged by the attempt that ran it first)."""
    rows = {r["step"]: r for r in metrics(run_dir)}
    (wb,) = wandb_runs(run_dir).values()
    client, run = mlflow_run(run_dir)
    for key in keys:
        want = {s: r[key] for s, r in rows.items() if key in r}
        assert want, key
        assert {s: h[key] for s, h in wb["history"].items() if key in h} == pytest.approx(want), key
        hist = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in hist) == sorted(want), key  # no step twice
        assert {m.step: m.value for m in hist} == pytest.approx(want), key
    return wb, client, run


@pytest.mark.slow
def test_wandb_and_mlflow_hold_the_metrics_of_a_resumed_run(assets, tmp_path):
    """The shared config with all three trackers, 2 steps, then --resume to 4: the W&B run (two offline files, one
    id) and the MLflow run (one, FINISHED) hold steps 0-4, each once, equal to metrics.jsonl; the config went in
    once; the report's plots are in both. Beside it, a run whose W&B tracker raises from step 2 on: one warning,
    and the run ends as usual."""
    run, failing = tmp_path / "run", tmp_path / "failing"
    common = [assets["cfg"], f"log.run_dir={run}", f"eval.path={assets['data']}", "eval.max_prompts=4",
              "log.trackers=[tensorboard, wandb, mlflow]"]
    side = Job("train", assets["cfg"], "train.steps=3", f"log.run_dir={failing}", "log.trackers=[wandb]",
               env=fault_env(tracker_fails_at_step=2))
    try:
        evenrl("train", *common, "train.steps=2")
        ids = json.loads((run / "trackers.json").read_text())
        evenrl("train", *common, "train.steps=4", "--resume")
        assert json.loads((run / "trackers.json").read_text()) == ids
        assert [r["step"] for r in metrics(run)] == [0, 1, 2, 3, 4]
        wb, client, mrun = assert_series_match(run)
        assert wb["files"] == 2 and list(wandb_runs(run)) == [ids["wandb"]["id"]]
        assert wb["config"]["algo.minibatches_per_step"] == 2 and wb["config"]["train.steps"] == 2  # the first's
        assert mrun.info.run_id == ids["mlflow"]["run_id"] and mrun.info.status == "FINISHED"
        assert mrun.data.params["rollout.samples_per_prompt"] == "3"
        assert {a.path for a in client.list_artifacts(mrun.info.run_id, "plots")} >= {"plots/reward.png"}
        assert wb["summary"]["plots/reward"]["_type"] == "image-file"
        assert list((run / "tb").glob("events.out.tfevents.*"))

        done = side.wait()
        warnings = [x for x in done.stdout.splitlines() if "tracker" in x and "warning" in x]
        assert len(warnings) == 1 and "tracker wandb failed" in warnings[0] and "injected" in warnings[0]
        assert [r["step"] for r in metrics(failing)] == [1, 2, 3] and (failing / "final").exists()
        (wb,) = wandb_runs(failing).values()
        assert sorted(wb["history"]) == [1]  # what it got before it failed
    finally:
        side.kill()


def test_trackers_resume_the_same_runs_and_skip_logged_steps(tmp_path):
    """In-process: a run logs steps 0-2 to MLflow and stops; a resume that re-runs step 2 continues the MLflow run
    without logging step 2 again, and W&B, added on the resume, gets the earlier rows first."""
    rows = [{"step": s, "reward/mean": s / 10, "load/rank_tokens": [1, 2], "flag": True} for s in range(3)]
    first = Trackers(load_config(None, [f"log.run_dir={tmp_path}", "log.trackers=[mlflow]"]), tmp_path)
    for r in rows:
        first.log(r["step"], r)
    first.close(ok=False)
    again = Trackers(load_config(None, [f"log.run_dir={tmp_path}", "log.trackers=[mlflow, wandb]"]), tmp_path,
                     earlier=rows)
    for r in rows[2:] + [{"step": 3, "reward/mean": 0.3}]:
        again.log(r["step"], {**r, "reward/mean": r["reward/mean"] + 1.0 * (r["step"] == 2)})  # a re-run differs
    again.close()
    client, run = mlflow_run(tmp_path)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")] == \
        [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)]
    assert "load/rank_tokens" not in run.data.metrics and "flag" not in run.data.metrics
    (wb,) = wandb_runs(tmp_path).values()
    assert {s: h["reward/mean"] for s, h in wb["history"].items()} == {0: 0.0, 1: 0.1, 2: 0.2, 3: 0.3}
    assert numbers({"a": 1, "b": float("nan"), "c": [1], "d": False, "e": 2.5}) == {"a": 1.0, "e": 2.5}


def test_a_tracker_that_cannot_start_is_one_line_before_training(assets, tmp_path, capsys):
    code, _, err = evenrl_here(capsys, "train", assets["cfg"], f"log.run_dir={tmp_path / 'r'}",
                               "log.trackers=[mlflow]", "log.mlflow.tracking_uri=nosuchscheme://x")
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "log.trackers: mlflow failed to start" in lines[0], err
    assert not (tmp_path / "r" / "metrics.jsonl").exists() and not (tmp_path / "r" / "config.yaml").exists()


def test_an_unreachable_tracking_server_is_one_line_within_seconds_before_anything_loads(assets, tmp_path, capsys):
    """MLflow's client took 262 s of retries to say so, after the model had loaded."""
    import time

    from e2e import free_port

    port = free_port()  # nothing listens on it
    started = time.monotonic()
    code, _, err = evenrl_here(capsys, "train", assets["cfg"], f"log.run_dir={tmp_path / 'r'}",
                               "log.trackers=[mlflow]", f"log.mlflow.tracking_uri=http://127.0.0.1:{port}")
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and f"log.mlflow.tracking_uri: cannot reach http://127.0.0.1:{port}" in err
    assert time.monotonic() - started < 10 and not (tmp_path / "r").exists()


def test_old_tensorboard_flag_and_missing_trackers_in_the_plan(assets, capsys, monkeypatch):
    assert load_config(None, ["log.tensorboard=false"]).log.trackers == []
    assert load_config(None, ["log.trackers=[wandb]", "log.tensorboard=false"]).log.trackers == ["wandb"]
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code, out, _ = evenrl_here(capsys, "plan", assets["cfg"], "log.trackers=[wandb]")
    assert code == 1 and "tracker-missing: log.trackers names wandb, but wandb is not installed" in out
