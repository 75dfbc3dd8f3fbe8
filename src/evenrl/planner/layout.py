"""The cluster layout a run is planned for: nodes x processes, device kind and memory, capacity weights,
and devices reserved for rollout (which do not train).

    evenrl plan examples/plan_512x8.yaml --nnodes 8 --nproc-per-node 8 --device cuda --device-memory-gib 80

Where the layout comes from, first match wins:
  1. flags: --nnodes/--num-nodes, --nproc-per-node/--num-gpus (missing ones default to 1), on this machine's
     kind of device and memory (its GPUs, else CPU processes sharing the host's memory);
  2. the torchrun or Slurm environment, read by `evenrl.distributed.env` (the rules every reader of it shares):
     its nodes and processes per node; under Slurm with one task per node, SLURM_GPUS_ON_NODE processes per node
     (the task runs torchrun over the node's GPUs);
  3. this machine: CUDA_VISIBLE_DEVICES and `nvidia-smi` (2 s timeout), else one CPU process with the host's memory.
--device, --device-memory-gib, --capacity-weights and --rollout-devices then override single fields.
Pure Python: never imports torch (`evenrl plan` must not).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Literal

from evenrl.distributed.env import read_env, read_int
from evenrl.errors import bad

MAX_NODES = 100_000
MAX_PROCS_PER_NODE = 1024
MAX_WORLD = 131_072  # more ranks than any cluster has: a typo, refused before any arithmetic
MAX_MEMORY_GIB = 1_000_000.0
# CPU ranks on one host share its memory; this much is left for the OS and other processes.
HOST_RESERVE_GIB = 1.0


@dataclass(frozen=True)
class Layout:
    nnodes: int = 1
    nproc_per_node: int = 1
    device: Literal["cpu", "cuda"] = "cpu"
    device_memory_gib: float = 0.0  # per rank; 0 = unknown (the memory check then only reports)
    capacity_weights: tuple[float, ...] | None = None  # one per training rank, relative speed
    rollout_devices: int = 0  # ranks that only generate (e.g. a vLLM server): they do not train
    source: str = "flags"  # flags | torchrun | slurm | local

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def training_ranks(self) -> int:
        return self.world - self.rollout_devices

    def describe(self) -> str:
        """'2 nodes x 4 cuda, 80 GiB each = 8 ranks: 7 training, 1 reserved for rollout  [flags]'."""
        m = self.device_memory_gib
        mem = (f", {m:.0f} GiB" if m >= 10 else f", {m:.1f} GiB") if m else ", memory unknown"
        mem += " each" if m and self.world > 1 else ""
        node = "node" if self.nnodes == 1 else "nodes"
        text = f"{self.nnodes} {node} x {self.nproc_per_node} {self.device}{mem} = "
        if self.rollout_devices:
            text += (f"{self.world} ranks: {max(self.training_ranks, 0)} training, "
                     f"{self.rollout_devices} reserved for rollout")
        else:
            text += f"{self.world} training rank{'' if self.world == 1 else 's'}"
        if self.capacity_weights:
            text += f", capacity weights {_runs(self.capacity_weights)}"
        return text + f"  [{self.source}]"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["capacity_weights"] = list(self.capacity_weights) if self.capacity_weights else None
        d.update(world=self.world, training_ranks=self.training_ranks)
        return d


def _runs(ws: tuple[float, ...]) -> str:
    """1,1,1,2,2 -> '1x3,2x2' (a 64-rank list stays one short line)."""
    out, i = [], 0
    while i < len(ws):
        j = i
        while j < len(ws) and ws[j] == ws[i]:
            j += 1
        out.append(f"{ws[i]:g}" + (f"x{j - i}" if j - i > 1 else ""))
        i = j
    return ",".join(out)


def make_layout(nnodes: int = 1, nproc_per_node: int = 1, *, device: str = "cpu", device_memory_gib: float = 0.0,
                capacity_weights=None, rollout_devices: int = 0, source: str = "flags") -> Layout:
    """A validated Layout; impossible values raise UsageError. Layouts that parse but cannot train
    (rollout_devices >= world, weights of the wrong length) are the planner's findings, not errors here."""
    for name, v, hi in (("--nnodes", nnodes, MAX_NODES), ("--nproc-per-node", nproc_per_node, MAX_PROCS_PER_NODE)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise bad(name, v, f"need an integer in 1..{hi}")
    if nnodes * nproc_per_node > MAX_WORLD:
        raise bad("--nnodes x --nproc-per-node", nnodes * nproc_per_node, f"need at most {MAX_WORLD} ranks")
    if device not in ("cpu", "cuda"):
        raise bad("--device", device, "choose cpu or cuda")
    if not (isinstance(device_memory_gib, (int, float)) and 0 <= device_memory_gib <= MAX_MEMORY_GIB):
        raise bad("--device-memory-gib", device_memory_gib, f"need a number of GiB in 0..{MAX_MEMORY_GIB:g}")
    if isinstance(rollout_devices, bool) or not isinstance(rollout_devices, int) or rollout_devices < 0:
        raise bad("--rollout-devices", rollout_devices, "need an integer >= 0")
    weights = None
    if capacity_weights is not None:
        weights = tuple(float(w) for w in capacity_weights)
        if not weights or not all(w > 0 and math.isfinite(w) for w in weights):
            raise bad("--capacity-weights", capacity_weights, "need positive numbers, one per training rank")
    return Layout(nnodes, nproc_per_node, device, float(device_memory_gib), weights, rollout_devices, source)


# ------------------------------------------------------------------------------------------ this machine

def local_gpus(env: Mapping[str, str] | None = None, run: Callable = subprocess.run) -> list[float]:
    """Memory (GiB) of each visible GPU, from nvidia-smi (no torch). CUDA_VISIBLE_DEVICES selects/limits them;
    an empty or '-1' value hides all. Without nvidia-smi, listed devices count with unknown memory (0)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = None if visible is None else [x.strip() for x in visible.split(",") if x.strip()]
    if ids is not None and (not ids or ids[0].startswith("-")):
        return []
    mems: list[float] = []
    if shutil.which("nvidia-smi") or run is not subprocess.run:
        try:
            out = run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                      capture_output=True, text=True, timeout=2.0)
            if out.returncode == 0:
                mems = [float(x.split()[0]) / 1024 for x in out.stdout.splitlines() if x.strip()]
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            mems = []
    if ids is None:
        return mems
    if all(i.isdigit() for i in ids) and mems:
        return [mems[int(i)] for i in ids if int(i) < len(mems)]
    return mems[: len(ids)] if mems else [0.0] * len(ids)


def host_memory_gib(path: str = "/proc/meminfo") -> float:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024**2
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def detect_local(env: Mapping[str, str] | None = None, run: Callable = subprocess.run) -> Layout:
    gpus = local_gpus(env, run)
    if gpus:
        # Mixed models: plan for the smallest memory; speed differences are --capacity-weights' job.
        return make_layout(1, len(gpus), device="cuda", device_memory_gib=min(gpus), source="local")
    return make_layout(1, 1, device="cpu", device_memory_gib=_cpu_share(host_memory_gib(), 1), source="local")


def _cpu_share(host_gib: float, procs: int) -> float:
    return max(0.0, (host_gib - HOST_RESERVE_GIB) / procs) if host_gib else 0.0


def layout_from_env(env: Mapping[str, str] | None = None, run: Callable = subprocess.run) -> Layout | None:
    """The layout torchrun or Slurm describes (`evenrl.distributed.env`), on this machine's kind of device;
    None outside both."""
    env = os.environ if env is None else env
    d = read_env(env)
    if d.source is None:
        return None
    gpus = local_gpus(env, run)
    nnodes = min(max(d.nnodes, 1), MAX_NODES)
    per_node = min(max(d.local_world, 1), MAX_PROCS_PER_NODE)
    if d.source == "slurm" and per_node == 1:
        per_node = read_int(env, "SLURM_GPUS_ON_NODE", 0) or per_node  # one task per node runs torchrun
    if gpus:
        return make_layout(nnodes, per_node, device="cuda", device_memory_gib=min(gpus), source=d.source)
    return make_layout(nnodes, per_node, device="cpu", device_memory_gib=_cpu_share(host_memory_gib(), per_node),
                       source=d.source)


# ------------------------------------------------------------------------------------------ flags

def add_layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout (default: torchrun/Slurm environment, else this machine)")
    g.add_argument("--nnodes", "--num-nodes", type=_count("--nnodes"), help="number of nodes")
    g.add_argument("--nproc-per-node", "--num-gpus", type=_count("--nproc-per-node"),
                   help="processes (devices) per node")
    g.add_argument("--rollout-devices", type=_count("--rollout-devices", 0), default=None,
                   help="devices that only generate (e.g. a vLLM server); they do not train")
    g.add_argument("--device", choices=["cpu", "cuda"], help="device kind")
    g.add_argument("--device-memory-gib", type=_gib, help="memory per device (GiB)")
    g.add_argument("--capacity-weights", type=_weights, help="relative speed per training rank, e.g. 1,1,2,2")


def layout_from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None,
                     run: Callable = subprocess.run) -> Layout:
    if has_shape_flags(ns):
        base = _shape_on_this_machine(ns, env, run)
    else:
        base = layout_from_env(env, run) or detect_local(env, run)
    return apply_layout_flags(base, ns)


def _shape_on_this_machine(ns: argparse.Namespace, env: Mapping[str, str] | None, run: Callable) -> Layout:
    """The flags' nodes x processes on this machine's kind of device, as detect_local sees it: its GPUs (the
    smallest one's memory) or, without any, CPU processes sharing the host's memory. --device and
    --device-memory-gib then override; nvidia-smi is skipped when they already say all it would."""
    nnodes, per_node = ns.nnodes or 1, ns.nproc_per_node or 1
    told = ns.device == "cpu" or (ns.device == "cuda" and ns.device_memory_gib is not None)
    gpus = [] if told else local_gpus(env, run)
    if gpus or ns.device == "cuda":
        return make_layout(nnodes, per_node, device="cuda", device_memory_gib=min(gpus, default=0.0))
    return make_layout(nnodes, per_node, device="cpu", device_memory_gib=_cpu_share(host_memory_gib(), per_node))


def has_shape_flags(ns: argparse.Namespace) -> bool:
    return ns.nnodes is not None or ns.nproc_per_node is not None


def apply_layout_flags(base: Layout, ns: argparse.Namespace) -> Layout:
    """--device, --device-memory-gib, --capacity-weights and --rollout-devices override single fields."""
    changes = {}
    if ns.device is not None and ns.device != base.device:
        changes["device"] = ns.device
        if ns.device_memory_gib is None:  # the detected memory belonged to the other kind of device
            cpu = _cpu_share(host_memory_gib(), base.nproc_per_node) if ns.device == "cpu" else 0.0
            changes["device_memory_gib"] = cpu
    if ns.device_memory_gib is not None:
        changes["device_memory_gib"] = ns.device_memory_gib
    if ns.capacity_weights is not None:
        changes["capacity_weights"] = ns.capacity_weights
    if ns.rollout_devices is not None:
        changes["rollout_devices"] = ns.rollout_devices
    return replace(base, **changes) if changes else base


def _count(flag: str, lo: int = 1):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; need an integer >= {lo}") from None
        hi = MAX_PROCS_PER_NODE if flag == "--nproc-per-node" else MAX_NODES
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"got {v}; need an integer in {lo}..{hi}")
        return v
    return parse


def positive_number(unit: str, example: str, most: float) -> Callable[[str], float]:
    """An argparse type: a number in (0, most] of `unit`, else a message naming the value and what is allowed."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; need a number of {unit}, e.g. {example}") from None
        if not (0 < v <= most):
            raise argparse.ArgumentTypeError(f"got {text}; need a number of {unit} in (0, {most:g}]")
        return v
    return parse


_gib = positive_number("GiB", "80", MAX_MEMORY_GIB)


def _weights(text: str) -> tuple[float, ...]:
    try:
        ws = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; need comma-separated numbers, e.g. 1,1,2,2") from None
    if not all(w > 0 and math.isfinite(w) for w in ws):
        raise argparse.ArgumentTypeError(f"got {text!r}; every weight must be a positive number")
    return ws
