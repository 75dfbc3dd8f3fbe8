"""The compatibility table (evenrl.config.compatibility) in the plan and in the run, on the same facts: the model's
from its config.json (planner.dims), the layout's device kind and reserved rollout devices.

    evenrl plan examples/demo.yaml rollout.partial=true rollout.engine=vllm rollout.tensor_parallel_size=2
                                                            # error partial-tensor-parallel

`rule_compatibility` (one of planner.rules.RULES) makes an error finding of every row that holds; `check_run` is the
run's check before anything loads (evenrl train's ranks, evenrl sft), the first row that holds as one line.
Pure Python: never imports torch.
"""

from __future__ import annotations

from typing import Iterable

from evenrl.config import RunConfig
from evenrl.config.compatibility import Facts, problems, refuse
from evenrl.errors import UsageError
from evenrl.planner.dims import ModelDims, read_model_dims
from evenrl.planner.types import Finding, Plan


def facts(dims: ModelDims | None, device: str, rollout_devices: int) -> Facts:
    """The table's facts: the model's (none where its dimensions are unknown), the device kind, reserved devices."""
    if dims is None:
        return Facts(device=device, rollout_devices=rollout_devices)
    return Facts(dims.model_type, dims.vision is not None, dims.experts > 0, device, rollout_devices)


def rule_compatibility(p: Plan) -> list[Finding]:
    f = facts(p.dims, p.layout.device, p.layout.rollout_devices)
    return [Finding("error", x.rule, x.message, x.fix) for x in problems(p.config, f)]


def check_run(cfg: RunConfig, *, device: str = "", rollout_devices: int, rules: Iterable[str] | None = None) -> None:
    """Refuse (UsageError, one line) the first row of the table that holds for this run: model.path's config.json
    read as the plan reads it, this rank's device kind ("": not known yet, so no row about the device holds), the
    run's reserved rollout ranks. `rules`: only these ids (evenrl sft: SFT_RULES)."""
    try:
        dims = read_model_dims(cfg.model.path) if cfg.model.path else None
    except (ValueError, UsageError):  # no dimensions: the model's own checks name what is wrong with its files
        dims = None
    refuse(cfg, facts(dims, device, rollout_devices), rules)
