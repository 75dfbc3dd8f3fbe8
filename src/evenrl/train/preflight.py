"""The plan `evenrl train` makes before anything loads (the one `evenrl plan` prints): by the launcher once, for
the layout it is about to start, and by every rank again on the devices the run really has. An error finding
stops the run there, every one of them listed. Torch-free, so the launcher's check takes as long as `evenrl plan`.
"""

from __future__ import annotations

import os

from evenrl.config import RunConfig
from evenrl.errors import UsageError


def preflight(cfg: RunConfig, layout=None, resumed: dict | None = None):
    """The plan for `layout` (default: what the launch environment and this machine say); its error findings as
    one UsageError, a line each. `resumed`: the settings the checkpoint being resumed recorded."""
    from evenrl.planner.layout import detect_local, layout_from_env
    from evenrl.planner.plan import make_plan

    if cfg.rollout.engine == "vllm" and layout is None:
        from evenrl.engines.vllm_engine import require

        require()
    plan = make_plan(cfg, layout or layout_from_env(os.environ) or detect_local(), resumed=resumed)
    errors = [f for f in plan.findings if f.level == "error"]
    if errors:
        lines = [f"plan {e.rule}: {e.message}; fix: " + "; ".join(x.strip() for x in e.fix.splitlines() if x.strip())
                 for e in errors]
        raise UsageError("\n".join(lines) if len(lines) == 1 else
                         f"{len(lines)} problems (evenrl plan shows them with the plan):\n" + "\n".join(lines))
    return plan


def launch_layout(nnodes: int, nproc_per_node: int):
    """The layout `evenrl train --nnodes N --nproc-per-node P` is about to start, on this machine's kind of device
    (what `evenrl plan` with the same flags plans)."""
    from argparse import Namespace

    from evenrl.planner.layout import layout_from_args

    return layout_from_args(Namespace(nnodes=nnodes, nproc_per_node=nproc_per_node, rollout_devices=None, device=None,
                                      device_memory_gib=None, capacity_weights=None, nodes=None))

