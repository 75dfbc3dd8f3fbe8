"""What one rank of a tensor-parallel group holds of a model (parallel.tensor_parallel_size = TP), as
evenrl.distributed.tensor_parallel splits it: the numbers the memory estimate counts with (planner.memory), from a
config.json's dimensions (planner.dims.ModelDims). At TP = 1 every number is the model's own.

    share = rank_share(dims, tp=4)   # share.params, share.block, share.act_elems, ...

Split over the group (1/TP each): q/k/v/o and gate/up/down (weights, and q/k/v biases), the token embeddings and
the output layer over the vocabulary (rows). Whole on every rank: the norms (two per block, Qwen3's q/k norms, the
final one) and the residual stream. The numerically stable plan computes o_proj and down_proj column-wise on their
all-gathered inputs, so those inputs are whole and saved for the backward:
  activations   4h + (2q + 2kv + 3i) / TP + q + i   per token per layer (TP > 1; planner.dims.ModelDims.act_elems
                at TP = 1: 4h + 2q + 2kv + 4i), q = heads x head_dim, kv = KV heads x head_dim, i = MLP width:
                the norms' and projections' inputs whole (4h); q, k, v, the attention output and gate, up, SiLU(gate)
                of this rank's heads and MLP slice; the gathered attention output (o_proj's input, q) and the
                gathered SwiGLU product (down_proj's input, i), whole. The rank's own slice of the product is only
                the all-gather's input, which keeps nothing for the backward.
  buffers       t x max(q, i) elements: the all-gather's staging copy of the widest gathered input (log-probs),
                twice in the update (the backward's partial gradient of that input before its reduce-scatter,
                and the staging copy)
A mixture of experts (beside expert parallelism: Megatron's layout with expert TP 1) splits its attention, its
dense layers' MLPs and its shared experts as above; the routed experts and the routers stay whole on every rank of
the group (expert parallelism divides the experts: planner.memory); each rank of a group routes every token (the
router's outputs whole) and sends 1/TP of them to their experts (distributed.expert_parallel):
  MoE layer     k (3h + 4e) / TP + 2E + 3s / TP + s   (e the expert width, s the shared experts', E experts) in place of
                the dense MLP's 3i / TP + i, averaged over the layers as planner.dims.ModelDims.act_elems does
The plan covers decoders with those projections (evenrl.distributed.tensor_parallel.supports): a vision-language
model, latent attention (MLA), attention sinks (gpt-oss) or q/k norms over the whole projection (OLMoE) are refused
(planner.tensor_parallel), and estimated as TP = 1.
Pure Python: never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from evenrl.distributed.mesh_shape import MeshShape
from evenrl.planner.dims import ModelDims
from evenrl.planner.layout import Layout

ENGINE_EXTRA_GIB = 1.0  # vLLM's own activations (its profiling forward) and CUDA graphs: a floor, not a measure


@dataclass(frozen=True)
class RankShare:
    """One rank's part of the model under tensor parallelism `tp` (module docstring); parameters in counts."""
    tp: int
    params: int  # every parameter this rank holds (the vision encoder aside)
    linear: int  # of them, the weights a matmul reads (what autocast copies)
    root: int  # FSDP's root unit: embeddings, untied output layer, final norm
    block: int  # the largest decoder block: an FSDP unit
    act_elems: int  # saved activation elements per token per layer
    kv_dim: int  # KV heads x head_dim held here (the KV cache's and Ulysses' width)
    kv_heads: int
    heads: int  # query heads held here
    vocab: int  # rows of the output layer held here (the log-prob chunk's width)
    gather_elems: int  # per token, the widest all-gathered input (0 at TP = 1)


def splittable(dims: ModelDims) -> str:
    """Why the plan cannot split this model ('' when it can): what evenrl.distributed.tensor_parallel covers."""
    if dims.vision is not None:
        return f"a vision-language model ({dims.model_type}): its vision tower is not split"
    if dims.mla:
        return f"latent attention (MLA, {dims.model_type}): no q/k/v projections to split"
    if dims.model_type in UNSPLIT_ATTENTION:
        return f"{UNSPLIT_ATTENTION[dims.model_type]} ({dims.model_type}), which the plan does not split"
    return ""


# Attention with weights the plan does not split, by model_type (evenrl.distributed.tensor_parallel.check says the
# same of the loaded model)
UNSPLIT_ATTENTION = {"gpt_oss": "attention sinks, one per head", "olmoe": "q/k norms over the whole projection",
                     "olmo2": "q/k norms over the whole projection"}


def split_sizes(dims: ModelDims) -> dict[str, int]:
    """The model's sizes TP must divide (each rank holds 1/TP of them), by name: a mixture's dense MLP width only
    where it has dense layers, its shared experts' where it has them."""
    sizes = {"attention heads": dims.heads, "KV heads": dims.kv_heads, "intermediate size": dims.intermediate,
             "vocabulary": dims.vocab}
    if dims.experts and dims.moe_layers == dims.layers:
        del sizes["intermediate size"]
    if dims.shared_intermediate:
        sizes["shared experts' width"] = dims.shared_intermediate
    return sizes


def routed_params(dims: ModelDims) -> tuple[int, int]:
    """(one MoE block's, the whole model's) routed experts and routers: what tensor parallelism leaves whole."""
    block = dims.experts * (dims.expert_params + dims.hidden + (1 if dims.expert_bias else 0)) if dims.experts else 0
    return block, dims.moe_layers * block


def norm_params(dims: ModelDims) -> tuple[int, int]:
    """(the norms' parameters in one block, in the whole model): what stays whole on every rank."""
    block = 2 * dims.hidden + (2 * dims.head_dim if dims.qk_norm else 0)
    return block, dims.layers * block + dims.hidden


def rank_share(dims: ModelDims, tp: int) -> RankShare:
    """What one rank of a tensor-parallel group of `tp` holds (module docstring); the whole model where tp is 1 or
    the model cannot be split (splittable)."""
    if tp > 1 and splittable(dims):
        tp = 1
    block_norms, norms = norm_params(dims)
    q, kv, i, h = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.intermediate, dims.hidden
    if tp == 1:
        return RankShare(1, dims.params, dims.linear_params, dims.root_params, dims.layer_params, dims.act_elems, kv,
                         dims.kv_heads, dims.heads, dims.vocab, 0)
    routed_block, routed = routed_params(dims)  # whole on every rank (0 for a dense model)
    mlp, dense, s = 3 * i // tp + i, dims.layers - dims.moe_layers, dims.shared_intermediate
    if dims.moe_layers:
        moe = dims.top_k * (3 * h + 4 * dims.expert_intermediate) // tp + 2 * dims.experts + 3 * s // tp + s
        mlp = -(-(dims.moe_layers * moe + dense * mlp) // dims.layers)
    return RankShare(
        tp=tp,
        params=norms + routed + (dims.params - norms - routed) // tp,
        linear=routed + (dims.linear_params - routed) // tp,
        root=h + (dims.root_params - h) // tp,
        block=block_norms + routed_block + (dims.layer_params - block_norms - routed_block) // tp,
        act_elems=4 * h + (2 * q + 2 * kv) // tp + q + mlp,
        kv_dim=kv // tp, kv_heads=dims.kv_heads // tp, heads=dims.heads // tp, vocab=dims.vocab // tp,
        gather_elems=max(q, i if dense else 0, s))


def tensor_sizes(dims: ModelDims, ranks: int, per_node: int, nodes: int = 1) -> list[int]:
    """The parallel.tensor_parallel_size values a model and layout allow: divisors of `ranks` (the training ranks
    over sequence parallelism) that divide every split size, each group inside one node (`per_node` processes of
    `nodes`: a group's per-layer collectives on the node's own links, so a size that divides per_node where the
    ranks span nodes); [1] for a model the plan cannot split."""
    if splittable(dims):
        return [1]
    sizes = split_sizes(dims).values()
    return [s for s in range(1, min(ranks, per_node) + 1) if ranks % s == 0 and all(n % s == 0 for n in sizes)
            and (nodes == 1 or per_node % s == 0)]


def engine_bytes(dims: ModelDims, c: int, engine_tp: int, sample_tokens: int) -> tuple[float, float]:
    """(weights, one sample's KV cache) in bytes on each device of a vLLM engine over `engine_tp` devices, in the
    compute dtype's `c` bytes: the whole model (a vision encoder too) split engine_tp ways, and `sample_tokens` of
    KV over the KV heads a device holds (vLLM replicates them where engine_tp does not divide them). What vLLM needs
    at the least before its share of the device holds any batch (its own activations and graphs come on top)."""
    weights = c * (dims.params + (dims.vision.params if dims.vision else 0)) / engine_tp
    kv_heads = max(dims.kv_heads // engine_tp, 1)
    return weights, float(sample_tokens * dims.layers * 2 * kv_heads * dims.head_dim * c)


def engine_need(dims: ModelDims, c: int, engine_tp: int, sample_tokens: int) -> float:
    """Bytes a vLLM engine needs of each of its devices at the least: engine_bytes, and ENGINE_EXTRA_GIB."""
    return sum(engine_bytes(dims, c, engine_tp, sample_tokens)) + ENGINE_EXTRA_GIB * 1024**3


def share_needed(need: float, memory_gib: float) -> float:
    """The smallest rollout.memory_fraction, in hundredths, whose share of `memory_gib` holds `need` bytes (at most
    1.0)."""
    return min(1.0, math.ceil(100 * need / (memory_gib * 1024**3)) / 100) if memory_gib else 1.0


def engine_devices(lay: Layout) -> tuple[int, float]:
    """(devices the vLLM engines run on, the least memory among them in GiB): the reserved rollout devices, else
    every device (colocated)."""
    groups = lay.rollout_groups() if lay.rollout_devices else lay.training_groups()
    memory = min((g.device.memory_gib for g in groups), default=lay.device_memory_gib)
    return (lay.rollout_devices or lay.world), memory


def engine_splits(lay: Layout, d: ModelDims | None) -> list[int]:
    """rollout.tensor_parallel_size values vLLM and the layout allow: divisors of the engines' devices whose engine
    groups (MeshShape.groups("engine")) each sit on one node, dividing the query heads and the MLP width (vLLM gives
    each worker an equal slice) where the model is known."""
    devices = engine_devices(lay)[0]
    return [s for s in range(1, devices + 1) if devices % s == 0 and not engine_spans_nodes(lay, s)
            and (d is None or d.heads % s == 0 and d.intermediate % s == 0)]


def engine_spans_nodes(lay: Layout, size: int) -> bool:
    """Whether some engine of `size` devices (consecutive trainers, or consecutive reserved rollout ranks) would
    take devices of two nodes; `size` divides the engines' devices."""
    return any(g[0] // lay.nproc_per_node != g[-1] // lay.nproc_per_node
               for g in MeshShape(lay.world, lay.rollout_devices, engine_tp=size).groups("engine"))
