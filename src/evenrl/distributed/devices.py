"""What each rank computes on: its device's kind, model, memory and (CPU) threads, as one typed record per rank.
`evenrl.distributed.mesh.init` probes this rank's device and gathers every rank's record once, at start
(`DistInfo.devices`); `evenrl plan --nodes "8xH100-80,8xA10-24"` builds the same records by hand for a cluster the
planner cannot see (evenrl.planner.cluster). Pure Python: never imports torch (the planner uses it).

    Device("cuda", "H100", 79.2)      ranks on the same kind, model and memory form one device group
    Device("cpu", "cpu", 7.6, 1)      a CPU process: the host's memory shared by the node's processes, 1 thread
    device_groups(devices) -> [DeviceGroup("H100-79", (0, ..., 7), ...), DeviceGroup("A10-22", (8, ..., 15), ...)]

A GPU's model is the first known name in what the driver calls it ("NVIDIA H100 80GB HBM3" -> "H100"), else that
name without the vendor's prefix. A CPU process may use the host's memory (MemTotal, or the container's cgroup
limit when lower) less HOST_RESERVE_GIB for the system, shared by the node's processes, and the threads torch
runs its kernels on (OMP_NUM_THREADS, torch.set_num_threads).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# CPU ranks on one host share its memory; this much is left for the OS and other processes.
HOST_RESERVE_GIB = 1.0
# Checked in this order: "A100" before "A10", "L40S" before "L4" (word boundaries do the rest).
KNOWN_MODELS = ("H200", "H100", "A100", "A10", "L40S", "L4")
_VENDOR = re.compile(r"^(NVIDIA|AMD|Intel)\s+", re.IGNORECASE)


@dataclass(frozen=True)
class Device:
    kind: Literal["cuda", "cpu"]
    model: str  # "H100", "A10", "cpu", or the driver's name of a model evenrl does not know
    memory_gib: float  # what this rank may use; 0 = unknown
    threads: int = 0  # CPU: threads torch computes on; 0 on GPUs (not a limit there)
    # achieved dense TFLOP/s and memory GB/s, when described by hand (evenrl plan --nodes ...@TFLOPS/GBPS);
    # 0: the planner's datasheet rates for the model
    tflops: float = 0.0
    gbps: float = 0.0

    @property
    def label(self) -> str:
        """'H100-80', 'cpu-7.6': the model and its memory, as `evenrl plan --nodes` takes them."""
        return f"{self.model}-{gib_text(self.memory_gib)}"

    def describe(self) -> str:
        """'H100-80 (cuda)', 'cpu-7.6 (2 threads)'."""
        extra = f"{self.threads} thread{'' if self.threads == 1 else 's'}" if self.kind == "cpu" else self.kind
        return f"{self.label} ({extra})"


@dataclass(frozen=True)
class DeviceGroup:
    """Ranks on equal devices: what the plan shows as one row, with its own memory and token cap."""
    device: Device
    ranks: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{len(self.ranks)}x{self.device.label}"


def gib_text(gib: float) -> str:
    """80 -> '80', 79.19 -> '79', 7.63 -> '7.6', 0.31 -> '0.31'."""
    if gib >= 10:
        return f"{gib:.0f}"
    return f"{gib:.2g}" if gib < 1 else f"{gib:.1f}".rstrip("0").rstrip(".")


def model_of(driver_name: str) -> str:
    """The model a GPU's driver name names: 'NVIDIA A100-SXM4-80GB' -> 'A100'; unknown ones keep their name."""
    for model in KNOWN_MODELS:
        if re.search(rf"(?<![A-Za-z0-9]){model}(?![0-9A-Za-z])", driver_name, re.IGNORECASE):
            return model
    return _VENDOR.sub("", driver_name).strip().replace(" ", "_") or "gpu"


def device_groups(devices, ranks=None) -> list[DeviceGroup]:
    """Ranks with equal devices, in order of their first rank. `ranks`: only these (default all)."""
    chosen = range(len(devices)) if ranks is None else ranks
    out: dict[Device, list[int]] = {}
    for r in chosen:
        out.setdefault(devices[r], []).append(r)
    return [DeviceGroup(d, tuple(rs)) for d, rs in out.items()]


def host_memory_gib(path: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup/memory.max") -> float:
    """The host's memory in GiB, or a container's cgroup (v2) limit when that is lower; 0 when unreadable."""
    total = 0.0
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) / 1024**2
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(cgroup, encoding="ascii") as f:
            limit = f.read().strip()
        if limit.isdigit() and (not total or int(limit) / 1024**3 < total):
            total = int(limit) / 1024**3
    except OSError:
        pass
    return total


def cpu_share(host_gib: float, procs: int) -> float:
    """Memory one of `procs` CPU processes on a host of `host_gib` may plan for (0 when unknown)."""
    return max(0.0, (host_gib - HOST_RESERVE_GIB) / procs) if host_gib else 0.0
