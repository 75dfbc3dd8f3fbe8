"""What a train.reproducibility=bitwise process fixes about itself (docs/reproducibility.md): one intra-op thread
on CPU (a parallel reduction's bits depend on how it is split over threads, and the thread count a launch gets
depends on how many processes share the machine), deterministic kernels on CUDA, vLLM's batch-invariant mode. A
setting that would break it is refused in one line. `environment` runs before anything touches CUDA or vLLM (the
launcher and each worker), `settle` once the process knows its device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from evenrl.config import RunConfig
from evenrl.errors import UsageError, bad

if TYPE_CHECKING:
    import torch


def bitwise(cfg: RunConfig) -> bool:
    return cfg.train.reproducibility == "bitwise"


def environment(cfg: RunConfig) -> None:
    """The variables libraries read when they start: cuBLAS's workspace for deterministic GEMMs, vLLM's
    batch-invariant kernels (VLLM_BATCH_INVARIANT, on GPU; vLLM's CPU build is refused by the plan)."""
    if not bitwise(cfg):
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if cfg.rollout.engine == "vllm":
        os.environ["VLLM_BATCH_INVARIANT"] = "1"


def settle(cfg: RunConfig, device: "torch.device") -> None:
    """This process's threads and kernels for a bitwise run; OMP_NUM_THREADS other than 1 on CPU is refused."""
    if not bitwise(cfg):
        return
    import torch  # here: the launcher imports this module for `environment` before it needs torch

    environment(cfg)
    if device.type == "cpu":
        threads = os.environ.get("OMP_NUM_THREADS", "").strip()
        if threads not in ("", "1"):
            raise bad("OMP_NUM_THREADS", threads, "1 or unset with train.reproducibility=bitwise on CPU (every "
                                                  "process computes with one thread: a sum's bits depend on how it is "
                                                  "split over threads)")
        torch.set_num_threads(1)
        return
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def check_resumed(meta: dict) -> dict | None:
    """The settings a checkpoint's meta.json recorded for a bitwise resume (planner.reproducibility), or None for a
    checkpoint of an older version."""
    found = meta.get("settings")
    if found is not None and not isinstance(found, dict):
        raise UsageError(f"checkpoint meta.json: settings is a {type(found).__name__}; expected what evenrl train "
                         "writes")
    return found
