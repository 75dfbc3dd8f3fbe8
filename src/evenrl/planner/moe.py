"""The rules of a mixture of experts (docs/moe.md): router replay and the load-balancing loss checked against the
model's config.json and the engine, before anything loads.

    evenrl plan CONFIG rollout.router_replay=engine algo.router_aux_loss_coef=0.001

What the runtime refuses (evenrl.train.moe.check, evenrl.engines.vllm_engine) is found here first, in the same
words where it can be: replay or a load-balancing loss on a dense model or on routers evenrl does not know; engine
replay with an engine that returns no routes (vLLM: its CPU build cannot, and evenrl asks no GPU build yet) or with
an agent's joined calls; the loss on an aux-loss-free router (sigmoid scores with correction biases); vLLM's CPU build
as an MoE policy's engine (its weight reload leaves the experts wrong). The memory an MoE holds and its expert
parallelism are planner.memory's.
Pure Python: never imports torch.
"""

from __future__ import annotations

from evenrl.planner.dims import AUX_FREE_TYPES, MOE_TYPES
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
    if replay == "engine" and c.rollout.engine == "vllm":
        out.append(Finding("error", "router-replay-engine", "rollout.router_replay=engine needs the engine's routes; "
                           "vLLM's CPU build returns none (only its GPU model runner records them: "
                           "enable_return_routed_experts) and evenrl asks no GPU build for them yet",
                           "rollout.engine=hf; or rollout.router_replay=trainer (R2)"))
    if replay == "engine" and c.rollout.agent:
        out.append(Finding("error", "router-replay-agent", "rollout.router_replay=engine with rollout.agent: an "
                           "agent's samples are joined from its calls, whose routes evenrl does not join yet",
                           "rollout.router_replay=trainer (R2); or off"))
    if aux > 0 and d.model_type in AUX_FREE_TYPES:
        out.append(Finding("error", "router-aux-free", f"algo.router_aux_loss_coef={aux:g}, but {d.model_type}'s "
                           "router is aux-loss-free (sigmoid scores balanced by the checkpoint's correction biases, "
                           "which training leaves as they are)", "algo.router_aux_loss_coef=0"))
    if c.rollout.engine == "vllm" and p.layout.device == "cpu":
        out.append(Finding("error", "moe-vllm-cpu", "rollout.engine=vllm on CPU for a mixture of experts: vLLM's CPU "
                           "build cannot take its weights after a push (its reload leaves the experts wrong, "
                           "log-probs 0.06 off even with the unchanged checkpoint; vllm-cpu 0.32)",
                           "rollout.engine=hf"))
    if replay == "off" and d.model_type in MOE_TYPES:
        out.append(Finding("note", "router-replay-off", f"a mixture of experts ({d.experts} experts, top "
                           f"{d.top_k}) with rollout.router_replay=off: the trainer routes each token itself, and "
                           f"an engine in other precision routes some elsewhere ({_WHY_REPLAY})",
                           "rollout.router_replay=engine (the hf engine records them); or trainer (R2)"))
    return out
