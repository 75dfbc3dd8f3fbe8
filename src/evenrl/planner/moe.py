"""The rules of a mixture of experts (docs/moe.md): router replay and the load-balancing loss checked against the
model's config.json and the engine, before anything loads.

    evenrl plan CONFIG rollout.router_replay=engine algo.router_aux_loss_coef=0.001

What the runtime refuses once the model has loaded (evenrl.train.moe.check) is found here first, in the same words
where it can be: replay or a load-balancing loss on a dense model or on routers evenrl does not know; the loss on an
aux-loss-free router (sigmoid scores with correction biases). Engine replay beside vLLM's CPU build or an agent is
config.compatibility's rows; beside a GPU vLLM it is a note (never run). The memory an MoE holds is planner.memory's.

Expert parallelism (parallel.expert_parallel_size, `rule_expert_parallel`): the mesh's own check
(evenrl.distributed.mesh_shape: EP divides the training ranks and the experts), a dense model, ep groups that
cross nodes (every MoE layer's all-to-all then on the inter-node link), and what a rank holds and sends (beside CPU
offload or a vision-language model it is config.compatibility's to refuse; beside tensor parallelism it runs). memory_fixes
offers the smallest size that fits where the experts do not (`--fit` proposes it).
Pure Python: never imports torch.
"""

from __future__ import annotations

from evenrl.planner.dims import AUX_FREE_TYPES, MOE_TYPES
from evenrl.planner.memory_fixes import expert_parallel_sizes
from evenrl.planner.text import count_unit, plural, size_text
from evenrl.planner.types import Finding, Plan

# measured: a bf16 engine against an fp32 trainer (tests/test_moe.py), R3's Qwen3-30B-A3B numbers (docs/moe.md)
_WHY_REPLAY = ("a bf16 engine routed 0.3-1.7 % of a tiny Qwen3-MoE's tokens to other experts than the fp32 trainer "
               "per layer; on Qwen3-30B-A3B 94 % of tokens differ in some layer (R3, arXiv 2510.11370)")


def rule_moe(p: Plan) -> list[Finding]:
    c, d = p.config, p.dims
    replay, aux = c.rollout.router_replay, c.algo.router_aux_loss_coef
    out = []
    if d is None:
        return out
    if not d.experts:
        if replay != "off":
            out.append(Finding("error", "router-replay-dense", f"rollout.router_replay={replay}, but "
                               f"{d.model_type} is not a mixture of experts (no routers to replay)",
                               "rollout.router_replay=off"))
        if aux > 0:
            out.append(Finding("error", "router-aux-dense", f"algo.router_aux_loss_coef={aux:g}, but "
                               f"{d.model_type} is not a mixture of experts", "algo.router_aux_loss_coef=0"))
        return out
    if (replay != "off" or aux > 0) and d.model_type not in MOE_TYPES:
        out.append(Finding("error", "router-unknown", f"{d.model_type} routes through a router evenrl does not "
                           f"record or replay (it knows {', '.join(MOE_TYPES)})",
                           "rollout.router_replay=off algo.router_aux_loss_coef=0"))
    if aux > 0 and d.model_type in AUX_FREE_TYPES:
        out.append(Finding("error", "router-aux-free", f"algo.router_aux_loss_coef={aux:g}, but {d.model_type}'s "
                           "router is aux-loss-free (sigmoid scores balanced by the checkpoint's correction biases, "
                           "which training leaves as they are)", "algo.router_aux_loss_coef=0"))
    if replay == "engine" and c.rollout.engine == "vllm" and p.layout.device != "cpu":
        out.append(Finding("note", "router-replay-vllm", "rollout.router_replay=engine with rollout.engine=vllm: "
                           "vLLM's GPU builds return each sample's routes (enable_return_routed_experts), which "
                           "evenrl reads as vLLM 0.32's code gives them, but no GPU run has shown it yet",
                           "rollout.engine=hf (the routes tested on CPU); or rollout.router_replay=trainer (R2)"))
    if replay == "off" and d.model_type in MOE_TYPES:
        out.append(Finding("note", "router-replay-off", f"a mixture of experts ({d.experts} experts, top "
                           f"{d.top_k}) with rollout.router_replay=off: the trainer routes each token itself, and "
                           f"an engine in other precision routes some elsewhere ({_WHY_REPLAY})",
                           "rollout.router_replay=engine (the hf engine records them); or trainer (R2)"))
    return out


KEY_TP = "parallel.tensor_parallel_size"


def rule_expert_parallel(p: Plan) -> list[Finding]:
    c, lay, d = p.config, p.layout, p.dims
    ep, key = c.parallel.expert_parallel_size, "parallel.expert_parallel_size"
    if ep == 1 or lay.training_ranks < 1:
        return []
    shape = p.mesh
    allowed = expert_parallel_sizes(c, lay, d) if d else []
    fix = "; ".join(f"{key}={e}" for e in sorted(allowed, key=lambda e: (abs(e - ep), e))[:2]) or f"{key}=1"
    wrong = [w for w in shape.problems() if w.startswith(key)]
    if d and not wrong and (why := shape.experts_problem(d.experts)):
        wrong = [why]
    out = [Finding("error", "expert-parallel", w, fix) for w in wrong]  # the runtime's own line
    refused = d is None or d.vision is not None or c.parallel.cpu_offload == "full"
    if out or refused:  # config.compatibility's expert-parallel-vision, -offload
        return out
    if lay.nnodes > 1 and ep > lay.nproc_per_node:
        out.append(Finding("warning", "expert-parallel-nodes",
                           f"{key}={ep} spans {-(-ep // lay.nproc_per_node)} nodes of {lay.nproc_per_node} "
                           "processes: every MoE layer's all-to-alls (forward and backward) cross the inter-node "
                           "link", "; ".join(f"{key}={e}" for e in allowed if 1 < e <= lay.nproc_per_node)
                           or f"{key}=1"))
    same, M, c_b = shape.trainers // ep, d.moe_layers, 2 if c.model.dtype != "float32" else 4
    sent = (p.memory.micro_tokens if p.memory else 0) * d.top_k * d.hidden * c_b * M / 2 ** 30
    T = shape.trainers
    gather = c_b * d.experts_total * ((T - 1) / T - (same - 1) / same / ep) / 2 ** 30  # FSDP2's, without EP - with
    out.append(Finding("note", "expert-parallel",
                       f"{key}={ep}: each rank holds {d.experts // ep} of the {d.experts} experts of each of "
                       f"{plural(M, 'MoE layer')} ({count_unit(d.experts_total // ep)} of "
                       f"{count_unit(d.experts_total)} expert parameters), "
                       + ("the only rank holding them" if same == 1 else
                          f"{'sharded by FSDP2' if c.parallel.sharding == 'fsdp' else 'reduced'} over the "
                          f"{same} ranks holding the same ones")
                       + (f"; beside {KEY_TP}={c.parallel.tensor_parallel_size}, the ranks of a tp group route "
                          "the same tokens and each sends its 1/tp of them"
                          if c.parallel.tensor_parallel_size > 1 else "")
                       + f"; a forward of the largest micro-batch sends its tokens' {d.top_k} expert inputs to "
                       f"their ranks and gets the outputs back by all-to-all, {size_text(sent)} each way over the "
                       f"{M} MoE layers (as much again in its backward"
                       + (", twice with checkpointing's recompute)" if c.model.gradient_checkpointing else ")")
                       + (f", where FSDP2 alone would gather {size_text(gather)} more of the experts"
                          if c.parallel.sharding == "fsdp" else "")
                       + ("; the hf sampler gathers every expert while it generates"
                          if c.rollout.engine == "hf" and not lay.rollout_devices else ""), ""))
    return out
