"""verl: its batch checks (ray_trainer._validate_config, fsdp_workers) and its config as evenrl settings.

verl counts ppo_mini_batch_size in prompts and normalises it per GPU by rollout.n and the sequence-parallel size;
each check below reproduces that arithmetic with the message verl prints.

A top-level rollout section (rollout.nnodes x rollout.n_gpus_per_node: the generation GPUs of the
one_step_off_policy and fully_async_policy recipes, apart from trainer.nnodes x trainer.n_gpus_per_node) ->
reserved rollout devices; their staleness and verl's rollout correction: peers.verl_offpolicy. Megatron's batch
checks divide by world / (TP x PP x CP); its layout in evenrl: peers.megatron.
"""

from __future__ import annotations

import argparse

from evenrl.planner.peers.reader import (
    Check, Source, Translation, check_dataloader, set_critic, set_data, set_dynamic_sampling, set_kl,
    set_lengths, set_lora, set_model, set_overlong, set_parallel, set_reward_models,
    set_steps, split_layout, trainer_layout)
from evenrl.planner.peers import megatron, verl_offpolicy as offpolicy
from evenrl.planner.peers.tables import forced_aggregation


def translate(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    """verl's config -> t: the checks verl would fail on t.layout, and the evenrl settings."""
    a = "actor_rollout_ref.actor."
    t.layout = trainer_layout(src, ns)
    world = t.layout.world  # the trainers: verl's batch checks count them alone
    if src.has("rollout.n_gpus_per_node"):  # the off-policy recipes' own generation GPUs
        gen = src.int("rollout.nnodes", 1) * src.int("rollout.n_gpus_per_node", 8)
        rollout = ns.rollout_devices if ns.rollout_devices is not None else gen
        t.layout = split_layout(ns, t.layout.nnodes, t.layout.nproc_per_node, rollout)
    tbs, n = src.int("data.train_batch_size", 1024), src.int("actor_rollout_ref.rollout.n", 1)
    mini = src.int(a + "ppo_mini_batch_size", 256)
    micro = src.int(a + "ppo_micro_batch_size_per_gpu", None)
    if micro is None and src.has(a + "ppo_micro_batch_size"):
        micro = max(1, src.int(a + "ppo_micro_batch_size", 1) // world)
    dyn = src.bool(a + "use_dynamic_bsz", False)
    sp = src.int(a + "ulysses_sequence_parallel_size", 1)
    plen, rlen = src.int("data.max_prompt_length", 512), src.int("data.max_response_length", 512)
    dp, minimal, how = _data_parallel(src, t, world, micro)
    if not dyn and not src.has(a + "ppo_micro_batch_size") and not src.has(a + "ppo_micro_batch_size_per_gpu"):
        t.checks.append(Check("config", "AssertionError",
                              "[actor] Please set at least one of 'actor.ppo_micro_batch_size' or "
                              "'actor.ppo_micro_batch_size_per_gpu' if use_dynamic_bsz is not enabled.",
                              "ppo_micro_batch_size_per_gpu has no default (null) in verl's ppo_trainer.yaml",
                              "recent verl"))
    if not dyn and src.has(a + "ppo_micro_batch_size") and src.has(a + "ppo_micro_batch_size_per_gpu"):
        t.checks.append(Check("config", "ValueError",
                              "[actor] You have set both 'actor.ppo_micro_batch_size' AND "
                              "'actor.ppo_micro_batch_size_per_gpu'. Please remove 'actor.ppo_micro_batch_size' "
                              "because only '*_ppo_micro_batch_size_per_gpu' is supported (the former is deprecated).",
                              "the global micro-batch size is the older spelling", "recent verl"))
    _log_prob_micro(src, t, dyn)
    if not dyn and (tbs * n) % minimal:
        t.checks.append(Check("config", "AssertionError",
                              f"real_train_batch_size ({tbs * n}) must be divisible by minimal possible batch size "
                              f"({minimal})", f"train_batch_size {tbs} x rollout.n {n} = {tbs * n} samples over "
                              f"{how} leaves {tbs * n % minimal}", "verl >= 0.3"))
    if not dyn and tbs < mini:
        t.checks.append(Check("config", "ValueError",
                              f"train_batch_size ({tbs}) must be >= actor.ppo_mini_batch_size ({mini})",
                              "ppo_mini_batch_size counts prompts (default 256)", "recent verl"))
    norm = mini * n // max(dp // sp, 1)
    if norm == 0:
        t.checks.append(Check("worker", "AssertionError",
                              f"ppo_mini_batch_size {norm} should be larger than 0 after normalization",
                              f"ppo_mini_batch_size {mini} x n {n} // ({dp} data-parallel GPUs // sp {sp}) = 0"))
    elif micro and not dyn and norm % micro:
        t.checks.append(Check("worker", "AssertionError",
                              f"normalized ppo_mini_batch_size {norm} should be divisible by "
                              f"ppo_micro_batch_size_per_gpu {micro}",
                              f"ppo_mini_batch_size {mini} x n {n} // {dp // sp} = {norm}; {norm} % {micro} = "
                              f"{norm % micro}"))
    if tbs % world:
        t.checks.append(Check("rollout", "AssertionError",
                              f"only support equal chunk. Got size of DataProto {tbs} and chunk {world}.",
                              f"the {tbs} prompts are split over {world} workers before rollout.n repeats them: "
                              f"{tbs} % {world} = {tbs % world}", "verl before the up-front check, e.g. Logic-RL"))
    check_dataloader(src, t, "data.train_files", tbs, "AssertionError", "Train dataloader is empty!")
    t.set("data.prompts_per_step", tbs, "data.train_batch_size")
    t.set("rollout.samples_per_prompt", n, "actor_rollout_ref.rollout.n")
    set_lengths(t, plen, rlen, "data.max_prompt_length", "data.max_response_length")
    t.set("algo.minibatches_per_step", max(1, tbs // mini), a + "ppo_mini_batch_size")
    cap = src.int(a + "ppo_max_token_len_per_gpu", 16384) if dyn else (micro or 1) * (plen + rlen)
    t.set("train.token_cap_per_micro_batch", cap, a + ("ppo_max_token_len_per_gpu" if dyn else
                                                      "ppo_micro_batch_size_per_gpu"))
    clip = src.float(a + "clip_ratio", 0.2)
    t.set("algo.clip_low", src.float(a + "clip_ratio_low", clip), a + "clip_ratio_low")
    t.set("algo.clip_high", src.float(a + "clip_ratio_high", clip), a + "clip_ratio_high")
    if src.bool(a + "use_kl_loss", False):
        set_kl(t, src.float(a + "kl_loss_coef", 0.001), "loss", a + "kl_loss_coef")
    elif src.bool("algorithm.use_kl_in_reward", False):
        set_kl(t, src.float("algorithm.kl_ctrl.kl_coef", 0.001), "reward", "algorithm.kl_ctrl.kl_coef")
    adv = src.str("algorithm.adv_estimator", "gae")
    if adv in ("gae", "reinforce_plus_plus"):
        t.set("algo.gamma", src.float("algorithm.gamma", 1.0), "algorithm.gamma")
    if adv == "gae":
        t.set("algo.lam", src.float("algorithm.lam", 1.0), "algorithm.lam")
        c = "critic."
        set_critic(t, path=src.str(c + "model.path", ""), policy_path=src.str("actor_rollout_ref.model.path", ""),
                   lr=src.float(c + "optim.lr", 1e-5), value_clip=src.float(c + "cliprange_value", 0.5),
                   warmup=src.int(c + "optim.lr_warmup_steps", -1, lo=-1),
                   keys=(c + "model.path", c + "optim.lr", c + "cliprange_value", c + "optim.lr_warmup_steps"))
    if src.bool("algorithm.filter_groups.enable", False):
        metric = src.str("algorithm.filter_groups.metric", "acc")
        set_dynamic_sampling(t, src.int("algorithm.filter_groups.max_num_gen_batches", 0, lo=0),
                             "algorithm.filter_groups.enable", "algorithm.filter_groups.max_num_gen_batches",
                             f"algorithm.filter_groups.metric={metric}: evenrl filters on the summed reward; verl "
                             "samples data.gen_batch_size prompts a round, evenrl the prompts still missing")
    ob = "reward_model.overlong_buffer."  # DAPO's recipe; current examples pass it to the reward manager
    ob = ob if src.has(ob + "enable") else "reward_model.reward_kwargs.overlong_buffer_cfg."
    if src.bool(ob + "enable", False):
        set_overlong(t, src.int(ob + "len", 0, lo=0), src.float(ob + "penalty_factor", 1.0),
                     (ob + "len", ob + "penalty_factor"))
    if not src.bool("algorithm.norm_adv_by_std_in_grpo", True):
        t.set("algo.std_scale", "none", "algorithm.norm_adv_by_std_in_grpo")
    set_model(t, src.str("actor_rollout_ref.model.path"), "actor_rollout_ref.model.path")
    _lora(src, t)
    if _is_megatron(src, t):
        set_parallel(t, world, params=False, optimizer=False, shard=True,  # its distributed optimizer shards too
                     keys=(a + "megatron.use_distributed_optimizer",) * 2)
        megatron.apply(t, _megatron(src), world, megatron.model_experts(src.str("actor_rollout_ref.model.path")))
    else:  # offload_policy: verl's FSDP2 path (strategy=fsdp2), the same CPUOffloadPolicy evenrl uses
        params = any([src.bool(a + "fsdp_config.param_offload", False),
                      src.bool(a + "fsdp_config.offload_policy", False),
                      src.bool(a + "fsdp_config.grad_offload", False)])  # older verl (Logic-RL) offloads gradients
        set_parallel(t, world, params=params, optimizer=src.bool(a + "fsdp_config.optimizer_offload", False),
                     shard=True, keys=(a + "fsdp_config.param_offload", a + "fsdp_config.optimizer_offload"))
    set_data(t, src.str("data.train_files"), "data.train_files", src.str("data.prompt_key", "prompt"),
             keys=("data.prompt_key", ""))
    set_steps(src, t, "trainer.total_training_steps", "trainer.total_epochs", 1, tbs)
    _rewards(src, t)
    if src.has("rollout.n_gpus_per_node"):
        offpolicy.staleness(src, t)
    offpolicy.importance(src, t)
    _aggregation(src, t, rlen, mini, n, micro, dyn, max(dp // sp, 1))
    if src.bool("actor_rollout_ref.rollout.multi_turn.enable", False):
        _multi_turn(src, t, rlen)


# Megatron's names of a decoder block's linear layers (verl 0.8's model.lora.target_modules) -> Hugging Face's
MEGATRON_LINEAR = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
                   "linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]}


def _lora(src: Source, t: Translation) -> None:
    """verl's LoRA as verl picks it (ray_trainer: model.lora.rank first, else the legacy lora_rank): the nested
    model.lora of 0.8+ is Megatron-Bridge's PEFT, with its own defaults (alpha 32, dropout 0, Megatron's layer
    names); lora_rank the FSDP one (alpha 16, all-linear)."""
    m = "actor_rollout_ref.model."
    if not src.int(m + "lora.rank", 0, lo=0):
        set_lora(src, t, rank=m + "lora_rank", alpha=m + "lora_alpha", targets=m + "target_modules")
        return
    n = m + "lora."
    set_lora(src, t, rank=n + "rank", alpha=n + "alpha", targets=n + "target_modules", dropout=n + "dropout",
             alpha_default=32.0)
    names = src.raw(n + "target_modules") or list(MEGATRON_LINEAR)
    names = [names] if isinstance(names, str) else names
    hf = [h for name in names for h in MEGATRON_LINEAR.get(name, [name])]
    every = set(names) >= set(MEGATRON_LINEAR)
    t.set("model.lora.target_modules", [] if every else hf, n + "target_modules")
    kind = src.str(n + "type", "lora")
    if kind != "lora":
        t.notes.append(f"{n}type={kind}: evenrl trains plain LoRA adapters (peft's lora), not {kind}")
    if {"linear_fc1", "linear_fc2"} & set(names):
        t.notes.append(f"{n}target_modules: on a mixture of experts Megatron's linear_fc1/linear_fc2 adapters "
                       "include every expert's; evenrl adapts the attention and dense MLP projections only, never "
                       "the experts (docs/lora.md)")


def _rewards(src: Source, t: Translation) -> None:
    """reward_model.enable + reward_model.model.path -> a reward model entry (verl then rewards with its score);
    custom_reward_function.path -> a note."""
    if src.bool("reward_model.enable", False):
        set_reward_models(t, [(src.str("reward_model.model.path", ""), 1.0)], "reward_model.model.path")
        if src.has("reward_model.micro_batch_size_per_gpu"):
            t.notes.append("reward_model.micro_batch_size_per_gpu: evenrl batches the reward model by tokens, at "
                           "most train.token_cap_per_micro_batch per forward")
    if src.has("custom_reward_function.path"):
        t.notes.append(f"custom_reward_function.path={src.str('custom_reward_function.path')!r}: give the function "
                       "as a reward 'package.module:function' taking (completion, sample_row) -> float")


def _multi_turn(src: Source, t: Translation, response: int) -> None:
    """verl's agent loop (rollout.multi_turn): its response length is the whole trajectory after the prompt, tool
    responses included, and a turn may use all that is left of it, as evenrl's max_trajectory_tokens and a per-turn
    cap of the same size."""
    m = "actor_rollout_ref.rollout.multi_turn."
    t.set("rollout.max_trajectory_tokens", response, "data.max_response_length")
    turns = src.int(m + "max_assistant_turns", None)
    if turns is not None:
        t.set("rollout.max_turns", min(turns, 1000), m + "max_assistant_turns")
    tools, talk = src.str(m + "tool_config_path"), src.str(m + "interaction_config_path")
    t.notes.append(f"multi_turn: verl's {'tools (' + tools + ')' if tools else ''}"
                   f"{' and ' if tools and talk else ''}{'interaction (' + talk + ')' if talk else ''} are its own "
                   "classes; evenrl runs them as an environment you write (docs/multiturn.md: a ToolEnv whose tools "
                   "are Python functions, an Env whose step gives the feedback), then rollout.env=package.module:Name; "
                   "its reward is the environment's score instead of custom_reward_function")
    if src.has(m + "max_user_turns"):
        t.notes.append(f"{m}max_user_turns: evenrl counts assistant turns (rollout.max_turns); an environment ends "
                       "a trajectory itself by returning done")
    fmt = src.str(m + "format", "hermes")
    if fmt != "hermes":
        t.notes.append(f"{m}format={fmt}: evenrl reads Hermes tool calls (<tool_call>{{json}}</tool_call>) only")
    for key, field in (("max_tool_response_length", "max_tool_output_chars"), ("max_parallel_calls",
                                                                              "max_calls_per_reply")):
        if src.has(m + key):
            t.notes.append(f"{m}{key}={src.raw(m + key)}: an evenrl ToolEnv's {field} (a class attribute)")


def _aggregation(src: Source, t: Translation, rlen: int, mini: int, n: int, micro: int | None, dyn: bool,
                 dp: int) -> None:
    """verl's seq-mean-token-sum-norm at 0.8.0.dev: agg_loss returns the sum over rows of token sums / C (C =
    loss_scale_factor, else the padded response width, max_response_length), no mean over rows. Its default actor
    (use_legacy_worker_impl auto) scales each micro-batch by 1 / the rank's micro-batches per mini-batch and FSDP
    averages over data-parallel ranks; its newer engine sums micro-batches and averages over ranks. Either way a
    mini-batch's loss is the sum / (C x k), k = the mini-batch's micro-batches over all ranks (or the ranks): evenrl's
    token-sum-norm with loss_norm_tokens = C x k, the same loss on any evenrl layout."""
    a = "actor_rollout_ref.actor."
    bypass = src.bool("algorithm.rollout_correction.bypass_mode", False)  # no loss mode then (apply_bypass_mode)
    if not bypass and forced_aggregation("verl", src.str(a + "policy_loss.loss_mode", "vanilla")) or \
            src.str(a + "loss_agg_mode", "token-mean") != "seq-mean-token-sum-norm":
        return  # (a forced mode first: loss_agg_mode is then unused, and not read)
    scale = src.int(a + "loss_scale_factor", None)
    width = scale or rlen
    legacy = src.str("trainer.use_legacy_worker_impl", "auto") != "disable"
    if legacy and not dyn and micro:
        per_rank = max(mini * n // dp, 1)
        steps = max(per_rank // micro, 1)
        k, how = steps * dp, (f"its default actor scales each micro-batch ({micro} rows) by 1/{steps} (a rank's "
                              f"{per_rank} rows per mini-batch) and averages over {dp} data-parallel ranks")
    elif legacy:
        k, how = dp, (f"with use_dynamic_bsz its default actor scales each micro-batch by its share of the rank's "
                      f"rows, which depends on how rows pack (no constant matches it; evenrl takes one micro-batch "
                      f"per rank), and averages over {dp} data-parallel ranks")
    else:
        k, how = dp, f"its newer engine sums micro-batches and averages over {dp} data-parallel ranks"
    t.set("algo.loss_norm_tokens", min(width * k, 10_000_000),
          a + "loss_agg_mode" + (f" {a}loss_scale_factor" if scale else ""))
    t.notes.append(f"{a}loss_agg_mode=seq-mean-token-sum-norm: verl's agg_loss divides the sum over rows of token "
                   f"sums by {width} ({'loss_scale_factor' if scale else 'max_response_length'}), with no mean over "
                   f"rows, and {how}: evenrl's token-sum-norm with loss_norm_tokens = {width} x {k}")


def _is_megatron(src: Source, t: Translation) -> bool:
    return src.str("actor_rollout_ref.actor.strategy", "fsdp") == "megatron" or "ppo_megatron_trainer" in t.base


def _megatron(src: Source) -> megatron.Megatron:
    """The actor's megatron section (the reference and critic follow it)."""
    m = "actor_rollout_ref.actor.megatron."
    o = m + "override_transformer_config."
    keys = {"tp": m + "tensor_model_parallel_size", "pp": m + "pipeline_model_parallel_size",
            "cp": m + "context_parallel_size", "ep": m + "expert_model_parallel_size",
            "etp": m + "expert_tensor_parallel_size", "recompute": o + "recompute_granularity",
            "offload_param": m + "param_offload", "offload_grad": m + "grad_offload",
            "offload_optimizer": m + "optimizer_offload"}
    etp = src.int(keys["etp"], None)
    if etp == 1:  # each expert whole: evenrl's own layout, which the key's reason in the table says
        src.reads.discard(keys["etp"])
    return megatron.Megatron(
        tp=src.int(keys["tp"], 1), pp=src.int(keys["pp"], 1), cp=src.int(keys["cp"], 1), ep=src.int(keys["ep"], 1),
        etp=etp, recompute=offpolicy.off_if_null(src.str(keys["recompute"], "")),
        recompute_method=offpolicy.off_if_null(src.str(o + "recompute_method", "")),
        recompute_layers=src.int(o + "recompute_num_layers", None),
        offload={name: src.bool(keys[f"offload_{name}"], False) for name in ("param", "grad", "optimizer")}
        | _host_optimizer(src, keys), keys=keys)


def _host_optimizer(src: Source, keys: dict) -> dict:
    """Megatron's optimizer on the host (optim.override_optimizer_config.optimizer_cpu_offload), as the
    optimizer's offload."""
    key = "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload"
    if not src.bool(key, False):
        return {}
    keys["offload_optimizer"] = key
    return {"optimizer": True}


def _data_parallel(src: Source, t: Translation, world: int, micro: int | None) -> tuple[int, int, str]:
    """(data-parallel size, verl's minimal batch, its words). Megatron (strategy=megatron, or the
    ppo_megatron_trainer base) splits the model over TP x PP x CP GPUs, so its batches divide over
    world / (TP x PP x CP), and the minimal batch is that times ppo_micro_batch_size_per_gpu. (evenrl's layout for
    it: peers.megatron.)"""
    if not _is_megatron(src, t):
        return world, world, f"{world} GPUs"
    m = "actor_rollout_ref.actor.megatron."
    tp, pp = src.int(m + "tensor_model_parallel_size", 1), src.int(m + "pipeline_model_parallel_size", 1)
    cp = src.int(m + "context_parallel_size", 1)
    if world % (tp * pp * cp):
        t.checks.append(Check("config", "AssertionError",
                              f"n_gpus ({world}) must be divisible by model_parallel_size ({tp * pp}) times "
                              f"context_parallel_size ({cp})", f"TP {tp} x PP {pp} x CP {cp} = {tp * pp * cp}",
                              "recent verl"))
    dp = max(world // (tp * pp * cp), 1)
    return dp, dp * (micro or 1), (f"{dp} data-parallel ranks (world {world} / TP {tp} x PP {pp} x CP {cp}) x "
                                   f"ppo_micro_batch_size_per_gpu {micro or 1}")


def _log_prob_micro(src: Source, t: Translation, dyn: bool) -> None:
    """verl's config check of the old-log-prob and reference passes' micro-batches (one of the two spellings)."""
    uses_ref = src.bool("actor_rollout_ref.actor.use_kl_loss", False) or \
        src.bool("algorithm.use_kl_in_reward", False)
    for name, needed in (("actor_rollout_ref.ref", uses_ref), ("actor_rollout_ref.rollout", True)):
        key = f"{name}.log_prob_micro_batch_size"
        if dyn or not needed:
            continue
        if not src.has(key) and not src.has(key + "_per_gpu"):
            t.checks.append(Check("config", "ValueError", f"[{name}] Please set at least one of '{key}' or "
                                  f"'{key}_per_gpu'.", "neither has a default in verl's ppo_trainer.yaml",
                                  "recent verl"))

