"""TRL: GRPOConfig/GRPOTrainer's batch checks and a GRPOConfig as evenrl settings.

TRL counts per-device samples; a generation batch is per_device_train_batch_size x processes x
steps_per_generation samples, and (use_vllm, vllm_mode=server) one device runs the vLLM server instead of training.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from evenrl.errors import UsageError
from evenrl.planner.layout import apply_layout_flags, has_shape_flags, layout_from_args
from evenrl.planner.peers.launch import parse_tokens
from evenrl.planner.peers.reader import (
    Check, Source, Translation, gpu_layout, set_data, set_kl, set_lengths, set_lora, set_model, set_parallel,
    set_reward_models, set_steps, nodes_layout)
from evenrl.planner.peers.tables import table, version_name


def translate(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    """A TRL GRPOConfig -> t: the checks TRL would fail on t.layout, and the evenrl settings."""
    _not_grpo(src)
    mode_default = table("trl")["vllm_mode_default"][t.version]
    server = src.bool("use_vllm", False) and src.str("vllm_mode", mode_default) == "server"
    if src.bool("use_vllm", False) and not src.has("vllm_mode"):
        t.notes.append(f"vllm_mode is not set: {version_name('trl', t.version)}'s default is "
                       f"{mode_default} (TRL >= 1.0 colocates vLLM on the training GPUs; before 1.0 it ran as a "
                       "server on a GPU of its own)")
    serve = parse_tokens(src.launch.server) if src.launch and src.launch.server else {}
    engine_tp = _count(serve, "tensor_parallel_size")
    if serve:  # the script starts the server itself: its devices are the rollout's, whatever use_vllm says
        server = True
        t.notes.append(f"the script starts `trl vllm-serve` on {engine_tp * _count(serve, 'data_parallel_size')} "
                       f"devices of its own (tensor_parallel_size {engine_tp}): vLLM in server mode, as evenrl's "
                       "reserved rollout devices (parallel.rollout_devices) with rollout.engine=vllm")
    devices = engine_tp * _count(serve, "data_parallel_size") if serve else 1
    reserve = devices if server and ns.rollout_devices is None else (ns.rollout_devices or 0)
    if has_shape_flags(ns):  # GPUs, like every peer's layout (the evenrl config itself plans for this machine)
        t.layout = gpu_layout(argparse.Namespace(**{**vars(ns), "rollout_devices": reserve}), ns.nnodes or 1,
                           ns.nproc_per_node or 1, reserve)
    elif not src.has("num_processes"):
        base = layout_from_args(ns)
        t.layout = apply_layout_flags(base, argparse.Namespace(**{**vars(ns), "rollout_devices": reserve}))
    else:
        t.layout = _machines(ns, src.int("num_processes", 1), src.int("num_machines", 1), reserve)
    if server and ns.rollout_devices is None and not serve:
        t.notes.append("use_vllm with vllm_mode=server: one device runs `trl vllm-serve`, the rest train "
                       "(--rollout-devices N to change)")
    procs = max(t.layout.training_ranks, 1)
    b, g = src.int("per_device_train_batch_size", 8), src.int("gradient_accumulation_steps", 1)
    k = src.int("num_generations", 8)
    gen, spg = src.int("generation_batch_size", None), src.int("steps_per_generation", None)
    if gen is not None and spg is not None:
        t.checks.append(Check("config", "ValueError",
                              "'generation_batch_size' and 'steps_per_generation' can not be both configured at the "
                              "same time", "set one of them", "TRL >= 0.18"))
    if gen is None:
        spg = spg or g
        gen = b * procs * spg
    elif gen % (b * procs):
        t.checks.append(Check("config", "ValueError",
                              f"generation_batch_size ({gen}) must be divisible by the global batch size "
                              f"({b * procs}).", f"{b} per device x {procs} processes = {b * procs}", "TRL >= 0.18"))
        spg = max(1, gen // (b * procs))
    else:
        spg = gen // (b * procs)
    if gen % k:
        t.checks.append(Check("config", "ValueError",
                              f"generation_batch_size ({gen}) must be divisible by num_generations ({k}).",
                              f"per_device_train_batch_size {b} x {procs} processes x steps_per_generation {spg} = "
                              f"{gen}; {gen} % {k} = {gen % k}", "TRL >= 0.18"))
    if k < 2:
        t.checks.append(Check("config", "ValueError",
                              "GRPO requires at least 2 generations per prompt to calculate the advantages. You "
                              f"provided {k}, which is less than the minimum required.", "num_generations < 2"))
    _eval_check(src, t, procs, k)
    prompts = max(1, math.ceil(gen / k))
    if gen % k:
        t.notes.append(f"generation_batch_size {gen} is {gen / k:g} prompts x {k}: evenrl takes {prompts} whole "
                       f"prompts ({prompts * k} samples)")
    plen, clen = src.int("max_prompt_length", 512), src.int("max_completion_length", 256)
    t.set("data.prompts_per_step", prompts, "generation_batch_size / num_generations")
    t.set("rollout.samples_per_prompt", k, "num_generations")
    set_lengths(t, plen, clen, "max_prompt_length", "max_completion_length")
    m = max(1, spg // g)
    mu = src.int("num_iterations", 1)
    t.set("algo.minibatches_per_step", m, "steps_per_generation / gradient_accumulation_steps")
    t.set("algo.epochs_per_step", mu, "num_iterations")
    t.set("train.token_cap_per_micro_batch", b * (plen + clen), "per_device_train_batch_size")
    eps = src.float("epsilon", 0.2)
    t.set("algo.clip_low", eps, "epsilon")
    t.set("algo.clip_high", src.float("epsilon_high", eps), "epsilon_high")
    beta = src.float("beta", 0.0)
    if beta > 0:
        set_kl(t, beta, "loss", "beta")
        t.set("algo.kl_estimator", "k3", "beta")  # TRL's per-token KL is k3
    scale = src.raw("scale_rewards", "group")
    scale = {True: "group", False: "none", "true": "group", "false": "none"}.get(scale, scale)
    if scale in ("group", "batch", "none"):
        t.set("algo.std_scale", scale, "scale_rewards")
    else:
        t.notes.append(f"scale_rewards={scale!r} has no evenrl equivalent; group std is used")
    set_model(t, src.str("model_name_or_path"), "model_name_or_path")
    t.settings.pop("model.dtype", None)  # the tables': torch_dtype, else bf16 (its default per version)
    _lora(src, t)
    if src.bool("use_vllm", False):
        t.set("rollout.engine", "vllm", "use_vllm")
        if not server:  # colocate mode: vLLM shares each training GPU
            t.set("rollout.memory_fraction", src.float("vllm_gpu_memory_utilization", 0.3),
                  "vllm_gpu_memory_utilization")
    if t.layout.rollout_devices:  # `evenrl train --rollout-devices N` runs what `trl vllm-serve` did
        t.set("parallel.rollout_devices", t.layout.rollout_devices, "vllm_mode=server")
    if serve:
        _server(src, t, serve, engine_tp)
    _launcher(src, t, max(t.layout.training_ranks, 1))
    set_data(t, src.str("dataset_name"), "dataset_name", src.str("dataset_prompt_column", "prompt"),
             keys=("dataset_prompt_column", ""), config=("dataset_config", src.str("dataset_config")),
             split=("dataset_train_split", src.str("dataset_train_split")))
    _rewards(src, t)
    if src.has("max_tool_calling_iterations"):  # GRPOTrainer(tools=[...]) runs them; the config counts rounds
        rounds = src.int("max_tool_calling_iterations", 1, lo=0)
        t.set("rollout.max_turns", min(rounds + 1, 1000), "max_tool_calling_iterations")
        t.set("rollout.max_trajectory_tokens", clen, "max_completion_length")
        t.notes.append(f"max_tool_calling_iterations={rounds}: {rounds} tool rounds are {rounds + 1} assistant turns; "
                       "GRPOTrainer's tools= (and environment_factory) are Python in your script, not in this file: "
                       "evenrl runs them as an environment (docs/multiturn.md: a ToolEnv with those functions as "
                       "tools), rollout.env=package.module:Name, its score in place of reward_funcs")
    steps = src.int("max_steps", -1, lo=-1)
    if steps and steps > 0:
        t.set("train.steps", max(1, math.ceil(steps / (m * mu))), "max_steps")
    else:  # TRL runs num_train_epochs (default 3) over the dataset when max_steps is not set
        set_steps(src, t, "", "num_train_epochs", 3, prompts, fractional=True)


def _count(flags: dict, key: str) -> int:
    value = flags.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise UsageError(f"TRL trl vllm-serve --{key}: got {value!r}; need an integer in 1..4096")
    return value


def _machines(ns: argparse.Namespace, procs: int, machines: int, reserve: int):
    """accelerate's layout: --num_processes over --num_machines nodes (TRL's docs: 32 processes on 4 machines are
    4 nodes of 8), and the vLLM server's devices on nodes of their own where they fill whole nodes."""
    if machines > 1 and procs % machines == 0:
        return nodes_layout(ns, machines, procs // machines, reserve)
    return gpu_layout(ns, 1, procs + reserve, reserve)


def _server(src: Source, t: Translation, serve: dict, engine_tp: int) -> None:
    """`trl vllm-serve --model M --tensor_parallel_size N ...` the script starts: the engine evenrl runs instead."""
    t.set("rollout.engine", "vllm", "trl vllm-serve")
    t.set("rollout.tensor_parallel_size", engine_tp, "trl vllm-serve --tensor_parallel_size")
    if "gpu_memory_utilization" in serve:
        t.set("rollout.memory_fraction", float(serve["gpu_memory_utilization"]),
              "trl vllm-serve --gpu_memory_utilization")
    if isinstance(serve.get("model"), str) and not src.has("model_name_or_path"):
        set_model(t, serve["model"], "trl vllm-serve --model")


def _launcher(src: Source, t: Translation, world: int) -> None:
    """accelerate's --config_file: DeepSpeed ZeRO-3 or FSDP shard the weights, gradients and AdamW state over the
    ranks (evenrl's parallel.sharding=fsdp), their offload is evenrl's CPU offload, a sequence- or
    context-parallel size evenrl's Ulysses sequence parallelism."""
    acc = src.launch.launcher if src.launch else {}
    if not acc:
        return
    name = f"accelerate --config_file {src.launch.launcher_config}"
    kind = str(acc.get("distributed_type", "")).upper()
    ds, fs = acc.get("deepspeed_config") or {}, acc.get("fsdp_config") or {}
    if kind == "DEEPSPEED":
        stage = ds.get("zero_stage", 0)
        on = [str(ds.get(k, "none")).lower() not in ("none", "") for k in ("offload_param_device",
                                                                            "offload_optimizer_device")]
        set_parallel(t, world, params=on[0], optimizer=on[1], shard=stage == 3, keys=(name, name))
        if stage in (1, 2):
            t.notes.append(f"{name}: DeepSpeed ZeRO-{stage} shards the AdamW state"
                           f"{' and the gradients' if stage == 2 else ''} and keeps whole weights on each rank; "
                           "evenrl shards all of them (parallel.sharding=fsdp) or none: the plan keeps them whole")
    elif kind == "FSDP":
        strategy = str(fs.get("fsdp_sharding_strategy", fs.get("fsdp_reshard_after_forward", True)))
        set_parallel(t, world, params=bool(fs.get("fsdp_offload_params")), optimizer=False,
                     shard=strategy.upper() not in ("NO_SHARD", "FALSE"), keys=(name, name))
    pc = acc.get("parallelism_config") or {}
    for key, what in (("parallelism_config_sp_size", "Ulysses sequence parallelism, as evenrl's"),
                      ("parallelism_config_cp_size", "context parallelism (ring attention over the sequence); "
                                                     "evenrl's is Ulysses (all-to-all over heads)")):
        if isinstance(pc.get(key), int) and pc[key] > 1:
            t.set("parallel.sequence_parallel_size", pc[key], name)
            t.notes.append(f"{name}: {key}={pc[key]}: {what}: parallel.sequence_parallel_size={pc[key]}")


def _lora(src: Source, t: Translation) -> None:
    """TRL's LoRA: use_peft with its ModelConfig fields (lora_r, ...), or a peft_config mapping of LoraConfig's."""
    if isinstance(src.raw("peft_config"), dict):
        set_lora(src, t, rank="peft_config.r", alpha="peft_config.lora_alpha", targets="peft_config.target_modules",
                 dropout="peft_config.lora_dropout", rank_default=8, alpha_default=8.0)  # peft's defaults
        named = src.has("peft_config.target_modules")
    elif src.bool("use_peft", False):  # TRL's ModelConfig defaults
        set_lora(src, t, rank="lora_r", alpha="lora_alpha", targets="lora_target_modules", dropout="lora_dropout",
                 rank_default=16, alpha_default=32.0, dropout_default=0.05)
        named = src.has("lora_target_modules")
    else:
        return
    if not named and t.settings.get("model.lora.rank"):
        t.notes.append("no target modules named: peft's own default for the model type (q_proj and v_proj for "
                       "Llama and Qwen2); evenrl adapts every linear layer of the decoder blocks "
                       "(model.lora.target_modules=[q_proj,v_proj] for peft's)")


def _rewards(src: Source, t: Translation) -> None:
    """reward_funcs (a model path or id, a trl.rewards name, a dotted function; one or a list) with reward_weights,
    or the older script's reward_model_name_or_path: reward models become {model: PATH} entries."""
    funcs = src.raw("reward_funcs") or src.raw("reward_model_name_or_path") or []
    funcs = [funcs] if isinstance(funcs, str) else list(funcs)
    weights = src.raw("reward_weights") or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise UsageError(f"TRL reward_weights: {len(weights)} weights for {len(funcs)} reward_funcs; need one each")
    models, others = [], []
    for f, w in zip(map(str, funcs), weights):
        if Path(f).expanduser().is_dir() or "/" in f:  # a directory, or a hub id (which the helper notes)
            models.append((f, float(w)))
        elif f == "accuracy_reward":
            others.append({"name": "math", "weight": float(w)})
            t.notes.append("reward_funcs accuracy_reward (math-verify against the solution column) is evenrl's math")
        elif "." in f:
            module, _, func = f.rpartition(".")
            others.append({"name": f"{module}:{func}", "weight": float(w)})
            t.notes.append(f"reward_funcs {f}: evenrl calls {module}:{func}(completion, sample_row) -> float, one "
                           "sample at a time, where TRL passes lists: wrap it")
        else:
            t.notes.append(f"reward_funcs {f} has no evenrl equivalent; write it as a 'package.module:function' reward")
    key = "reward_funcs" if src.has("reward_funcs") else "reward_model_name_or_path"
    set_reward_models(t, models, key, others)


# keys only an accelerate config has, and keys of an SFT config that a GRPO config never sets
_ACCELERATE = ("compute_environment", "distributed_type", "mixed_precision", "machine_rank", "num_machines")
_SFT = ("packing", "max_seq_length", "dataset_text_field", "completion_only_loss", "assistant_only_loss")
_GRPO = ("num_generations", "reward_funcs", "max_completion_length", "beta", "use_vllm", "epsilon", "loss_type")


def _not_grpo(src: Source) -> None:
    """An accelerate or SFT config given as a GRPO config is refused, not planned as GRPO with TRL's defaults."""
    if sum(src.has(k) for k in _ACCELERATE) >= 2:
        procs = src.raw("num_processes")
        raise UsageError("the file is an accelerate config (the launcher's)" +
                         (f"; its num_processes={procs} is a layout: --nproc-per-node {procs}" if procs else "") +
                         "; give the GRPO config (the --config of the trl or accelerate command) to --from trl")
    if any(src.has(k) for k in _SFT) and not any(src.has(k) for k in _GRPO):
        raise UsageError("the file is an SFT config (packing / max_seq_length / dataset_text_field, no GRPO "
                         "settings); --from trl reads GRPO configs, and evenrl's SFT is `evenrl sft CONFIG`")


def _eval_check(src: Source, t: Translation, procs: int, k: int) -> None:
    """TRL's check of the eval batch against the generations per prompt, when evaluation is on; each version's."""
    if src.str("eval_strategy", "no") in ("no", "False", "false") and not src.bool("do_eval", False):
        return
    b = src.int("per_device_eval_batch_size", 8)
    if t.version == "0.18":
        glob = procs * b
        valid = [x for x in range(2, glob + 1) if glob % x == 0]
        if k not in valid:
            t.checks.append(Check("config", "ValueError",
                                  f"The global eval batch size ({procs} x {b}) must be evenly divisible by the number "
                                  f"of generations per prompt ({k}). Given the current global eval batch size, the "
                                  f"valid values for the number of generations are: {valid}.",
                                  f"{procs} processes x per_device_eval_batch_size {b} = {glob}", "TRL 0.18"))
        return
    k_eval = src.int("num_generations_eval", None) or k
    if (b * procs) % k_eval:
        t.checks.append(Check("config", "ValueError",
                              f"The global eval batch size ({b} * {procs}) must be divisible by the number of "
                              f"generations used for evaluation ({k_eval}).",
                              f"per_device_eval_batch_size {b} x {procs} processes = {b * procs}; % {k_eval} = "
                              f"{b * procs % k_eval}", "TRL >= 1.0"))

