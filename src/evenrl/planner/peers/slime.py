"""slime (and Miles, its fork, which shares its flags): the checks slime and Megatron-LM run on its arguments, and
its flags as evenrl settings.

slime trains actor_num_nodes x actor_num_gpus_per_node GPUs with Megatron and samples with SGLang engines of
rollout_num_gpus_per_engine GPUs each, on the same GPUs (--colocate) or on rollout_num_gpus of their own. A step
samples rollout_batch_size prompts x n_samples_per_prompt and trains on them in optimizer steps of
global_batch_size samples (rollout_batch_size x n_samples_per_prompt // num_steps_per_rollout; Megatron's default:
micro_batch_size x its data-parallel size). The Megatron layout (TP, PP, CP, EP, recompute, offload):
peers.megatron.
"""

from __future__ import annotations

import argparse

from evenrl.planner.layout import has_shape_flags
from evenrl.planner.peers import megatron
from evenrl.planner.peers.reader import (
    Check, Source, Translation, set_critic, set_data, set_kl, set_lengths, set_model, set_parallel, set_steps,
    nodes_layout)


def translate(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    """slime's flags -> t: the checks slime (and Megatron) would fail on t.layout, and the evenrl settings."""
    if has_shape_flags(ns):
        nodes, per = ns.nnodes or 1, ns.nproc_per_node or 1
    else:
        nodes, per = src.int("actor_num_nodes", 1), src.int("actor_num_gpus_per_node", 8)
    world = nodes * per
    colocate = src.bool("colocate", False)
    engines = src.int("rollout_num_gpus", None, lo=0)
    if not colocate and engines is None:
        t.notes.append("no --colocate and no --rollout-num-gpus: slime has no GPUs to sample on; the plan colocates "
                       "(--rollout-devices N for GPUs of their own)")
    rollout = ns.rollout_devices if ns.rollout_devices is not None else (0 if colocate else engines or 0)
    t.layout = nodes_layout(ns, nodes, per, rollout)
    t.set("rollout.engine", "vllm", "rollout_num_gpus_per_engine")
    t.notes.append("slime samples with SGLang; evenrl has no SGLang engine: its vLLM engine samples instead, with "
                   "the same share of each device (sglang_mem_fraction_static) and devices per engine")
    m = _megatron(src)
    _checks(src, t, world, m)
    rbs, n = src.int("rollout_batch_size", None), src.int("n_samples_per_prompt", 1)
    if rbs is None:
        t.checks.append(Check("config", "SystemExit", "train.py: error: the following arguments are required: "
                              "--rollout-batch-size", "slime's argparse: --rollout-batch-size has no default"))
        rbs = 1
    dp = max(world // (m.tp * m.pp * m.cp), 1)
    micro = src.int("micro_batch_size", 1)
    steps = src.int("num_steps_per_rollout", None)
    gbs = rbs * n // steps if steps else src.int("global_batch_size", None) or micro * dp
    t.set("data.prompts_per_step", rbs, "rollout_batch_size")
    t.set("rollout.samples_per_prompt", n, "n_samples_per_prompt")
    t.set("algo.minibatches_per_step", max(1, rbs * n // gbs), "num_steps_per_rollout" if steps else
          "global_batch_size")
    if (rbs * n) % gbs:
        t.notes.append(f"rollout_batch_size {rbs} x n_samples_per_prompt {n} = {rbs * n} samples in optimizer steps "
                       f"of {gbs}: slime trains {rbs * n // gbs} steps a rollout; evenrl splits all {rbs * n} samples "
                       f"into {max(1, rbs * n // gbs)} mini-batches")
    prompt = src.int("rollout_max_prompt_len", None)
    context = src.int("rollout_max_context_len", None)
    new = src.int("rollout_max_response_len", 1024)
    if prompt is None:
        prompt = max(context - new, 1) if context and context > new else 1024
        t.notes.append(f"no --rollout-max-prompt-len: slime samples prompts of any length; the plan caps them at "
                       f"{prompt} tokens (data.max_prompt_tokens: set it to the dataset's longest)")
    set_lengths(t, prompt, new, "rollout_max_prompt_len", "rollout_max_response_len")
    if src.bool("use_dynamic_batch_size", False):
        t.set("train.token_cap_per_micro_batch", src.int("max_tokens_per_gpu", 16384), "max_tokens_per_gpu")
    else:
        t.set("train.token_cap_per_micro_batch", micro * (prompt + new), "micro_batch_size")
    eps = src.float("eps_clip", 0.2)
    t.set("algo.clip_low", eps, "eps_clip")
    t.set("algo.clip_high", src.float("eps_clip_high", eps), "eps_clip_high")
    if src.bool("use_kl_loss", False) and src.float("kl_loss_coef", 0.0) > 0:
        set_kl(t, src.float("kl_loss_coef", 0.0), "loss", "kl_loss_coef")
    elif src.float("kl_coef", 0.0) > 0:
        set_kl(t, src.float("kl_coef", 0.0), "reward", "kl_coef")
    if not src.bool("disable_grpo_std_normalization", False) and n == 1:
        t.notes.append("n_samples_per_prompt=1: slime turns GRPO's std normalisation off")
    if src.bool("disable_grpo_std_normalization", False) or n == 1:
        t.set("algo.std_scale", "none", "disable_grpo_std_normalization")
    t.set("algo.loss_aggregation", "token-mean" if src.bool("calculate_per_token_loss", False) else
          "seq-mean-token-mean", "calculate_per_token_loss")
    if src.str("advantage_estimator", "grpo") == "ppo":
        t.set("algo.gamma", src.float("gamma", 1.0), "gamma")
        t.set("algo.lam", src.float("lambd", 1.0), "lambd")
        set_critic(t, path="", policy_path="", lr=src.float("critic_lr", src.float("lr", 1e-6)),
                   value_clip=src.float("value_clip", 0.2), warmup=src.int("num_critic_only_steps", 0, lo=0),
                   keys=("", "critic_lr", "value_clip", "num_critic_only_steps"))
    t.set("train.betas", [src.float("adam_beta1", 0.9), src.float("adam_beta2", 0.999)], "adam_beta1 adam_beta2")
    _off_policy(src, t)
    set_model(t, src.str("hf_checkpoint"), "hf_checkpoint")
    set_parallel(t, world, params=False, optimizer=False, shard=True,  # its distributed optimizer shards too
                 keys=("use_distributed_optimizer", "use_distributed_optimizer"))
    megatron.apply(t, m, world, megatron.model_experts(src.str("hf_checkpoint")))
    set_data(t, src.str("prompt_data"), "prompt_data", src.str("input_key", "input"), src.str("label_key", "") or None,
             keys=("input_key", "label_key"))
    set_steps(src, t, "num_rollout", "num_epoch", 1, rbs)


def _megatron(src: Source) -> megatron.Megatron:
    keys = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
            "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
            "recompute": "recompute_granularity", "offload_optimizer": "optimizer_cpu_offload"}
    return megatron.Megatron(
        tp=src.int(keys["tp"], 1), pp=src.int(keys["pp"], 1), cp=src.int(keys["cp"], 1), ep=src.int(keys["ep"], 1),
        recompute=src.str(keys["recompute"], ""), recompute_method=src.str("recompute_method", ""),
        recompute_layers=src.int("recompute_num_layers", None),
        offload={"optimizer": src.bool(keys["offload_optimizer"], False)}, keys=keys)


def _checks(src: Source, t: Translation, world: int, m: megatron.Megatron) -> None:
    """slime_validate_args's and Megatron validate_args's checks on these flags, with their messages."""
    size = m.tp * m.pp * m.cp
    if world % size:
        t.checks.append(Check("config", "AssertionError", f"world size ({world}) is not divisible by "
                              f"total_model_size (total_model_size={size})",
                              f"TP {m.tp} x PP {m.pp} x CP {m.cp} = {size} does not divide {world} actor GPUs"))
    if src.float("rollout_temperature", 1.0) <= 0:
        t.checks.append(Check("config", "ValueError", "--rollout-temperature must be > 0; temperature 0 is greedy "
                              "decoding and is not a valid RL policy.", "rollout_temperature <= 0"))
    if src.float("kl_coef", 0.0) != 0 and src.float("kl_loss_coef", 0.0) != 0:
        t.checks.append(Check("config", "AssertionError", "Only one of kl_coef and kl_loss_coef can be set",
                              "a KL in the reward and one in the loss"))
    if src.str("advantage_estimator", "grpo").startswith("reinforce_plus_plus") and \
            not src.bool("normalize_advantages", False):
        t.checks.append(Check("config", "AssertionError", "The 'reinforce_plus_plus' and "
                              "'reinforce_plus_plus_baseline' advantage estimators require advantage normalization. "
                              "Please add `--normalize-advantages` to your command.", "no --normalize-advantages"))
    if src.bool("use_dynamic_batch_size", False) and not src.has("max_tokens_per_gpu"):
        t.checks.append(Check("config", "AssertionError", "max_tokens_per_gpu must be set when use_dynamic_batch_size "
                              "is set", "--use-dynamic-batch-size without --max-tokens-per-gpu"))
    steps, gbs = src.int("num_steps_per_rollout", None), src.int("global_batch_size", None)
    rbs, n = src.int("rollout_batch_size", 1), src.int("n_samples_per_prompt", 1)
    if steps and gbs is not None and gbs != rbs * n // steps:
        t.checks.append(Check("config", "AssertionError", f"global_batch_size {gbs} is not equal to "
                              f"rollout_batch_size {rbs} * n_samples_per_prompt {n} // num_steps_per_rollout {steps}",
                              f"{rbs} x {n} // {steps} = {rbs * n // steps}"))
    if not src.has("num_rollout") and not src.has("num_epoch"):
        t.checks.append(Check("config", "AssertionError", "num_epoch is not set, but num_rollout is not set, please "
                              "set --num-rollout or --num-epoch", "neither --num-rollout nor --num-epoch"))


def _off_policy(src: Source, t: Translation) -> None:
    """TIS (token weights pi_old / pi_rollout clamped to [tis_clip_low, tis_clip]: slime's vanilla_tis_function)
    and routing replay (R2: the trainer's routes replayed in the update; R3: the engine's)."""
    if src.bool("use_tis", False):
        t.set("algo.importance_correction", "all", "use_tis")
        t.set("algo.importance_cap", min(max(src.float("tis_clip", 2.0), 1.0), 1000.0), "tis_clip")
        low = src.float("tis_clip_low", 0.0)
        if 0 < low < 1:
            t.set("algo.importance_floor", low, "tis_clip_low")
        if src.has("custom_tis_function_path"):
            t.notes.append("custom_tis_function_path: a weight of your own; the plan applies slime's default "
                           "(token weights clamped to [tis_clip_low, tis_clip])")
    if src.bool("use_rollout_routing_replay", False):
        t.set("rollout.router_replay", "engine", "use_rollout_routing_replay")
    elif src.bool("use_routing_replay", False):
        t.set("rollout.router_replay", "trainer", "use_routing_replay")
