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
--nodes "8xH100-80,8xA10-24" instead describes every node's devices by hand (evenrl.planner.cluster): a cluster
of mixed devices, each rank with its own memory (`Layout.devices`, what evenrl train gathers from its ranks).
Pure Python: never imports torch (`evenrl plan` must not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Literal

from evenrl.distributed.devices import Device, DeviceGroup, cpu_share, device_groups, gib_text, host_memory_gib
from evenrl.distributed.env import read_env, read_int
from evenrl.errors import UsageError, bad
from evenrl.config.parallel import MAX_CAPACITY_WEIGHT, MIN_CAPACITY_WEIGHT
from evenrl.planner.cluster import MAX_WORLD, parse_nodes

MAX_NODES = 100_000
MAX_PROCS_PER_NODE = 1024
MAX_MEMORY_GIB = 1_000_000.0


@dataclass(frozen=True)
class Layout:
    nnodes: int = 1
    nproc_per_node: int = 1
    device: Literal["cpu", "cuda"] = "cpu"
    device_memory_gib: float = 0.0  # per rank; 0 = unknown (the memory check then only reports)
    capacity_weights: tuple[float, ...] | None = None  # one per training rank, relative speed
    rollout_devices: int = 0  # ranks that only generate (e.g. a vLLM server): they do not train
    source: str = "flags"  # flags | torchrun | slurm | local | --nodes
    # Every rank's device, in rank order, where known: gathered by evenrl train, or described by --nodes. None:
    # every rank is a `device` with `device_memory_gib` (which is then the smallest rank's memory).
    devices: tuple[Device, ...] | None = None

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def training_ranks(self) -> int:
        return self.world - self.rollout_devices

    def rank_devices(self) -> tuple[Device, ...]:
        """Every rank's device, in rank order."""
        if self.devices is not None:
            return self.devices
        return (Device(self.device, "cpu" if self.device == "cpu" else "gpu", self.device_memory_gib),) * self.world

    def training_groups(self) -> list[DeviceGroup]:
        """The training ranks by device (one group when all are alike)."""
        return device_groups(self.rank_devices(), range(max(self.training_ranks, 0)))

    def rollout_groups(self) -> list[DeviceGroup]:
        """The reserved rollout ranks (the last ones) by device."""
        return device_groups(self.rank_devices(), range(max(self.training_ranks, 0), self.world))

    def with_devices(self, devices: tuple[Device, ...]) -> Layout:
        """This layout with every rank's device as evenrl train gathered them (the world it joined may differ from
        what the environment suggested: then one node of them all)."""
        per_node = self.nproc_per_node if self.world == len(devices) else len(devices)
        return replace(self, nnodes=len(devices) // per_node, nproc_per_node=per_node, device=devices[0].kind,
                       device_memory_gib=min(d.memory_gib for d in devices), devices=tuple(devices))

    def describe(self) -> str:
        """'2 nodes x 4 cuda, 80 GiB each = 8 ranks: 7 training, 1 reserved for rollout  [flags]'."""
        m = self.device_memory_gib
        mem = (f", {m:.0f} GiB" if m >= 10 else f", {m:.1f} GiB") if m else ", memory unknown"
        mem += " each" if m and self.world > 1 else ""
        sizes = {d.memory_gib for d in self.rank_devices()}
        if len(sizes) > 1:  # the device groups are listed beside it (evenrl.planner.render)
            mem = f", {gib_text(min(sizes))}-{gib_text(max(sizes))} GiB"
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
        d["devices"] = None if self.devices is None else [
            {"ranks": list(g.ranks), "kind": g.device.kind, "model": g.device.model,
             "memory_gib": round(g.device.memory_gib, 3), "threads": g.device.threads,
             "role": "train" if g.ranks[0] < self.training_ranks else "rollout"}
            for g in self.training_groups() + self.rollout_groups()]
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
        if not weights or not all(MIN_CAPACITY_WEIGHT <= w <= MAX_CAPACITY_WEIGHT for w in weights):
            raise bad("--capacity-weights", capacity_weights, f"need numbers in [{MIN_CAPACITY_WEIGHT:g}, "
                                                              f"{MAX_CAPACITY_WEIGHT:g}], one per training rank")
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


def detect_local(env: Mapping[str, str] | None = None, run: Callable = subprocess.run) -> Layout:
    gpus = local_gpus(env, run)
    if gpus:
        # Mixed models: the smallest memory here; evenrl train plans again on every rank's own device
        return make_layout(1, len(gpus), device="cuda", device_memory_gib=min(gpus), source="local")
    return make_layout(1, 1, device="cpu", device_memory_gib=cpu_share(host_memory_gib(), 1), source="local")


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
    return make_layout(nnodes, per_node, device="cpu", device_memory_gib=cpu_share(host_memory_gib(), per_node),
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
    g.add_argument("--nodes", help="every node's devices, in rank order, e.g. 8xH100-80,8xA10-24 (replaces the "
                                   "four flags above; grammar: evenrl.planner.cluster)")


def layout_from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None,
                     run: Callable = subprocess.run) -> Layout:
    if getattr(ns, "nodes", None):
        base = Layout()  # apply_layout_flags puts the described nodes in
    elif has_shape_flags(ns):
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
    return make_layout(nnodes, per_node, device="cpu", device_memory_gib=cpu_share(host_memory_gib(), per_node))


def has_shape_flags(ns: argparse.Namespace) -> bool:
    return ns.nnodes is not None or ns.nproc_per_node is not None or getattr(ns, "nodes", None) is not None


def apply_layout_flags(base: Layout, ns: argparse.Namespace) -> Layout:
    """--nodes replaces the shape and devices (a peer's config keeps its count of reserved rollout devices);
    --device, --device-memory-gib, --capacity-weights and --rollout-devices override single fields."""
    if getattr(ns, "nodes", None) is not None:  # '' too: parse_nodes says what --nodes needs
        given = [f for f, v in (("--nnodes", ns.nnodes), ("--nproc-per-node", ns.nproc_per_node),
                                ("--device", ns.device), ("--device-memory-gib", ns.device_memory_gib)) if v is not None]
        if given:
            raise UsageError(f"--nodes describes every node's devices; drop {' and '.join(given)}")
        nodes = parse_nodes(ns.nodes)
        shape = make_layout(nodes.nnodes, nodes.per_node, device=nodes.kind,  # checks the world's size too
                            device_memory_gib=min(d.memory_gib for d in nodes.devices))
        base = replace(base, nnodes=shape.nnodes, nproc_per_node=shape.nproc_per_node, device=shape.device,
                       device_memory_gib=shape.device_memory_gib, source="--nodes", devices=nodes.devices)
    changes = {}
    if ns.device is not None and ns.device != base.device:
        changes["device"] = ns.device
        if ns.device_memory_gib is None:  # the detected memory belonged to the other kind of device
            cpu = cpu_share(host_memory_gib(), base.nproc_per_node) if ns.device == "cpu" else 0.0
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
    if text.count(",") >= MAX_WORLD:  # counted before anything is parsed
        raise argparse.ArgumentTypeError(f"got {text.count(',') + 1} weights; need at most {MAX_WORLD}")
    try:
        ws = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text[:80]!r}; need comma-separated numbers, e.g. 1,1,2,2") from None
    if not all(MIN_CAPACITY_WEIGHT <= w <= MAX_CAPACITY_WEIGHT for w in ws):  # NaN fails both
        raise argparse.ArgumentTypeError(f"got {text[:80]!r}; every weight must be a relative speed in "
                                         f"[{MIN_CAPACITY_WEIGHT:g}, {MAX_CAPACITY_WEIGHT:g}]")
    return ws
