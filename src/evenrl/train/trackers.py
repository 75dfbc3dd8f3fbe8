"""Experiment trackers (log.trackers), each through its own client, on rank 0: TensorBoard, Weights & Biases, MLflow.

    log:
      trackers: [tensorboard, wandb, mlflow]
      wandb: {project: my-project, mode: offline}   # written under RUN_DIR/wandb; `wandb sync` uploads it later
      mlflow: {tracking_uri: ""}                     # "": a SQLite store in RUN_DIR/mlflow, no server

Each tracker gets the resolved config once (W&B config, MLflow params, a TensorBoard text), then every row
metrics.jsonl gets (its numbers: lists such as load/rank_tokens stay in metrics.jsonl), and W&B and MLflow get the
report's plots (evenrl.train.plots) when training ends. Offline by default: nothing here needs a network.

A tracker that cannot start stops the run before training, as one line (UsageError); one that fails later prints
one warning and is switched off for the rest of the run: metrics.jsonl stays complete and training goes on.

Resume: RUN_DIR/trackers.json keeps each tracker's run (the W&B run id, the MLflow run id and store); a resumed run
(--resume, an elastic restart) continues those runs. The steps a resume re-runs are in the trackers already (a
resume is exact: they hold the same numbers, timings aside), so rows up to the last one metrics.jsonl held before
are not sent again, and every tracker holds each step once. A tracker added on a resume gets the earlier rows
first. MLflow stores each row as it is logged; TensorBoard and W&B write theirs to disk every FLUSH_S seconds, so a
process killed without warning (not a failed step, which ends the run in order) can leave them without the rows of
its last second, which metrics.jsonl has.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from evenrl.config import RunConfig, config_to_yaml, flatten
from evenrl.errors import UsageError, describe_error

STATE_FILE = "trackers.json"
# TensorBoard and W&B buffer what they are given and write it to disk this often (their defaults: 120 s and 15 s),
# so that a run killed mid-way has its trackers' rows but the last moments'.
FLUSH_S = 1.0
# MLflow's batch limits (log_batch): at most 1000 metrics and 100 params per request; a param value's length.
MLFLOW_METRICS_PER_BATCH, MLFLOW_PARAMS_PER_BATCH, MLFLOW_PARAM_CHARS = 1000, 100, 6000
# A tracker's server must answer a TCP connect within this long at start (check_reachable), and MLflow's client
# retries a request at most twice (its defaults: 7 retries with backoff, 120 s each: 262 s measured on an unreachable
# server before its error); the user's own MLFLOW_HTTP_REQUEST_* settings win.
CONNECT_TIMEOUT_S = 5.0
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def check_reachable(cfg: RunConfig) -> None:
    """Before anything loads (every rank, so all stop alike): a remote MLflow tracking server or W&B online mode
    whose server does not take a TCP connection within CONNECT_TIMEOUT_S is one line. Skipped behind a proxy (the
    client goes through it; a direct connect would say nothing)."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return
    servers = []
    if "mlflow" in cfg.log.trackers and cfg.log.mlflow.tracking_uri.startswith(("http://", "https://")):
        servers.append(("log.mlflow.tracking_uri", cfg.log.mlflow.tracking_uri))
    if "wandb" in cfg.log.trackers and cfg.log.wandb.mode == "online":
        servers.append(("log.wandb.mode=online", os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"))
    for field, url in servers:
        parts = urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            with socket.create_connection((parts.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
                pass
        except (OSError, ValueError) as e:
            raise UsageError(f"{field}: cannot reach {url} within {CONNECT_TIMEOUT_S:g} s ({describe_error(e)}); "
                             f"start the server or fix the address, or leave {field.split('.')[1]} out of "
                             "log.trackers") from None


def numbers(values: dict) -> dict[str, float]:
    """The finite numbers of a metrics row (no lists, no booleans, no NaN)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoard:
    name = "tensorboard"

    def __init__(self, cfg: RunConfig, run_dir: Path, state: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"), flush_secs=FLUSH_S)
        if not state:
            self.writer.add_text("config", "```\n" + config_to_yaml(cfg) + "```")
        self.state = {"started": True}

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def images(self, paths: list[Path]) -> None:
        return None  # TensorBoard draws its own curves from the scalars

    def close(self, ok: bool) -> None:
        self.writer.close()


class Wandb:
    name = "wandb"

    def __init__(self, cfg: RunConfig, run_dir: Path, state: dict):
        import wandb

        w = cfg.log.wandb
        self.wandb = wandb
        settings = {"console": "off", "silent": True}  # the run's own output stays the trainer's
        if "x_transaction_log_flush_interval" in wandb.Settings.model_fields:  # wandb >= 0.23; default 15 s
            settings["x_transaction_log_flush_interval"] = FLUSH_S
        self.run = wandb.init(project=w.project, entity=w.entity or None, name=cfg.log.run_name or run_dir.name,
                              id=state.get("id"), resume="allow" if state else None, mode=w.mode, dir=str(run_dir),
                              config=None if state else flatten(cfg.model_dump(mode="json")),
                              settings=wandb.Settings(**settings))
        self.state = {"id": self.run.id}

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step, commit=True)  # without commit W&B holds a step open until the next one

    def images(self, paths: list[Path]) -> None:
        # the run's summary, not its history: the last step is committed, and a later one would be a step that is not
        self.run.summary.update({f"plots/{p.stem}": self.wandb.Image(str(p)) for p in paths})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class Mlflow:
    name = "mlflow"

    def __init__(self, cfg: RunConfig, run_dir: Path, state: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines on a new store would bury the run's
        for key, value in MLFLOW_HTTP.items():
            os.environ.setdefault(key, value)
        m = cfg.log.mlflow
        local = run_dir.resolve() / "mlflow"
        uri = state.get("tracking_uri") or m.tracking_uri or f"sqlite:///{local / 'mlflow.db'}"
        if uri.startswith("sqlite:///") and not m.tracking_uri:
            local.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        if state.get("run_id"):
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(m.experiment)
            experiment = found.experiment_id if found else self.client.create_experiment(
                m.experiment, artifact_location=None if m.tracking_uri else (local / "artifacts").as_uri())
            self.run_id = self.client.create_run(experiment, run_name=cfg.log.run_name or run_dir.name).info.run_id
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:MLFLOW_PARAM_CHARS])
                      for k, v in flatten(cfg.model_dump(mode="json")).items()]
            for i in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[i:i + MLFLOW_PARAMS_PER_BATCH])
        self.state = {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MLFLOW_METRICS_PER_BATCH])

    def images(self, paths: list[Path]) -> None:
        for p in paths:
            self.client.log_artifact(self.run_id, str(p), "plots")

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


def start_tracker(name: str, cfg: RunConfig, run_dir: Path, state: dict):
    if name == "tensorboard":
        return TensorBoard(cfg, run_dir, state)
    if name == "wandb":
        return Wandb(cfg, run_dir, state)
    return Mlflow(cfg, run_dir, state)


class Trackers:
    """The trackers of log.trackers, started on rank 0 before training (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: str | os.PathLike, earlier: list[dict] | None = None):
        """`earlier`: the rows metrics.jsonl held before a resume (None or [] for a new run): trackers that continue
        a run skip them, a tracker that starts on this resume gets them first."""
        self.dir = Path(run_dir)
        earlier = earlier or []
        saved = self._read_state() if earlier else {}
        self.logged_through = max((r["step"] for r in earlier), default=-1)
        self.live: list = []
        self.wants_images = False
        if not cfg.log.trackers:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            for name in cfg.log.trackers:
                tracker = start_tracker(name, cfg, self.dir, saved.get(name, {}))
                self.live.append(tracker)
                if name not in saved:
                    for row in earlier:
                        tracker.log(row["step"], numbers(row))
        except Exception as e:  # the client's own errors: a bad URI, no login for online mode, a missing package
            self.close(ok=False)
            raise UsageError(f"log.trackers: {name} failed to start: {describe_error(e)}; fix that, or leave {name} "
                             "out of log.trackers") from None
        self.wants_images = any(t.name != "tensorboard" for t in self.live)
        self._write_state()

    def log(self, step: int, values: dict) -> None:
        if step > self.logged_through:
            row = numbers(values)
            for t in list(self.live):
                self._call(t, "log", step, row)

    def images(self, paths: list[Path]) -> None:
        for t in list(self.live):
            self._call(t, "images", paths)

    def close(self, ok: bool = True) -> None:
        for t in list(self.live):
            self._call(t, "close", ok)
        self.live = []

    def _call(self, tracker, method: str, *args) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as e:  # a tracker never stops training: warn once, then go on without it
            self.live.remove(tracker)
            print(f"evenrl: warning: tracker {tracker.name} failed ({describe_error(e)}); it is off for the rest of "
                  "the run (metrics.jsonl is complete)", flush=True)
            if method != "close":
                try:
                    tracker.close(False)
                except Exception:  # already failing: its close may fail too
                    pass

    def _read_state(self) -> dict:
        try:
            state = json.loads((self.dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _write_state(self) -> None:
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps({t.name: t.state for t in self.live}, indent=1))
        os.replace(tmp, self.dir / STATE_FILE)
