"""`evenrl plan --from verl|easyr1|trl|openrlhf FILE [overrides] [layout flags]`: a peer's own config, the
checks that peer would fail on the layout (with the message it prints), and the equivalent evenrl config + plan.

    evenrl plan --from easyr1 examples/config.yaml data.rollout_batch_size=512 trainer.n_gpus_per_node=6
    evenrl plan --from verl ppo.yaml data.train_batch_size=2 trainer.n_gpus_per_node=4 --device-memory-gib 80
    evenrl plan --from trl grpo.yaml --nproc-per-node 4          # vllm_mode=server reserves one of the 4 GPUs
    evenrl plan --from openrlhf args.txt                          # the train_ppo_ray flags, as text or YAML/JSON

Files: verl/EasyR1 YAML (Hydra-style dotted overrides, a leading + or ++ is accepted); a TRL GRPOConfig as
YAML/JSON (plus `num_processes` and Open-R1's `model_name_or_path`/`dataset_name` when present); OpenRLHF's
command-line flags as YAML/JSON or as the command text itself. Keys not set take the peer's defaults.
Layout: verl/EasyR1 read trainer.nnodes x trainer.n_gpus_per_node, OpenRLHF actor_num_nodes x
actor_num_gpus_per_node (+ vllm_num_engines x vllm_tensor_parallel_size unless colocate_all_models); --nnodes /
--nproc-per-node replace those (OpenRLHF: the actor GPUs). TRL trains on num_processes or the layout flags,
minus one GPU for a vLLM server (use_vllm with vllm_mode=server).
Messages were checked against the peers' source (verl ray_trainer/_validate_config and fsdp_workers, EasyR1
ray_trainer and fsdp_workers, TRL grpo_config/grpo_trainer, OpenRLHF train_ppo_ray, DeepSpeed runtime/config).
Exit code: 0 when the evenrl equivalent is runnable (the peer's failures are what this command explains).
JSON: {"schema": "evenrl.foreign/1", framework, file, layout, checks[{stage, error, message, why, version}],
notes[], config{...}, plan{evenrl.plan/1}} (+ "fit" with --fit, as in evenrl.plan).
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from evenrl.config import RunConfig, apply_overrides, read_text_file, validation_message
from evenrl.errors import UsageError
from evenrl.planner.layout import Layout, apply_layout_flags, has_shape_flags, layout_from_args, make_layout
from evenrl.planner.memory import with_settings
from evenrl.planner.plan import count_rows, make_plan, report

NAMES = {"verl": "verl", "easyr1": "EasyR1", "trl": "TRL", "openrlhf": "OpenRLHF"}
STAGES = {"config": "at config check (before anything loads)", "worker": "at worker start (before the model loads)",
          "deepspeed": "at DeepSpeed init (model loading)", "rollout": "at the first rollout (after the model loads)"}
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "abs": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


@dataclass(frozen=True)
class Check:
    stage: str  # a key of STAGES
    error: str  # exception type the peer raises
    message: str  # what it prints
    why: str  # the arithmetic behind it
    version: str = ""  # when only some versions fail this way

    def text(self) -> str:
        v = f" [{self.version}]" if self.version else ""
        return f"{STAGES[self.stage]}{v}: {self.error}: {self.message}\n       {self.why}"


@dataclass
class Translation:
    framework: str
    layout: Layout
    settings: dict[str, Any] = field(default_factory=dict)  # evenrl dotted key -> value
    source: dict[str, str] = field(default_factory=dict)  # evenrl dotted key -> the peer's key
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, src: str) -> None:
        self.settings[key] = value
        self.source[key] = src


class Source:
    """Typed reads from the peer's config; a wrong type is a one-line UsageError naming the peer's key."""

    def __init__(self, framework: str, data: dict):
        self.fw, self.data = framework, data

    def raw(self, key: str, default: Any = None) -> Any:
        if key in self.data:  # flat frameworks (TRL, OpenRLHF) may have dots in nothing; nested ones use paths
            return self.data[key] if self.data[key] is not None else default
        node: Any = self.data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return default if node is None else node

    def has(self, key: str) -> bool:
        return self.raw(key) is not None

    def int(self, key: str, default: int | None, lo: int = 1) -> int | None:
        v = self.raw(key, default)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, str) and v.strip().lstrip("-").isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 10**9:
            raise UsageError(f"{self.fw} {key}: got {v!r}; need an integer in {lo}..10^9")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.raw(key, default)
        try:
            if isinstance(v, bool):
                raise ValueError
            out = float(v)
        except (TypeError, ValueError):
            raise UsageError(f"{self.fw} {key}: got {v!r}; need a number") from None
        if not math.isfinite(out):
            raise UsageError(f"{self.fw} {key}: got {v!r}; need a finite number")
        return out

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw(key, default)
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if not isinstance(v, bool):
            raise UsageError(f"{self.fw} {key}: got {v!r}; need true or false")
        return v

    def str(self, key: str, default: str = "") -> str:
        v = self.raw(key, default)
        if isinstance(v, list):  # verl train_files may be a list; the first file stands for the set
            v = v[0] if v else default
        return str(v)


# ------------------------------------------------------------------------------------------ reading

def read_foreign(framework: str, path: str, overrides: list[str]) -> dict:
    p = Path(path)
    text = read_text_file(p, f"the {NAMES[framework]} config file", "a UTF-8 text file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        if not (framework == "openrlhf" and "--" in text):
            mark = getattr(e, "problem_mark", None)
            raise UsageError(f"{p}: invalid YAML/JSON{f' at line {mark.line + 1}' if mark else ''}; "
                             "fix the syntax") from None
        data = None
    if framework == "openrlhf" and not isinstance(data, dict) and "--" in text:
        data = parse_flags(text)  # the command line itself
    if data is None:
        raise UsageError(f"{p}: file is empty; expected the {NAMES[framework]} config")
    if not isinstance(data, dict):
        raise UsageError(f"{p}: top level is a {type(data).__name__}; expected a mapping of "
                         f"{NAMES[framework]} settings")
    overrides = [o[2:] if o.startswith("++") else o[1:] if o.startswith("+") else o for o in overrides]
    for o in overrides:
        if o.startswith("~"):
            raise UsageError(f"override {o!r}: deleting keys is not supported; set the value instead")
    data = apply_overrides(data, overrides)
    return _flatten(data) if framework == "openrlhf" else data


# OpenRLHF's newer nested flags (--rollout.batch_size) flatten to these classic names.
_OPENRLHF_ALIASES = {"rollout_n_samples_per_prompt": "n_samples_per_prompt",
                     "rollout_micro_batch_size": "micro_rollout_batch_size",
                     "train_micro_batch_size": "micro_train_batch_size", "train_batch_size": "train_batch_size",
                     "ds_zero_stage": "zero_stage", "ds_ring_attn_size": "ring_attn_size"}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}".replace(".", "_").replace("-", "_")
        if isinstance(v, dict):
            out.update(_flatten(v, key + "_"))
        else:
            out[_OPENRLHF_ALIASES.get(key, key)] = v
    return out


def parse_flags(text: str) -> dict:
    """`python -m openrlhf.cli.train_ppo_ray --a 1 --flag --b x` -> {"a": 1, "flag": True, "b": "x"}."""
    tokens = [t for t in shlex.split(text.replace("\\\n", " "), comments=True) if t.strip()]
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("--"):
            continue  # the command itself (python3 -m ...)
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if i < len(tokens) and not tokens[i].startswith("--"):
                value, i = tokens[i], i + 1
            else:
                value = "true"
        parsed = yaml.safe_load(value) if value else True
        out[key.replace("-", "_")] = parsed
    return out


# ------------------------------------------------------------------------------------------ layouts

def _layout(ns: argparse.Namespace, nnodes: int, per_node: int, rollout: int = 0) -> Layout:
    base = make_layout(nnodes, per_node, device="cuda", device_memory_gib=ns.device_memory_gib or 0.0,
                       rollout_devices=rollout, source="config")
    return apply_layout_flags(base, ns)


def _split_layout(ns, nodes: int, train_per_node: int, rollout: int) -> Layout:
    """Training ranks nodes x train_per_node plus `rollout` generation devices, as nodes x processes."""
    if rollout % nodes == 0:
        return _layout(ns, nodes, train_per_node + rollout // nodes, rollout)
    return _layout(ns, 1, nodes * train_per_node + rollout, rollout)


def _trainer_layout(src: Source, ns: argparse.Namespace) -> Layout:
    """verl and EasyR1 both size the cluster with trainer.nnodes x trainer.n_gpus_per_node; shape flags win."""
    if has_shape_flags(ns):
        return _layout(ns, ns.nnodes or 1, ns.nproc_per_node or 1)
    return _layout(ns, src.int("trainer.nnodes", 1), src.int("trainer.n_gpus_per_node", 8))


# ------------------------------------------------------------------------------------------ verl

def _verl(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    a = "actor_rollout_ref.actor."
    t.layout = _trainer_layout(src, ns)
    world = t.layout.world
    tbs, n = src.int("data.train_batch_size", 1024), src.int("actor_rollout_ref.rollout.n", 1)
    mini = src.int(a + "ppo_mini_batch_size", 256)
    micro = src.int(a + "ppo_micro_batch_size_per_gpu", None)
    if micro is None and src.has(a + "ppo_micro_batch_size"):
        micro = max(1, src.int(a + "ppo_micro_batch_size", 1) // world)
    dyn = src.bool(a + "use_dynamic_bsz", False)
    sp = src.int(a + "ulysses_sequence_parallel_size", 1)
    plen, rlen = src.int("data.max_prompt_length", 512), src.int("data.max_response_length", 512)
    if (tbs * n) % world:
        t.checks.append(Check("config", "AssertionError",
                              f"real_train_batch_size ({tbs * n}) must be divisible by minimal possible batch size "
                              f"({world})", f"train_batch_size {tbs} x rollout.n {n} = {tbs * n} samples over "
                              f"{world} GPUs leaves {tbs * n % world}", "verl >= 0.3"))
    if not dyn and tbs < mini:
        t.checks.append(Check("config", "ValueError",
                              f"train_batch_size ({tbs}) must be >= actor.ppo_mini_batch_size ({mini})",
                              "ppo_mini_batch_size counts prompts (default 256)", "recent verl"))
    norm = mini * n // max(world // sp, 1)
    if norm == 0:
        t.checks.append(Check("worker", "AssertionError",
                              f"ppo_mini_batch_size {norm} should be larger than 0 after normalization",
                              f"ppo_mini_batch_size {mini} x n {n} // ({world} GPUs // sp {sp}) = 0"))
    elif micro and not dyn and norm % micro:
        t.checks.append(Check("worker", "AssertionError",
                              f"normalized ppo_mini_batch_size {norm} should be divisible by "
                              f"ppo_micro_batch_size_per_gpu {micro}",
                              f"ppo_mini_batch_size {mini} x n {n} // {world // sp} = {norm}; {norm} % {micro} = "
                              f"{norm % micro}"))
    if tbs % world:
        t.checks.append(Check("rollout", "AssertionError",
                              f"only support equal chunk. Got size of DataProto {tbs} and chunk {world}.",
                              f"the {tbs} prompts are split over {world} workers before rollout.n repeats them: "
                              f"{tbs} % {world} = {tbs % world}", "verl before the up-front check, e.g. Logic-RL"))
    _dataloader_check(src, t, "data.train_files", tbs, "AssertionError", "Train dataloader is empty!")
    t.set("data.prompts_per_step", tbs, "data.train_batch_size")
    t.set("rollout.samples_per_prompt", n, "actor_rollout_ref.rollout.n")
    _lengths(t, plen, rlen, "data.max_prompt_length", "data.max_response_length")
    t.set("algo.minibatches_per_step", max(1, tbs // mini), a + "ppo_mini_batch_size")
    t.set("algo.epochs_per_step", src.int(a + "ppo_epochs", 1), a + "ppo_epochs")
    cap = src.int(a + "ppo_max_token_len_per_gpu", 16384) if dyn else (micro or 1) * (plen + rlen)
    t.set("train.token_cap_per_micro_batch", cap, a + ("ppo_max_token_len_per_gpu" if dyn else
                                                      "ppo_micro_batch_size_per_gpu"))
    _sampling(src, t, "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_p")
    t.set("train.lr", src.float(a + "optim.lr", 1e-6), a + "optim.lr")
    clip = src.float(a + "clip_ratio", 0.2)
    t.set("algo.clip_low", src.float(a + "clip_ratio_low", clip), a + "clip_ratio_low")
    t.set("algo.clip_high", src.float(a + "clip_ratio_high", clip), a + "clip_ratio_high")
    if src.bool(a + "use_kl_loss", False):
        _kl(t, src.float(a + "kl_loss_coef", 0.001), "loss", src.str(a + "kl_loss_type", "low_var_kl"),
            a + "kl_loss_coef")
    elif src.bool("algorithm.use_kl_in_reward", False):
        _kl(t, src.float("algorithm.kl_ctrl.kl_coef", 0.001), "reward", src.str("algorithm.kl_penalty", "kl"),
            "algorithm.kl_ctrl.kl_coef")
    _advantage(t, src.str("algorithm.adv_estimator", "gae"), "algorithm.adv_estimator",
               {"grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
                "drgrpo": "dr_grpo", "dr_grpo": "dr_grpo"})
    if not src.bool("algorithm.norm_adv_by_std_in_grpo", True):
        t.set("algo.std_scale", "none", "algorithm.norm_adv_by_std_in_grpo")
    _loss_agg(t, src.str(a + "loss_agg_mode", "token-mean"), a + "loss_agg_mode")
    _model(t, src.str("actor_rollout_ref.model.path"), "actor_rollout_ref.model.path")
    t.set("model.gradient_checkpointing", src.bool("actor_rollout_ref.model.enable_gradient_checkpointing", False),
          "actor_rollout_ref.model.enable_gradient_checkpointing")
    _parallel(t, world, params=src.bool(a + "fsdp_config.param_offload", False),
              optimizer=src.bool(a + "fsdp_config.optimizer_offload", False), shard=True)
    _data(t, src.str("data.train_files"), "data.train_files", src.str("data.prompt_key", "prompt"))
    _steps(src, t, "trainer.total_training_steps", "trainer.total_epochs", 1, tbs)
    if src.has("actor_rollout_ref.rollout.gpu_memory_utilization"):
        t.notes.append("rollout.gpu_memory_utilization sizes vLLM's KV cache; evenrl's 'hf' sampler uses the "
                       "training model, so its KV cache is part of the memory estimate instead")


# ------------------------------------------------------------------------------------------ EasyR1

def _easyr1(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    a = "worker.actor."
    t.layout = _trainer_layout(src, ns)
    world = t.layout.world
    rbs, n = src.int("data.rollout_batch_size", 512), src.int("worker.rollout.n", 1)
    gbs = src.int(a + "global_batch_size", 256)
    m_up = src.int(a + "micro_batch_size_per_device_for_update", 4)
    m_exp = src.int(a + "micro_batch_size_per_device_for_experience", 16)
    sp = src.int(a + "ulysses_size", None) or src.int(a + "ulysses_sequence_parallel_size", 1)
    plen, rlen = src.int("data.max_prompt_length", 512), src.int("data.max_response_length", 512)
    adv = src.str("algorithm.adv_estimator", "grpo")
    if rbs % gbs:
        t.checks.append(Check("config", "ValueError",
                              "Rollout batch size must be divisible by actor global batch size.",
                              f"rollout_batch_size {rbs} % global_batch_size {gbs} = {rbs % gbs}"))
    if (rbs * n) % m_exp:
        t.checks.append(Check("config", "ValueError",
                              "Rollout batch size * rollout.n must be divisible by actor micro batch size for "
                              "experience.", f"{rbs} x {n} = {rbs * n}; % micro_batch_size_per_device_for_experience "
                              f"{m_exp} = {rbs * n % m_exp}"))
    if adv in ("grpo", "rloo") and n == 1:
        t.checks.append(Check("config", "ValueError", "GRPO and RLOO algorithm need `config.worker.rollout.n > 1`.",
                              "one sample per prompt has no group baseline", "recent EasyR1"))
    per_dev = (gbs * n if n > 1 else gbs) // max(world // sp, 1)
    if per_dev == 0:
        t.checks.append(Check("worker", "ValueError",
                              "actor global batch size * ulysses size must be larger than num gpus.",
                              f"global_batch_size {gbs} x n {n} // ({world} GPUs // ulysses {sp}) = 0"))
    elif per_dev % m_up:
        t.checks.append(Check("worker", "ValueError",
                              "actor global batch size per device must be divisible by the micro batch size.",
                              f"global_batch_size {gbs} x rollout.n {n} = {gbs * n} samples // {world // sp} GPUs "
                              f"= {per_dev} per GPU; {per_dev} % micro_batch_size_per_device_for_update {m_up} = "
                              f"{per_dev % m_up}"))
    if per_dev and src.bool(a + "fsdp.enable_cpu_offload", False) and per_dev != m_up:
        t.checks.append(Check("worker", "ValueError",
                              "actor cannot use FSDP's CPU offload when gradient accumulation is enabled.",
                              f"{per_dev} samples per GPU != micro_batch_size_per_device_for_update {m_up}"))
    if rbs % world:
        t.checks.append(Check("rollout", "AssertionError",
                              f"only support equal chunk. Got size of DataProto {rbs} and chunk {world}.",
                              f"the {rbs} prompts are split over {world} workers for generation: {rbs} % {world} = "
                              f"{rbs % world} (not checked up front)"))
    _dataloader_check(src, t, "data.train_files", rbs, "AssertionError", "")
    t.set("data.prompts_per_step", rbs, "data.rollout_batch_size")
    t.set("rollout.samples_per_prompt", n, "worker.rollout.n")
    _lengths(t, plen, rlen, "data.max_prompt_length", "data.max_response_length")
    t.set("algo.minibatches_per_step", max(1, rbs // gbs), a + "global_batch_size")
    t.set("algo.epochs_per_step", src.int(a + "ppo_epochs", 1), a + "ppo_epochs")
    t.set("train.token_cap_per_micro_batch", m_up * (plen + rlen), a + "micro_batch_size_per_device_for_update")
    _sampling(src, t, "worker.rollout.temperature", "worker.rollout.top_p")
    t.set("train.lr", src.float(a + "optim.lr", 1e-6), a + "optim.lr")
    t.set("algo.clip_low", src.float(a + "clip_ratio_low", 0.2), a + "clip_ratio_low")
    t.set("algo.clip_high", src.float(a + "clip_ratio_high", 0.3), a + "clip_ratio_high")
    if not src.bool("algorithm.disable_kl", False):
        _kl(t, src.float("algorithm.kl_coef", 1e-3), "loss" if src.bool("algorithm.use_kl_loss", False) else "reward",
            src.str("algorithm.kl_penalty", "kl"), "algorithm.kl_coef")
    _advantage(t, adv, "algorithm.adv_estimator",
               {"grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp_baseline"})
    mode = src.str(a + "loss_avg_mode", "token")
    _loss_agg(t, {"token": "token-mean", "seq": "seq-mean-token-mean"}.get(mode, mode), a + "loss_avg_mode")
    _model(t, src.str(a + "model.model_path"), a + "model.model_path")
    t.set("model.gradient_checkpointing", src.bool(a + "model.enable_gradient_checkpointing", True),
          a + "model.enable_gradient_checkpointing")
    _parallel(t, world, params=src.bool(a + "offload.offload_params", False),
              optimizer=src.bool(a + "offload.offload_optimizer", False),
              shard=src.bool(a + "fsdp.enable_full_shard", True))
    _data(t, src.str("data.train_files"), "data.train_files", src.str("data.prompt_key", "prompt"),
          src.str("data.answer_key", "answer"))
    _steps(src, t, "trainer.max_steps", "trainer.total_episodes", 10, rbs)


# ------------------------------------------------------------------------------------------ TRL

def _trl(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    server = src.bool("use_vllm", False) and src.str("vllm_mode", "server") == "server"
    reserve = 1 if server and ns.rollout_devices is None else (ns.rollout_devices or 0)
    if has_shape_flags(ns):  # GPUs, like every peer's layout (the evenrl config itself plans for this machine)
        t.layout = _layout(argparse.Namespace(**{**vars(ns), "rollout_devices": reserve}), ns.nnodes or 1,
                           ns.nproc_per_node or 1, reserve)
    elif not src.has("num_processes"):
        base = layout_from_args(ns)
        t.layout = apply_layout_flags(base, argparse.Namespace(**{**vars(ns), "rollout_devices": reserve}))
    else:
        t.layout = _layout(ns, 1, src.int("num_processes", 1) + reserve, reserve)
    if server and ns.rollout_devices is None:
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
    glob = procs * b
    valid = [x for x in range(2, glob + 1) if glob % x == 0]
    if k not in valid:
        t.checks.append(Check("worker", "ValueError",
                              f"The global train batch size ({procs} x {b}) must be evenly divisible by the number "
                              f"of generations per prompt ({k}). Given the current train batch size, the valid "
                              f"values for the number of generations are: {valid}.",
                              f"{procs} processes x per_device_train_batch_size {b} = {glob}; {glob} % {k} = "
                              f"{glob % k}", "TRL < 0.18, at GRPOTrainer()"))
    prompts = max(1, math.ceil(gen / k))
    if gen % k:
        t.notes.append(f"generation_batch_size {gen} is {gen / k:g} prompts x {k}: evenrl takes {prompts} whole "
                       f"prompts ({prompts * k} samples)")
    plen, clen = src.int("max_prompt_length", 512), src.int("max_completion_length", 256)
    t.set("data.prompts_per_step", prompts, "generation_batch_size / num_generations")
    t.set("rollout.samples_per_prompt", k, "num_generations")
    _lengths(t, plen, clen, "max_prompt_length", "max_completion_length")
    m = max(1, spg // g)
    mu = src.int("num_iterations", 1)
    t.set("algo.minibatches_per_step", m, "steps_per_generation / gradient_accumulation_steps")
    t.set("algo.epochs_per_step", mu, "num_iterations")
    t.set("train.token_cap_per_micro_batch", b * (plen + clen), "per_device_train_batch_size")
    _sampling(src, t, "temperature", "top_p")
    t.set("train.lr", src.float("learning_rate", 1e-6), "learning_rate")
    eps = src.float("epsilon", 0.2)
    t.set("algo.clip_low", eps, "epsilon")
    t.set("algo.clip_high", src.float("epsilon_high", eps), "epsilon_high")
    beta = src.float("beta", 0.0)
    if beta > 0:
        _kl(t, beta, "loss", "k3", "beta")
    scale = src.raw("scale_rewards", "group")
    scale = {True: "group", False: "none", "true": "group", "false": "none"}.get(scale, scale)
    if scale in ("group", "batch", "none"):
        t.set("algo.std_scale", scale, "scale_rewards")
    else:
        t.notes.append(f"scale_rewards={scale!r} has no evenrl equivalent; group std is used")
    loss = src.str("loss_type", "dapo")
    _loss_agg(t, {"grpo": "seq-mean-token-mean", "dapo": "token-mean", "bnpo": "token-mean",
                  "dr_grpo": "seq-mean-token-sum"}.get(loss, loss), "loss_type")
    _model(t, src.str("model_name_or_path"), "model_name_or_path")
    t.set("model.gradient_checkpointing", src.bool("gradient_checkpointing", False), "gradient_checkpointing")
    t.set("model.dtype", "bfloat16" if src.bool("bf16", True) else "float32", "bf16")
    _data(t, src.str("dataset_name"), "dataset_name", src.str("dataset_prompt_column", "prompt"))
    steps = src.int("max_steps", -1, lo=-1)
    if steps and steps > 0:
        t.set("train.steps", max(1, math.ceil(steps / (m * mu))), "max_steps")


# ------------------------------------------------------------------------------------------ OpenRLHF

def _openrlhf(src: Source, ns: argparse.Namespace, t: Translation) -> None:
    if has_shape_flags(ns):
        nodes, per = ns.nnodes or 1, ns.nproc_per_node or 1
    else:
        nodes, per = src.int("actor_num_nodes", 1), src.int("actor_num_gpus_per_node", 8)
    engines, tp = src.int("vllm_num_engines", 0, lo=0), src.int("vllm_tensor_parallel_size", 1)
    shared = src.bool("colocate_all_models", False)
    rollout = ns.rollout_devices if ns.rollout_devices is not None else (0 if shared else engines * tp)
    t.layout = _split_layout(argparse.Namespace(**{**vars(ns), "rollout_devices": None}), nodes, per, rollout)
    aw = nodes * per
    rbs, n = src.int("rollout_batch_size", 1024), src.int("n_samples_per_prompt", 1)
    tbs, micro = src.int("train_batch_size", 128), src.int("micro_train_batch_size", 8)
    mroll = src.int("micro_rollout_batch_size", 8)
    ring, dstp = src.int("ring_attn_size", 1), src.int("ds_tensor_parallel_size", 1)
    plen, glen = src.int("prompt_max_len", 1024), src.int("generate_max_len", 1024)
    if rbs % aw:
        t.checks.append(Check("config", "AssertionError",
                              f"rollout_bach_size must be divisible by actor_world_size, got {rbs} and {aw}",
                              f"rollout_batch_size {rbs} % {aw} actor GPUs = {rbs % aw}", "older OpenRLHF"))
    if engines and aw % engines and engines % aw:
        t.checks.append(Check("config", "AssertionError",
                              f"actor_world_size must be divisible by vllm_num_engines, got {aw} and {engines}",
                              f"{aw} actor GPUs, {engines} vLLM engines"))
    dp = max(aw // ring // dstp, 1)
    if n * rbs // mroll < dp:
        t.checks.append(Check("config", "AssertionError",
                              "The number of sample batches must be greater than or equal to the effective number of "
                              "actor processes.", f"n_samples_per_prompt {n} x rollout_batch_size {rbs} // "
                              f"micro_rollout_batch_size {mroll} = {n * rbs // mroll} < {dp} actor processes"))
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
    _lengths(t, plen, glen, "prompt_max_len", "generate_max_len")
    t.set("algo.minibatches_per_step", max(1, rbs * n // tbs), "train_batch_size")
    t.set("algo.epochs_per_step", src.int("max_epochs", 1), "max_epochs")
    t.set("train.token_cap_per_micro_batch", micro * (plen + glen), "micro_train_batch_size")
    _sampling(src, t, "temperature", "top_p")
    t.set("train.lr", src.float("actor_learning_rate", 1e-6), "actor_learning_rate")
    eps = src.float("eps_clip", 0.2)
    low_high = src.raw("eps_clip_low_high")
    low, high = (low_high if isinstance(low_high, list) and len(low_high) == 2 else (eps, eps))
    t.set("algo.clip_low", float(low), "eps_clip")
    t.set("algo.clip_high", float(high), "eps_clip")
    kl = src.float("init_kl_coef", 0.01)
    if kl > 0:
        _kl(t, kl, "loss" if src.bool("use_kl_loss", False) else "reward", src.str("kl_estimator", "k1"),
            "init_kl_coef")
    _advantage(t, src.str("advantage_estimator", "gae"), "advantage_estimator",
               {"group_norm": "grpo", "rloo": "rloo", "reinforce_baseline": "reinforce_pp_baseline",
                "dr_grpo": "dr_grpo"})
    _model(t, src.str("pretrain"), "pretrain")
    t.set("model.gradient_checkpointing", src.bool("gradient_checkpointing", False), "gradient_checkpointing")
    t.set("model.dtype", "bfloat16" if src.bool("bf16", False) else "float32", "bf16")
    zero = src.int("zero_stage", 2, lo=0)
    _parallel(t, aw, params=False, optimizer=src.bool("adam_offload", False), shard=zero == 3)
    _data(t, src.str("prompt_data"), "prompt_data", src.str("input_key", "input"), src.str("label_key", "answer"))
    rows = count_rows(t.settings.get("data.path", ""))
    if rows:
        t.set("train.steps", max(1, rows // rbs) * src.int("num_episodes", 1), "num_episodes")


# ------------------------------------------------------------------------------------------ shared mapping

def _lengths(t: Translation, prompt: int, new: int, pkey: str, nkey: str) -> None:
    t.set("data.max_prompt_tokens", prompt, pkey)
    t.set("rollout.max_new_tokens", new, nkey)


def _sampling(src: Source, t: Translation, temp: str, top_p: str) -> None:
    t.set("rollout.temperature", src.float(temp, 1.0), temp)
    t.set("rollout.top_p", src.float(top_p, 1.0), top_p)


def _kl(t: Translation, coef: float, where: str, estimator: str, key: str) -> None:
    t.set("algo.kl_coef", coef, key)
    t.set("algo.kl_in", where, key)
    t.set("algo.kl_estimator", KL_ESTIMATORS.get(estimator, "k3"), key)


def _advantage(t: Translation, name: str, key: str, table: dict[str, str]) -> None:
    if name in table:
        t.set("algo.advantage", table[name], key)
        return
    t.set("algo.advantage", "grpo", key)
    t.notes.append(f"{key}={name} (e.g. PPO with a critic) has no evenrl equivalent; the plan uses grpo")


def _loss_agg(t: Translation, mode: str, key: str) -> None:
    if mode.startswith("seq-mean-token-sum"):
        mode = "seq-mean-token-sum"
    if mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        t.set("algo.loss_aggregation", mode, key)
    else:
        t.notes.append(f"{key}={mode} has no evenrl equivalent; token-mean is used")


def _model(t: Translation, path: str, key: str) -> None:
    if path and Path(path).expanduser().is_dir():
        t.set("model.path", path, key)
    elif path:
        t.notes.append(f"{key}={path!r} is not a local directory; set model.path to a local copy for the memory "
                       "estimate")
    t.set("model.dtype", "bfloat16", key)


def _parallel(t: Translation, world: int, *, params: bool, optimizer: bool, shard: bool) -> None:
    t.set("parallel.sharding", "fsdp" if shard and world > 1 else "replicated", "fsdp")
    t.set("parallel.cpu_offload", "full" if params and shard else "optimizer" if (optimizer or params) else "none",
          "offload")


def _data(t: Translation, path: str, key: str, prompt_field: str, answer_field: str | None = None) -> None:
    local = path.split("@")[0] if path else ""
    if local and Path(local).expanduser().exists():
        t.set("data.path", local, key)
    elif path:
        t.notes.append(f"{key}={path!r} is not a local file or directory; set data.path to a local copy")
    t.set("data.prompt_field", prompt_field, key)
    if answer_field:
        t.set("data.answer_field", answer_field, key)


def _steps(src: Source, t: Translation, steps_key: str, epochs_key: str, epochs_default: int, prompts: int) -> None:
    steps = src.int(steps_key, None)
    if steps:
        t.set("train.steps", steps, steps_key)
        return
    rows = count_rows(t.settings.get("data.path", ""))
    if rows:
        t.set("train.steps", max(1, rows // prompts) * src.int(epochs_key, epochs_default), epochs_key)


def _dataloader_check(src: Source, t: Translation, key: str, prompts: int, error: str, message: str) -> None:
    rows = count_rows(src.str(key))
    if rows is not None and rows < prompts:
        t.checks.append(Check("config", error, message or "(bare assert len(self.train_dataloader) >= 1)",
                              f"{rows} rows with drop_last=True make no batch of {prompts} prompts"))


TRANSLATORS = {"verl": _verl, "easyr1": _easyr1, "trl": _trl, "openrlhf": _openrlhf}


def translate(framework: str, data: dict, ns: argparse.Namespace) -> tuple[Translation, RunConfig]:
    """The peer's config -> its failing checks and the equivalent evenrl RunConfig (validated)."""
    t = Translation(framework, Layout())
    TRANSLATORS[framework](Source(NAMES[framework], data), ns, t)
    try:
        cfg = with_settings(RunConfig(), t.settings)
    except ValidationError as e:
        loc = ".".join(str(x) for x in e.errors()[0]["loc"])
        raise UsageError(validation_message(e, f"{NAMES[framework]} {t.source.get(loc, loc)} -> evenrl")) from None
    return t, cfg


def run_foreign(ns: argparse.Namespace) -> int:
    fw = ns.framework
    data = read_foreign(fw, ns.config, ns.overrides)
    t, cfg = translate(fw, data, ns)
    plan = make_plan(cfg, t.layout)
    name = NAMES[fw]
    lines = [f"{name} on {t.layout.describe()}"]
    if t.checks:
        lines.append(f"  {name} would fail {len(t.checks)} check{'s' if len(t.checks) > 1 else ''} "
                     "(in the order it meets them):")
        lines += [f"  {i}. {c.text()}" for i, c in enumerate(t.checks, 1)]
    else:
        lines.append(f"  {name} would pass its batch checks on this layout")
    lines += [f"  note: {n}" for n in t.notes]
    from evenrl.planner.plan import minimal_yaml

    lines.append("equivalent evenrl config (keys that differ from the defaults; any batch runs on any ranks):")
    lines.append(minimal_yaml(cfg).rstrip())
    lines.append("its plan:")
    head = {"schema": "evenrl.foreign/1", "framework": fw, "file": ns.config, "layout": t.layout.to_dict(),
            "checks": [asdict(c) for c in t.checks], "notes": t.notes, "config": cfg.model_dump(mode="json")}
    return report(plan, as_json=ns.json, with_fit=ns.fit, title=f"evenrl plan --from {fw}: {ns.config}",
                  head=head, head_text="\n".join(lines))
