"""The settings that make a run fit its devices' memory (evenrl.planner.memory's estimate): each knob applied
alone, with the peak it leaves; the most rows per micro-batch that fit. What `evenrl plan` lists and `--fit`
applies. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from evenrl.config import RunConfig, with_settings
from evenrl.models.vision_config import worst_vision_tokens
from evenrl.planner.dims import ModelDims
from evenrl.planner.layout import Layout
from evenrl.planner.memory import VLLM_GPU_SHARE, compute_bytes, estimate_memory
from evenrl.planner.split_model import engine_need, engine_splits, share_needed, tensor_sizes
from evenrl.planner.text import plural

LORA_RANK = 16  # what memory_fixes proposes (TRL's default lora_r)
TIGHT = 0.9  # of device memory: a peak above it is memory-tight, where fragmentation may push a run over


@dataclass(frozen=True)
class MemoryFix:
    settings: dict[str, Any]  # dotted key -> value
    total_gib: float  # estimated peak after applying this fix alone
    fits: bool
    why: str = ""

    def text(self) -> str:
        s = " ".join(f"{k}={_show(v)}" for k, v in self.settings.items())
        return f"{s}{f' ({self.why})' if self.why else ''} -> {self.total_gib:.1f} GiB"


def _show(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def memory_fixes(cfg: RunConfig, layout: Layout, dims: ModelDims,
                 ranks: tuple[int, ...] | None = None) -> list[MemoryFix]:
    """Each knob applied alone, with the estimated peak after it; best first. Knobs that do not lower the
    estimate are left out. Needs a known device memory to size the token cap and prompt count. `ranks`: the
    training ranks whose peak counts (a device group's; default all)."""
    cap = layout.device_memory_gib
    base = estimate_memory(cfg, layout, dims, ranks).total_gib
    fixes: list[MemoryFix] = []

    def add(settings: dict, why: str = "") -> None:
        try:
            total = estimate_memory(with_settings(cfg, settings), layout, dims, ranks).total_gib
        except ValueError:  # a setting the config refuses (pydantic's ValidationError is a ValueError)
            return
        if total < base - 1e-6:
            fixes.append(MemoryFix(settings, total, bool(cap) and total <= cap, why))

    length = cfg.sample_tokens()
    tokens = estimate_memory(cfg, layout, dims, ranks).micro_tokens  # one rank's
    rows = tokens // length
    if rows > 1:
        r = rows_that_fit(cfg, layout, dims, rows - 1, ranks) or 1
        add({"train.token_cap_per_micro_batch": r * row_tokens(cfg, dims)},
            f"{r} row{'s' if r > 1 else ''} per micro-batch")
    if not cfg.model.gradient_checkpointing:
        add({"model.gradient_checkpointing": True})
    # bitwise: a TP or SP degree is part of the run's bits (TP t is one run on any data layout, not TP 1's), and EP
    # e is one process's run only where measured (Qwen3-MoE, gpt-oss): --fit changes none of them
    split_model = cfg.train.reproducibility != "bitwise"
    sp = cfg.parallel.sequence_parallel_size
    # splitting samples pays once a micro-batch is down to one sample
    if split_model and tokens * sp <= length + sp and (split := sequence_parallel_fix(cfg, layout, dims, ranks)):
        add(sequence_settings(cfg, dims, split), f"each sample over {split} ranks, "
            f"{layout.training_ranks // split} data-parallel groups")
    tp = cfg.parallel.tensor_parallel_size
    data = layout.training_ranks // tp  # FSDP shards over the data group
    if split_model and (ep := expert_parallel_fix(cfg, layout, dims, ranks)) is not None:
        add({"parallel.expert_parallel_size": ep}, f"{dims.experts // ep} of {dims.experts} experts per rank")
    if cfg.parallel.sharding == "replicated" and data > 1:
        add({"parallel.sharding": "fsdp"}, f"over {data} ranks")
    if split_model and (split := tensor_parallel_fix(cfg, layout, dims, ranks)) is not None:
        size = split["parallel.tensor_parallel_size"]
        add(split, f"each layer split over {size} ranks, "
            f"{plural(layout.training_ranks // (size * sp), 'data-parallel group')}"
            + (f", the experts over {split['parallel.expert_parallel_size']}" if dims.experts else ""))
    # offload needs fsdp and an accelerator, and no tensor or expert parallelism (planner.tensor_parallel, .moe)
    if cfg.parallel.cpu_offload != "full" and layout.device != "cpu" and tp == 1 == cfg.parallel.expert_parallel_size:
        add({"parallel.sharding": "fsdp", "parallel.cpu_offload": "full"} if cfg.parallel.sharding == "replicated"
            else {"parallel.cpu_offload": "full"}, "state on the host")
    if cfg.algo.kl_coef > 0:
        add({"algo.kl_coef": 0.0}, "no reference model")
    if (share := engine_share_fix(cfg, layout, dims, ranks)) is not None:
        add({"rollout.memory_fraction": share}, "the engine's share of the device" if share else "")
    if (engine := engine_parallel_fix(cfg, layout, dims, ranks)) is not None:
        add(engine, f"one engine over {engine['rollout.tensor_parallel_size']} devices, a smaller share of each")
    if cfg.model.dtype == "float32" and layout.device == "cuda":
        add({"model.dtype": "bfloat16"})
    if cfg.model.weights_dtype == "float32" and not cfg.model.lora.rank and cfg.train.reproducibility != "bitwise":
        add({**({"model.dtype": "bfloat16"} if cfg.model.dtype == "float32" else {}),
             "model.weights_dtype": "bfloat16"}, "bf16 weights and AdamW state: other numbers than fp32 AdamW's")
    if not cfg.model.lora.rank:  # LoRA trains adapters only: no full-size gradients, moments or reference
        add({"model.lora.rank": LORA_RANK}, "adapters on a frozen base")
    prompts = cfg.data.prompts_per_step
    if prompts > 1:
        best = _largest(1, prompts - 1, lambda n: _fits(cfg, layout, dims, {"data.prompts_per_step": n}, ranks))
        add({"data.prompts_per_step": best or 1}, "fewer samples per rank")
    fixes.sort(key=lambda f: f.total_gib)
    return fixes


def tight_fix(fixes: list[MemoryFix], memory_gib: float) -> str:
    """memory-tight's fix: the fixes (each alone) that bring the peak under TIGHT of `memory_gib`, else those that
    lower it most; at most three, best first. Each changes a setting (memory_fixes proposes none already set)."""
    room = [f for f in fixes if f.total_gib <= TIGHT * memory_gib] or fixes
    return "each alone, best first: " + "; ".join(f.text() for f in room[:3]) if room else \
        "devices with more memory"


def sequence_sizes(cfg: RunConfig, layout: Layout, dims: ModelDims) -> list[int]:
    """The sequence_parallel_size values the layout and model allow and a fix proposes: divisors of the training
    ranks over tensor parallelism that divide the query heads a rank holds (Ulysses gives each rank heads / SP of
    them), an SP x TP replica within one node (every layer's all-to-all on the node's own links); none above 1 for
    a vision-language model (not supported yet: rule_sequence_parallel)."""
    tp = max(1, min(cfg.parallel.tensor_parallel_size, max(layout.training_ranks, 1)))
    t, heads = max(layout.training_ranks, 1) // tp, dims.heads // tp
    if dims.vision is not None:
        return [1]
    return [s for s in range(1, min(t, layout.nproc_per_node // tp) + 1) if t % s == 0 and heads % s == 0] or [1]


def tensor_parallel_fix(cfg: RunConfig, layout: Layout, dims: ModelDims,
                        ranks: tuple[int, ...] | None = None) -> dict[str, int] | None:
    """The smallest parallel.tensor_parallel_size above the configured one that the model and layout allow
    (planner.split_model.tensor_sizes over the training ranks left by sequence parallelism, the query heads a rank
    holds divisible by SP) and that fits the device memory; where none fits, the largest (the lowest peak); None
    when there is no larger one, or with cpu_offload=full (which tensor parallelism does not run with). A mixture of
    experts needs expert parallelism beside it (config.compatibility): the configured expert_parallel_size where it
    is above 1, else the largest the model and layout allow (most experts off each rank)."""
    sp, t = cfg.parallel.sequence_parallel_size, max(layout.training_ranks, 1)
    if cfg.parallel.cpu_offload == "full" or t % sp:
        return None
    options = []
    for s in tensor_sizes(dims, t // sp, layout.nproc_per_node, layout.nnodes):
        if s <= cfg.parallel.tensor_parallel_size or (dims.heads // s) % sp:
            continue
        settings = {"parallel.tensor_parallel_size": s}
        if dims.experts:
            eps = [e for e in expert_parallel_sizes(cfg, layout, dims) if e > 1]
            if not eps:
                continue
            ep = cfg.parallel.expert_parallel_size
            settings["parallel.expert_parallel_size"] = ep if ep in eps else eps[-1]
        options.append(settings)
    return next((o for o in options if _fits(cfg, layout, dims, o, ranks)), options[-1] if options else None)


def engine_share_fix(cfg: RunConfig, layout: Layout, dims: ModelDims,
                     ranks: tuple[int, ...] | None = None) -> float | None:
    """A smaller rollout.memory_fraction where the engine's share is what does not fit: the hf engine reserves
    nothing (0); a vLLM engine on a GPU the largest share, in hundredths, under the one it has (0: vLLM's 0.3) that
    fits the device, and never under what its weights, one sample's KV cache and its activations need
    (engine_fraction), preferring a peak under memory-tight's line (TIGHT) where some share leaves one; vLLM on CPU
    its default KV room (0: 1 GiB). None when there is nothing to lower."""
    if cfg.rollout.engine != "vllm" or layout.device != "cuda":
        return 0.0 if cfg.rollout.memory_fraction > 0 else None
    if layout.rollout_devices:  # the engines are on the reserved devices: not in the training ranks' estimate
        return None
    now, need = cfg.rollout.memory_fraction or VLLM_GPU_SHARE, engine_fraction(cfg, layout, dims)
    lo, hi = math.ceil(need * 100), math.ceil(now * 100) - 1
    if lo > hi:
        return None
    for room in (TIGHT, 1.0):  # under memory-tight's line where a share leaves it, else under the device's memory
        def fits(n: int) -> bool:
            return _fits(cfg, layout, dims, {"rollout.memory_fraction": n / 100}, ranks, room)
        if fits(lo):
            return _largest(lo, hi, fits) / 100
    return lo / 100


def engine_parallel_fix(cfg: RunConfig, layout: Layout, dims: ModelDims,
                        ranks: tuple[int, ...] | None = None) -> dict[str, Any] | None:
    """A vLLM engine on GPUs over more devices, each holding less of it: the smallest rollout.tensor_parallel_size
    above the configured one (planner.tensor_parallel.engine_splits) that fits at the largest share that does
    (engine_share_fix); where none fits, the largest with its smallest share; None where there is no larger one."""
    if cfg.rollout.engine != "vllm" or layout.device != "cuda" or layout.rollout_devices:
        return None
    last = None
    for size in (e for e in engine_splits(layout, dims) if e > cfg.rollout.tensor_parallel_size):
        share = engine_share_fix(with_settings(cfg, {"rollout.tensor_parallel_size": size}), layout, dims, ranks)
        last = {"rollout.tensor_parallel_size": size, **({} if share is None else {"rollout.memory_fraction": share})}
        if _fits(cfg, layout, dims, last, ranks):
            break
    return last


def engine_fraction(cfg: RunConfig, layout: Layout, dims: ModelDims) -> float:
    """The smallest rollout.memory_fraction whose share of a device holds a vLLM engine's weights, one sample's KV
    cache and its own activations there (planner.split_model.engine_need); 1.0 when no share does."""
    need = engine_need(dims, compute_bytes(cfg.model.dtype), cfg.rollout.tensor_parallel_size, cfg.sample_tokens())
    return share_needed(need, layout.device_memory_gib)


def sequence_parallel_fix(cfg: RunConfig, layout: Layout, dims: ModelDims,
                          ranks: tuple[int, ...] | None = None) -> int | None:
    """The smallest sequence_parallel_size above the configured one that fits the device memory (the rest of the
    config as it is); where none does, the largest allowed (the lowest peak); None when there is no larger one."""
    sizes = [s for s in sequence_sizes(cfg, layout, dims) if s > cfg.parallel.sequence_parallel_size]
    return next((s for s in sizes if _fits(cfg, layout, dims, sequence_settings(cfg, dims, s), ranks)),
                sizes[-1] if sizes else None)


def expert_parallel_sizes(cfg: RunConfig, layout: Layout, dims: ModelDims) -> list[int]:
    """The expert_parallel_size values a layout and model allow, ascending: divisors of the training ranks (the ep
    groups borrow them, tensor-parallel ones too) that divide the experts ([1] for a dense or vision-language model:
    config.compatibility refuses it)."""
    if not dims.experts or dims.vision is not None:
        return [1]
    ranks = max(layout.training_ranks, 1)
    return [e for e in range(1, ranks + 1) if not ranks % e and not dims.experts % e]


def expert_parallel_fix(cfg: RunConfig, layout: Layout, dims: ModelDims,
                        ranks: tuple[int, ...] | None = None) -> int | None:
    """The smallest expert_parallel_size above the configured one that fits the device memory, within a node where
    one does (every MoE layer's all-to-all on the node's own links); else the largest allowed (the lowest peak);
    None when there is no larger one."""
    sizes = [e for e in expert_parallel_sizes(cfg, layout, dims) if e > cfg.parallel.expert_parallel_size]
    if cfg.parallel.cpu_offload == "full" or not sizes:
        return None
    near = [e for e in sizes if e <= layout.nproc_per_node] or sizes
    key = "parallel.expert_parallel_size"
    return next((e for e in near + sizes if _fits(cfg, layout, dims, {key: e}, ranks)), near[-1])


def sequence_settings(cfg: RunConfig, dims: ModelDims, sp: int) -> dict[str, Any]:
    """sequence_parallel_size=sp, and where an SP group's micro-batch (sp x the per-rank token cap) would hold more
    than one worst-case sample, the cap lowered to one sample's slice: SP saves memory only on a sample longer than
    one rank's cap."""
    settings: dict[str, Any] = {"parallel.sequence_parallel_size": sp}
    unit = row_tokens(cfg, dims)
    if sp * cfg.train.token_cap_per_micro_batch >= 2 * unit:
        settings["train.token_cap_per_micro_batch"] = -(-unit // sp)
    return settings


def row_tokens(cfg: RunConfig, dims: ModelDims) -> int:
    """What a worst-case sample takes of the token cap: its length, and a vision-language sample's encoder work."""
    length = cfg.sample_tokens()
    return length + worst_vision_tokens(cfg, dims.layers, dims.active_layer_params, dims.vision)


def rows_that_fit(cfg: RunConfig, layout: Layout, dims: ModelDims, most: int,
                  ranks: tuple[int, ...] | None = None) -> int | None:
    """The most samples of max length (1..most) whose token cap per micro-batch fits the device's memory; None
    when not even one does."""
    key, unit = "train.token_cap_per_micro_batch", row_tokens(cfg, dims)
    return _largest(1, most, lambda r: _fits(cfg, layout, dims, {key: r * unit}, ranks))


def _fits(cfg: RunConfig, layout: Layout, dims: ModelDims, settings: dict, ranks=None, room: float = 1.0) -> bool:
    """Whether cfg with `settings` peaks under `room` of the device's memory."""
    if not layout.device_memory_gib:
        return False
    return estimate_memory(with_settings(cfg, settings), layout, dims, ranks).total_gib <= \
        room * layout.device_memory_gib


def _largest(lo: int, hi: int, ok) -> int | None:
    """Largest n in [lo, hi] with ok(n), for ok monotone (true up to some n); None when ok(lo) is false."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
