"""A cluster described by hand: `evenrl plan --nodes`, for a cluster the planner cannot see, and what the
datasheets say each known GPU model can do.

    evenrl plan CONFIG --nodes "8xH100-80,8xA10-24"          # 2 nodes: 8 H100 with 80 GiB, then 8 A10 with 24
    evenrl plan CONFIG --nodes "2*8xH100-80,8xL4-24"         # 3 nodes: two of 8 H100, one of 8 L4
    evenrl plan CONFIG --nodes "8xMI300X-192@520/3200"       # a model evenrl does not know: its rates given
    evenrl plan CONFIG --nodes "2xcpu-8,1xcpu-2"             # CPU processes (2 per node), 8 and 2 GiB each

Grammar: NODE[,NODE...], each NODE `[REPEAT*]COUNTxMODEL-GIB[@TFLOPS/GBPS]`: REPEAT nodes of COUNT devices of
MODEL with GIB memory each; TFLOPS and GBPS are the achieved dense matmul throughput and memory bandwidth of one
device (as --device-tflops and --device-gbps take them), for a model the table below lacks or to replace its rates.
Ranks are numbered node by node in the order given (torchrun's order), and the last --rollout-devices ranks only
generate: list the nodes whose devices should run the engines last. Every node has the same COUNT (torchrun starts
--nproc-per-node processes on each) and one kind (cpu, or GPUs). This is the same record per rank that
`evenrl train` gathers from its ranks at start (evenrl.distributed.devices.Device), so a described cluster plans
as the real one would.

Datasheet peaks (dense, no sparsity; NVIDIA's product datasheets): bf16 tensor TFLOP/s, fp32 TFLOP/s (no TF32),
memory GB/s. The step-time estimate takes 40% of the TFLOP/s and 60% of the bandwidth as achieved (as its H100
defaults do: evenrl.planner.timing).
Pure Python: never imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from evenrl.distributed.devices import KNOWN_MODELS, Device
from evenrl.errors import bad

# model -> (bf16 TFLOP/s, fp32 TFLOP/s, GB/s); SXM parts where there are several
DATASHEET = {"H200": (989.0, 67.0, 4800.0), "H100": (989.0, 67.0, 3350.0), "A100": (312.0, 19.5, 2039.0),
             "A10": (125.0, 31.2, 600.0), "L40S": (362.0, 91.6, 864.0), "L4": (121.0, 30.3, 300.0)}
assert set(DATASHEET) == set(KNOWN_MODELS)
FLOPS_SHARE, BANDWIDTH_SHARE = 0.4, 0.6  # what tuned training and decoding achieve of the peaks
MAX_NODES = 100_000
MAX_PER_NODE = 1024
MAX_WORLD = 131_072  # more ranks than any cluster has: a typo, refused before any arithmetic or expansion
MAX_GIB = 1_000_000.0
MAX_RATE = 1e7
_NODE = re.compile(r"(?:(\d+)\*)?(\d+)x([A-Za-z][A-Za-z0-9_.]*)-(\d+(?:\.\d+)?)(?:@(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?))?")
_FORM = "need NODE[,NODE...], each [REPEAT*]COUNTxMODEL-GIB[@TFLOPS/GBPS], e.g. 8xH100-80,8xA10-24"


@dataclass(frozen=True)
class Nodes:
    """What --nodes describes: nodes x devices per node, and every rank's device in rank order."""
    nnodes: int
    per_node: int
    devices: tuple[Device, ...]

    @property
    def kind(self) -> str:
        return self.devices[0].kind


def parse_nodes(text: str) -> Nodes:
    """--nodes' text as nodes and devices; a UsageError naming the part that is wrong otherwise."""
    if not str(text).strip():
        raise bad("--nodes", text, _FORM)
    specs = [part.strip() for part in str(text).split(",")]
    if len(specs) > MAX_NODES:
        raise bad("--nodes", f"{len(specs)} nodes", f"need at most {MAX_NODES} nodes")
    nodes: list[tuple[int, Device]] = []
    n_nodes = n_ranks = 0
    for spec in specs:
        m = _NODE.fullmatch(spec)
        if not m:
            raise bad("--nodes", spec, _FORM)
        if len(m[1] or "") > 6 or len(m[2]) > 4:  # counted from the text, before any number is expanded
            raise bad("--nodes", spec, f"need 1..{MAX_NODES} nodes of 1..{MAX_PER_NODE} devices")
        repeat, count, model, gib = int(m[1] or 1), int(m[2]), m[3], float(m[4])
        if not (1 <= repeat <= MAX_NODES and 1 <= count <= MAX_PER_NODE):
            raise bad("--nodes", spec, f"need 1..{MAX_NODES} nodes of 1..{MAX_PER_NODE} devices")
        n_nodes, n_ranks = n_nodes + repeat, n_ranks + repeat * count
        if n_nodes > MAX_NODES or n_ranks > MAX_WORLD:
            raise bad("--nodes", text, f"need at most {MAX_NODES} nodes and {MAX_WORLD} ranks; this is "
                                       f"{n_ranks:,} ranks or more")
        if not 0 < gib <= MAX_GIB:
            raise bad("--nodes", spec, f"need the memory of one device in GiB, in (0, {MAX_GIB:g}]")
        tflops, gbps = float(m[5] or 0), float(m[6] or 0)
        if m[5] and not (0 < tflops <= MAX_RATE and 0 < gbps <= MAX_RATE):
            raise bad("--nodes", spec, f"need @TFLOPS/GBPS as two numbers in (0, {MAX_RATE:g}]")
        known = {k.lower(): k for k in KNOWN_MODELS}
        kind = "cpu" if model.lower() == "cpu" else "cuda"
        name = "cpu" if kind == "cpu" else known.get(model.lower(), model)
        nodes += [(count, Device(kind, name, gib, 0, tflops, gbps))] * repeat
    counts, kinds = {c for c, _ in nodes}, {d.kind for _, d in nodes}
    if len(counts) > 1:
        raise bad("--nodes", text, f"every node needs the same number of devices (torchrun starts --nproc-per-node "
                                   f"processes on each); got {', '.join(map(str, sorted(counts)))}")
    if len(kinds) > 1:
        raise bad("--nodes", text, "one kind of device: cpu processes or GPUs, not both in one job")
    return Nodes(len(nodes), nodes[0][0], tuple(d for count, d in nodes for _ in range(count)))


def unknown_models(devices) -> list[str]:
    """GPU models among `devices` that the datasheet table lacks and whose rates were not given (@TFLOPS/GBPS)."""
    return sorted({d.model for d in devices if d.kind == "cuda" and not d.tflops and d.model not in DATASHEET})


def achieved_rates(device: Device, dtype: str) -> tuple[float, float] | None:
    """(TFLOP/s, GB/s) one device achieves in the compute dtype: as given in --nodes, else FLOPS_SHARE and
    BANDWIDTH_SHARE of its datasheet's; None for a GPU model not in the table (and for CPUs: their rates are
    evenrl.planner.timing's measured ones)."""
    if device.tflops:
        return device.tflops, device.gbps
    peaks = DATASHEET.get(device.model)
    if peaks is None:
        return None
    return FLOPS_SHARE * (peaks[0] if dtype == "bfloat16" else peaks[1]), BANDWIDTH_SHARE * peaks[2]


def datasheet_weights(devices, dtype: str) -> list[float] | None:
    """Relative speeds of `devices` (achieved TFLOP/s over the fastest's, 2 digits): where parallel.capacity_weights
    =auto starts. None when one is unknown or all are alike."""
    rates = [achieved_rates(d, dtype) for d in devices]
    if not rates or any(r is None for r in rates) or len({r[0] for r in rates}) == 1:
        return None
    top = max(r[0] for r in rates)
    return [float(f"{r[0] / top:.2g}") for r in rates]
