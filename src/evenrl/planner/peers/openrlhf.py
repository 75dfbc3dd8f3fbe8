"""OpenRLHF: train_ppo_ray's batch checks (and DeepSpeed's, at init) and its flags as evenrl settings.

OpenRLHF sizes actors (actor_num_nodes x actor_num_gpus_per_node) and vLLM engines separately; unless
colocate_all_models (without async_train), the engines' GPUs are extra devices that generate and do not train.
Off-policy keys, classic names and the dotted ones of newer versions (--train.async_enable is async_train, see
peers.reader): async_train + async_queue_size -> rollout.max_staleness; enable_vllm_is_correction +
vllm_is_truncated_threshold (one number, or [low, high] in newer versions) -> algo.importance_correction=all and
algo.importance_cap; each with a note where OpenRLHF's meaning differs.
"""

from __future__ import annotations

import argparse

from evenrl.errors import UsageError
from evenrl.planner.layout import has_shape_flags
from evenrl.planner.plan import count_rows
from evenrl.planner.peers.reader import (
    Check, Source, Translation, set_critic, set_data, set_dynamic_sampling, set_kl, set_lengths,
    set_lora, set_model, set_overlong, set_parallel, set_reward_models, split_layout)
from evenrl.planner.peers.tables import peer_default


def translate(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    """OpenRLHF's flags -> t: the checks OpenRLHF would fail on t.layout, and the evenrl settings."""
    if has_shape_flags(ns):
        nodes, per = ns.nnodes or 1, ns.nproc_per_node or 1
    else:
        nodes, per = src.int("actor_num_nodes", 1), src.int("actor_num_gpus_per_node", 8)
    engines, tp = src.int("vllm_num_engines", 0, lo=0), src.int("vllm_tensor_parallel_size", 1)
    async_train = src.bool("async_train", False)
    shared = src.bool("colocate_all_models", False) and not async_train  # async engines get their own GPUs
    rollout = ns.rollout_devices if ns.rollout_devices is not None else (0 if shared else engines * tp)
    t.layout = split_layout(ns, nodes, per, rollout)
    if engines:  # OpenRLHF samples with vLLM engines when it has any (else with the training model)
        t.set("rollout.engine", "vllm", "vllm_num_engines")
    aw = nodes * per
    rbs, n = src.int("rollout_batch_size", 1024), src.int("n_samples_per_prompt", 1)
    tbs = src.int("train_batch_size", 128)
    micro = src.int("micro_train_batch_size", peer_default("openrlhf", t.version, "micro_train_batch_size", 1))
    mroll = src.int("micro_rollout_batch_size", peer_default("openrlhf", t.version, "micro_rollout_batch_size", 1))
    ring, dstp = src.int("ring_attn_size", 1), src.int("ds_tensor_parallel_size", 1)
    glen = src.int("max_new_tokens", None) or src.int("generate_max_len", 1024)  # 0.10+: max_new_tokens, max_len
    total = src.int("max_len", None)
    plen = src.int("prompt_max_len", None) or (total - glen if total and total > glen else 1024)
    if total and not src.has("max_new_tokens") and not src.has("generate_max_len"):
        t.notes.append(f"max_len={total} without max_new_tokens: OpenRLHF generates up to max_len minus each prompt's "
                       f"length; evenrl caps the two apart: {plen} prompt + {glen} new tokens")
    if rbs % aw:
        t.checks.append(Check("config", "AssertionError",
                              f"rollout_bach_size must be divisible by actor_world_size, got {rbs} and {aw}",
                              f"rollout_batch_size {rbs} % {aw} actor GPUs = {rbs % aw}", "OpenRLHF 0.6-0.7"))
    if engines and aw % engines and engines % aw:
        t.checks.append(Check("config", "AssertionError",
                              f"actor_world_size must be divisible by vllm_num_engines, got {aw} and {engines}",
                              f"{aw} actor GPUs, {engines} vLLM engines", "OpenRLHF 0.6-0.7"))
    adv = src.str("advantage_estimator", "gae")
    if adv in ("rloo", "reinforce_baseline", "group_norm", "dr_grpo") and n == 1:
        t.checks.append(Check("config", "AssertionError", f"{adv} requires n_samples_per_prompt > 1",
                              "a group baseline needs two samples of each prompt", "OpenRLHF >= 0.10"))
    dp = max(aw // ring // dstp, 1)
    if n * rbs // mroll < dp:
        t.checks.append(Check("config", "AssertionError",
                              "The number of sample batches must be greater than or equal to the effective number of "
                              "actor processes.", f"n_samples_per_prompt {n} x rollout_batch_size {rbs} // "
                              f"micro_rollout_batch_size {mroll} = {n * rbs // mroll} < {dp} actor processes",
                              "OpenRLHF >= 0.8"))
    if engines and shared and aw != engines * tp:
        t.checks.append(Check("worker", "AssertionError",
                              "actor_num_nodes * actor_num_gpus_per_node must be equal to vllm_num_engines * "
                              f"vllm_tensor_parallel_size, got {aw} and {engines * tp}",
                              f"colocated: {aw} actor GPUs, {engines} engines x TP {tp} = {engines * tp} GPUs",
                              "OpenRLHF >= 0.8"))
    acc = tbs // (micro * dp)
    if acc == 0:
        t.checks.append(Check("deepspeed", "AssertionError", "Gradient accumulation steps: 0 has to be greater than 0",
                              f"train_batch_size {tbs} // (micro_train_batch_size {micro} x {dp} GPUs) = 0"))
    elif tbs != micro * acc * dp:
        t.checks.append(Check("deepspeed", "AssertionError",
                              "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                              f"gradient_acc_step * world_size {tbs} != {micro} * {acc} * {dp}",
                              f"train_batch_size {tbs} is not a multiple of {micro} x {dp} GPUs = {micro * dp}"))
    t.set("data.prompts_per_step", rbs, "rollout_batch_size")
    t.set("rollout.samples_per_prompt", n, "n_samples_per_prompt")
    set_lengths(t, plen, glen, "max_len" if total and not src.has("prompt_max_len") else "prompt_max_len",
                "max_new_tokens" if src.has("max_new_tokens") else "generate_max_len")
    t.set("algo.minibatches_per_step", max(1, rbs * n // tbs), "train_batch_size")
    if src.bool("use_dynamic_batch", False):  # micro-batches cut by tokens, as evenrl's are
        t.set("train.token_cap_per_micro_batch", src.int("train_max_tokens_per_gpu", 16192), "train_max_tokens_per_gpu")
    else:
        t.set("train.token_cap_per_micro_batch", micro * (plen + glen), "micro_train_batch_size")
    eps = src.float("eps_clip", 0.2)
    low_high = src.raw("eps_clip_low_high")
    low, high = (low_high if isinstance(low_high, list) and len(low_high) == 2 else (eps, eps))
    t.set("algo.clip_low", float(low), "eps_clip")
    t.set("algo.clip_high", float(high), "eps_clip")
    kl = src.float("init_kl_coef", 0.01)
    if kl > 0:
        set_kl(t, kl, "loss" if src.bool("use_kl_loss", False) else "reward", "init_kl_coef")
    if adv in ("gae", "reinforce"):
        t.set("algo.gamma", src.float("gamma", 1.0), "gamma")
    if adv == "gae":
        t.set("algo.lam", src.float("lambd", 1.0), "lambd")
        set_critic(t, path=src.str("critic_pretrain", ""), policy_path=src.str("pretrain", ""),
                   lr=src.float("critic_learning_rate", 9e-6), value_clip=src.float("value_clip", 0.5), warmup=0,
                   keys=("critic_pretrain", "critic_learning_rate", "value_clip", "lr_warmup_ratio"))
    if src.bool("dynamic_filtering", False):
        low_high = src.raw("dynamic_filtering_reward_range", [0.0, 1.0])
        set_dynamic_sampling(t, None, "dynamic_filtering", "dynamic_filtering",
                             f"dynamic_filtering keeps groups whose mean reward lies in {low_high} "
                             "(dynamic_filtering_reward_range); "
                             "evenrl keeps groups whose rewards are not all equal (the same for 0/1 rewards)")
    if src.int("overlong_buffer_len", 0, lo=0):
        set_overlong(t, src.int("overlong_buffer_len", 0, lo=0), src.float("overlong_penalty_factor", 1.0),
                     ("overlong_buffer_len", "overlong_penalty_factor"))
    _rewards(src, t)
    set_model(t, src.str("pretrain"), "pretrain")
    set_lora(src, t, rank="lora_rank", alpha="lora_alpha", targets="target_modules", dropout="lora_dropout")
    t.settings.pop("model.dtype", None)  # the tables': --bf16 (flat flags) or --ds.param_dtype (dotted)
    zero = src.int("zero_stage", 2, lo=0)
    set_parallel(t, aw, params=False, optimizer=src.bool("adam_offload", False), shard=zero == 3,
                 keys=("adam_offload", "adam_offload"))
    set_data(t, src.str("prompt_data"), "prompt_data", src.str("input_key", "input"), src.str("label_key", "answer"),
             keys=("input_key", "label_key"), split=("prompt_split", src.str("prompt_split")))
    rows = count_rows(t.settings.get("data.path", ""))
    if rows:
        t.set("train.steps", max(1, rows // rbs) * src.int("num_episodes", 1), "num_episodes")
    elif src.has("num_episodes"):
        t.notes.append(f"num_episodes={src.int('num_episodes', 1)}: the dataset is not here, so its steps are unknown; "
                       "the plan takes evenrl's train.steps=100 (set train.steps=N for the run's length)")
    if async_train:
        _async(src, t)
    if src.bool("enable_vllm_is_correction", False):
        _importance(src, t)


def _rewards(src: Source, t: Translation) -> None:
    """reward_pretrain (one path, or several separated by commas) -> reward models; remote_rm_url -> a note."""
    paths = [p.strip() for p in src.str("reward_pretrain", "").split(",") if p.strip()]
    set_reward_models(t, [(p, 1.0) for p in paths], "reward_pretrain")
    if src.has("remote_rm_url"):
        t.notes.append(f"remote_rm_url={src.str('remote_rm_url')!r}: a reward served over HTTP (or a Python file's "
                       "reward_func) has no evenrl equivalent; write it as a 'package.module:function' reward, or "
                       "give the reward model's directory as rewards.functions=[{model: /local/dir}]")
    if paths and src.bool("normalize_reward", False):
        t.notes.append("normalize_reward: OpenRLHF whitens reward-model scores with statistics from its training; "
                       "evenrl uses the raw score (the group advantage centres it)")


def _async(src: Source, t: Translation) -> None:
    """async_train (--train.async_enable): the generator runs up to async_queue_size batches ahead of the trainer."""
    queue = src.int("async_queue_size", 1)
    t.set("rollout.max_staleness", min(queue, 16), "async_queue_size")
    t.notes.append(f"async_train with async_queue_size={queue}: OpenRLHF's generator runs up to {queue} "
                   f"batch{'es' if queue > 1 else ''} ahead and takes whichever weights are current when a batch "
                   "starts, so a batch can be fresher; evenrl fixes every step's policy (step t samples from the "
                   f"policy after step t-1-k): rollout.max_staleness={min(queue, 16)}")
    if src.bool("partial_rollout", False):
        t.notes.append("partial_rollout: an OpenRLHF response can span two weight versions; an evenrl response "
                       "never does (each step samples from one policy)")


def _importance(src: Source, t: Translation) -> None:
    """enable_vllm_is_correction: importance weights of the trainer's over vLLM's log-probs, on every sample,
    bounded by vllm_is_truncated_threshold (one number: the cap; [low, high] in newer versions); the correction
    type (tis: truncate, icepop: mask) is the tables'."""
    raw = src.raw("vllm_is_truncated_threshold", [0.5, 5.0])
    low, high = (raw if isinstance(raw, list) and len(raw) == 2 else (None, raw))
    try:
        cap, floor = float(high), float(low) if low is not None else 0.0
    except (TypeError, ValueError):
        raise UsageError(f"OpenRLHF vllm_is_truncated_threshold: got {raw!r}; need a number or two") from None
    t.set("algo.importance_correction", "all", "enable_vllm_is_correction")
    t.set("algo.importance_cap", min(max(cap, 1.0), 1000.0), "vllm_is_truncated_threshold")
    if 0 < floor < 1:
        t.set("algo.importance_floor", floor, "vllm_is_truncated_threshold")
