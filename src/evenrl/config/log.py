"""The run configuration's log section: where a run writes, and the experiment trackers it reports to. Pure Python
(evenrl.config.schema's RunConfig holds it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from evenrl.config.section import Section


class WandbConfig(Section):
    project: str = Field("evenrl", min_length=1, description="W&B project.")
    entity: str = Field("", description="W&B entity (user or team); empty: the account's default.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="'offline': the run is written under RUN_DIR/wandb, nothing leaves the machine; "
                               "upload it later with `wandb sync RUN_DIR/wandb/offline-run-*`. 'online': streamed "
                               "as it runs (needs network and `wandb login` or WANDB_API_KEY).")


class MlflowConfig(Section):
    tracking_uri: str = Field(
        "", description="MLflow tracking URI (http://host:5000, sqlite:///path.db, databricks, ...); empty: a local "
                        "SQLite store in RUN_DIR/mlflow (no server; `mlflow ui --backend-store-uri "
                        "sqlite:///RUN_DIR/mlflow/mlflow.db` shows it).")
    experiment: str = Field("evenrl", min_length=1, description="MLflow experiment the run is logged under.")


class LogConfig(Section):
    run_dir: str = Field("runs/run", description="Directory for config, plan, metrics, checkpoints and plots.")
    samples_every_steps: int = Field(10, ge=0, description="Log a few completions every this many steps (0: never).")
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers that get the resolved config once and every metrics.jsonl row (rank 0), "
                    "W&B and MLflow also the report's plots at the end: tensorboard (RUN_DIR/tb), wandb, mlflow "
                    "(the trackers extra: pip install -e '.[trackers]'). A resumed run continues the same tracker "
                    "runs (their ids are kept in RUN_DIR/trackers.json). The older log.tensorboard: true/false "
                    "stands for [tensorboard] / [] where this is not given.")
    run_name: str = Field("", description="The run's name in the trackers; empty: the run directory's name.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases (log.trackers: wandb).")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow (log.trackers: mlflow).")
    progress: bool = Field(True, description="Show a progress bar on rank 0.")
    save_merged: bool = Field(
        False, description="model.lora.rank > 0: besides the adapter in final/ (PEFT's format), write the base with "
                           "the adapter merged into final/merged/, a plain Hugging Face model.")

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_flag(cls, data: Any) -> Any:
        """log.tensorboard (true/false) of configs written before log.trackers: log.trackers [tensorboard] or [],
        where log.trackers is not given; log.trackers decides where it is."""
        if not (isinstance(data, dict) and "tensorboard" in data):
            return data
        data = dict(data)
        flag = data.pop("tensorboard")
        # yes/no/on/off arrive as words (evenrl.config.parse_yaml): a true/false field reads them as booleans
        flag = {"yes": True, "on": True, "no": False, "off": False}.get(flag.lower(), flag) if isinstance(flag, str) \
            else flag
        if not isinstance(flag, bool):
            raise PydanticCustomError("tensorboard_flag", "log.tensorboard is true or false (or use log.trackers)")
        data.setdefault("trackers", ["tensorboard"] if flag else [])
        return data

    @field_validator("trackers")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise PydanticCustomError("trackers_twice", "name each tracker once")
        return value
