"""A Megatron engine's model-parallel and memory settings (verl's megatron strategy, slime's and Miles' flags) as the
layout evenrl would really run, each difference in a note naming the peer's key.

    tensor_model_parallel_size   parallel.tensor_parallel_size (a note on the row-wise split evenrl does not use).
                                 Mixture of experts: TP on the attention and dense layers, and
                                 parallel.expert_parallel_size on the routed experts (the file's EP, else its TP,
                                 which Megatron's experts are split by: ETP defaults to TP), FSDP2 sharding the rest;
                                 where neither divides the experts, TP 1 (evenrl's TP needs EP beside it on an MoE)
    expert_model_parallel_size   parallel.expert_parallel_size
    pipeline_model_parallel_size no pipeline in evenrl: FSDP2 shards every layer over all the ranks instead
    context_parallel_size        Ulysses sequence parallelism over as many ranks (parallel.sequence_parallel_size)
    recompute_granularity=full   activation checkpointing (model.gradient_checkpointing); selective: none
    param/grad/optimizer offload FSDP2's CPU offload (parallel.cpu_offload=full), which does not run with TP or EP

The planner then counts memory for that layout, not for the peer's. Never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from evenrl.models.files import routed_experts
from evenrl.planner.peers.reader import Translation, set_parallel


@dataclass
class Megatron:
    """The Megatron settings a peer's file gives, and the peer's key for each (keys[name]; absent: not set)."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    recompute: str = ""  # recompute_granularity: full | selective | "" (none, Megatron's default)
    recompute_method: str = ""  # uniform | block
    recompute_layers: int | None = None
    offload: dict[str, bool] = field(default_factory=dict)  # param / grad / optimizer -> on
    keys: dict[str, str] = field(default_factory=dict)


def model_experts(path: str) -> int | None:
    """The routed experts per MoE layer of a local model (0: dense), from its config.json; None: not here."""
    config = Path(path).expanduser() / "config.json" if path else None
    try:
        return routed_experts(json.loads(config.read_text(encoding="utf-8"))) if config and config.is_file() else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def apply(t: Translation, m: Megatron, world: int, experts: int | None) -> None:
    """t's evenrl layout for `m` on `world` training ranks; experts: the model's routed experts per MoE layer (0:
    dense; None: unknown here, a mixture of experts only where the file splits experts)."""
    k = m.keys
    moe = bool(experts) if experts is not None else m.ep > 1
    tp, ep = m.tp, m.ep
    if tp > 1 and moe:
        if ep == 1 and (experts is None or experts % tp == 0):
            ep = tp  # Megatron splits the experts over the TP ranks (expert_tensor_parallel_size defaults to TP)
        t.set("parallel.sharding", "fsdp", k["tp"])
        if ep > 1:
            t.set("parallel.tensor_parallel_size", tp, k["tp"])
            t.notes.append(f"{k['tp']}={tp} on a mixture of experts: evenrl splits the attention and dense layers "
                           f"over {tp} ranks (parallel.tensor_parallel_size={tp}) and the routed experts by expert "
                           f"parallelism (parallel.expert_parallel_size={ep}, each expert whole on its rank: expert "
                           "tensor parallelism 1; each rank of a TP group sends its 1/TP of the tokens to their "
                           "experts), FSDP2 sharding the rest (parallel.sharding=fsdp); docs/moe.md")
        else:
            t.notes.append(f"{k['tp']}={tp} on a mixture of experts whose {experts} experts it does not divide: "
                           "evenrl's tensor parallelism needs expert parallelism beside it on a mixture, so the plan "
                           f"runs parallel.tensor_parallel_size=1 with FSDP2 sharding the model over all {world} "
                           "ranks (parallel.sharding=fsdp)")
        tp = 1
    elif tp > 1:
        t.set("parallel.tensor_parallel_size", tp, k["tp"])
        t.notes.append(f"{k['tp']}={tp}: Megatron splits o_proj and down_proj by rows and all-reduces their partial "
                       "outputs; evenrl's parallel.tensor_parallel_size splits the same weights over as many "
                       "consecutive ranks but keeps those two column-wise on gathered inputs (the numerically stable "
                       "plan: about twice the bytes per block, outputs that do not move with the TP size; "
                       "docs/parallelism.md)")
    if ep > 1:
        t.set("parallel.expert_parallel_size", ep, k.get("ep") if m.ep > 1 else k["tp"])
        t.notes.append(f"{k.get('ep', 'expert_model_parallel_size')}={ep}: evenrl's parallel.expert_parallel_size "
                       "splits each MoE layer's experts the same way, over consecutive training ranks; the "
                       "ranks holding the same experts reduce them (or FSDP2 shards them: parallel.sharding=fsdp) "
                       "(docs/moe.md)")
    if m.etp and m.etp > 1:
        t.notes.append(f"{k['etp']}={m.etp}: Megatron splits each expert's weights over {m.etp} ranks; evenrl keeps "
                       "each expert whole on the rank that holds it (expert tensor parallelism 1)")
    if m.pp > 1:
        t.set("parallel.sharding", "fsdp", k["pp"])
        t.notes.append(f"{k['pp']}={m.pp}: evenrl has no pipeline parallelism (Megatron gives each of {m.pp} stages "
                       f"1/{m.pp} of the layers); FSDP2 shards every layer over all the ranks instead "
                       "(parallel.sharding=fsdp: each rank holds 1/world of the weights, gradients and AdamW state, "
                       "and gathers a layer while it runs it), so the data-parallel size is world / "
                       "(TP x SP), not world / (TP x PP x CP), and the memory the plan counts is that layout's")
    if m.cp > 1:
        t.set("parallel.sequence_parallel_size", m.cp, k["cp"])
        t.notes.append(f"{k['cp']}={m.cp}: Megatron's context parallelism splits each sample's tokens over {m.cp} "
                       "ranks and passes key/value blocks around them; evenrl's sequence parallelism splits them "
                       "over as many ranks with Ulysses (all-to-all over attention heads, which it must divide): "
                       f"parallel.sequence_parallel_size={m.cp}")
    _recompute(t, m)
    _offload(t, m, world, tp > 1 or ep > 1)


def _recompute(t: Translation, m: Megatron) -> None:
    k = m.keys
    if m.recompute == "full":
        t.set("model.gradient_checkpointing", True, k["recompute"])
        if m.recompute_method == "block" and m.recompute_layers:
            t.notes.append(f"{k['recompute']}=full with recompute_method=block: Megatron recomputes the first "
                           f"{m.recompute_layers} layers of each stage; evenrl checkpoints every decoder block (less "
                           "memory, more recompute)")
        return
    t.set("model.gradient_checkpointing", False, k.get("recompute", k["tp"]))
    if m.recompute == "selective":
        t.notes.append(f"{k['recompute']}=selective: Megatron recomputes parts of each layer (core attention, "
                       "...); evenrl checkpoints whole decoder blocks or none: none, as the activations the plan "
                       "counts are a layer's whole (model.gradient_checkpointing=true to save them)")


def _offload(t: Translation, m: Megatron, world: int, split: bool) -> None:
    on = [name for name, value in m.offload.items() if value]
    if not on:
        return
    keys = ", ".join(m.keys[f"offload_{name}"] for name in on)
    if split:
        t.notes.append(f"{keys}: evenrl's CPU offload (FSDP2's) does not run with tensor or expert parallelism; the "
                       "plan keeps the weights, gradients and AdamW state on the devices and counts them there")
        return
    first = m.keys[f"offload_{on[0]}"]
    set_parallel(t, world, params="param" in on or "grad" in on, optimizer="optimizer" in on, shard=True,
                 keys=(first, first))
    t.notes.append(f"{keys}: Megatron moves the offloaded state to the host between phases (freeing the device for "
                   "generation) and back for the update; evenrl's offload is FSDP2's: the sharded weights, gradients "
                   "and AdamW state live on the host, each layer comes to the device for its forward and backward, "
                   "and AdamW steps on the host (less device memory during the update too, a slower update)")
