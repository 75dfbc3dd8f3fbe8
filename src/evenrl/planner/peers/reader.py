"""What every peer translator shares: reading the peer's file, typed reads of its keys, the result type, and
the mappings that are the same in every framework (lengths, sampling, KL, advantage, loss, model, data, steps).

The per-framework modules (verl, easyr1, trl, openrlhf) import this one; the package __init__ imports them to
build its table. Keeping the shared part here rather than in __init__ is what keeps that one-way: a framework
module that imported its own package would import the module that imports it.
OpenRLHF's command-line form (parse_flags) and its nested-flag aliases are read here too, because the reader
must recognise that form before any translator runs.
Never imports torch.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from evenrl.config import apply_overrides, parse_yaml, read_text_file, yaml_error_line
from evenrl.data import hub
from evenrl.errors import UsageError
from evenrl.planner.layout import Layout, apply_layout_flags, has_shape_flags, make_layout
from evenrl.planner.peers.launch import NAMES, Loaded, bare_tokens, from_script, parse_tokens
from evenrl.planner.peers.script import looks_like_script
from evenrl.planner.plan import count_rows

STAGES = {"config": "at config check (before anything loads)", "worker": "at worker start (before the model loads)",
          "deepspeed": "at DeepSpeed init (model loading)", "rollout": "at the first rollout (after the model loads)"}


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
    version: str = ""  # the peer version whose rules apply (peers.tables)
    keys: list[dict] = field(default_factory=list)  # every key of the file, accounted for (peers.tables.account)
    base: str = ""  # the base config the file's settings were layered on, as the file names it
    paths: dict[str, str] = field(default_factory=dict)  # model.path / data.path as the user gave them
    unused: dict[str, str] = field(default_factory=dict)  # peer key -> why its mapping does not apply here

    def set(self, key: str, value: Any, src: str) -> None:
        self.settings[key] = value
        self.source[key] = src


class Source:
    """Typed reads from the peer's config; a wrong type is a one-line UsageError naming the peer's key."""

    def __init__(self, framework: str, data: dict, launch=None):
        self.fw, self.data = framework, data if isinstance(data, dict) else {}
        self.reads: set[str] = set()  # every key a translator looked at: the accounting's "read"
        self.launch = launch  # peers.script.Launch of a launch script (its launcher's options), else None

    def raw(self, key: str, default: Any = None) -> Any:
        self.reads.add(key)
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

    def given(self, key: str) -> bool:
        """Whether the file sets `key`, without counting the key as read (the accounting's "read")."""
        seen = key in self.reads
        out = self.has(key)
        if not seen:
            self.reads.discard(key)
        return out

    def int(self, key: str, default: int | None, lo: int = 1) -> int | None:
        v = self.raw(key, default)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, str) and re.fullmatch(r"-?[0-9]+", v.strip()):
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

def read_foreign(framework: str, path: str, overrides: list[str]) -> Loaded:
    """The peer's YAML/JSON config, its argument file or its launch script (read, never run), with overrides."""
    p = Path(path)
    text = read_text_file(p, f"the {NAMES[framework]} config file", "a UTF-8 text file")
    error = None
    try:
        data = parse_yaml(text, str(p))  # bounded, as evenrl's own configs (evenrl.config.parse_yaml)
    except yaml.YAMLError as e:
        data, error = None, e
    if not isinstance(data, dict) and (looks_like_script(text) or re.search(r"(^|\s)--[A-Za-z]|^\s*[\w.+~]+=", text,
                                                                             re.M)):
        loaded = from_script(framework, NAMES[framework], p, text)
    elif error is not None:
        raise UsageError(f"{p}: invalid YAML/JSON{yaml_error_line(error)}; fix the syntax") from None
    elif data is None:
        raise UsageError(f"{p}: file is empty; expected the {NAMES[framework]} config")
    elif not isinstance(data, dict):
        raise UsageError(f"{p}: top level is a {type(data).__name__}; expected a mapping of "
                         f"{NAMES[framework]} settings or a launch script")
    else:
        loaded = Loaded(data)
    overrides = [o[2:] if o.startswith("++") else o[1:] if o.startswith("+") else o for o in overrides]
    for o in overrides:
        if o.startswith("~"):
            raise UsageError(f"override {o!r}: deleting keys is not supported; set the value instead")
    loaded.data = apply_overrides(loaded.data, overrides)
    return loaded


def parse_flags(text: str) -> dict:
    """`python -m openrlhf.cli.train_ppo_ray --a 1 --flag --b x` -> {"a": 1, "flag": True, "b": "x"}."""
    return parse_tokens(bare_tokens(text))


# ------------------------------------------------------------------------------------------ layouts

def gpu_layout(ns: argparse.Namespace, nnodes: int, per_node: int, rollout: int = 0) -> Layout:
    base = make_layout(nnodes, per_node, device="cuda", device_memory_gib=ns.device_memory_gib or 0.0,
                       rollout_devices=rollout, source="config")
    return apply_layout_flags(base, ns)


def split_layout(ns: argparse.Namespace, nodes: int, train_per_node: int, rollout: int) -> Layout:
    """Training ranks nodes x train_per_node plus `rollout` generation devices, as nodes x processes."""
    ns = argparse.Namespace(**{**vars(ns), "rollout_devices": None})  # `rollout` already is the flag's when given
    if rollout % nodes == 0:
        return gpu_layout(ns, nodes, train_per_node + rollout // nodes, rollout)
    return gpu_layout(ns, 1, nodes * train_per_node + rollout, rollout)


def nodes_layout(ns: argparse.Namespace, nodes: int, per: int, rollout: int) -> Layout:
    """nodes x per training ranks with `rollout` generation devices on nodes of their own where they fill whole
    nodes (TRL's `trl vllm-serve` node, slime's rollout GPUs), else spread over the training nodes."""
    if rollout and rollout % per == 0:
        return gpu_layout(argparse.Namespace(**{**vars(ns), "rollout_devices": None}), nodes + rollout // per, per,
                          rollout)
    return split_layout(ns, nodes, per, rollout)


def trainer_layout(src: Source, ns: argparse.Namespace) -> Layout:
    """verl and EasyR1 both size the cluster with trainer.nnodes x trainer.n_gpus_per_node; shape flags win."""
    if has_shape_flags(ns):
        return gpu_layout(ns, ns.nnodes or 1, ns.nproc_per_node or 1)
    return gpu_layout(ns, src.int("trainer.nnodes", 1), src.int("trainer.n_gpus_per_node", 8))


# ------------------------------------------------------------------------------------------ shared mapping

def set_lengths(t: Translation, prompt: int, new: int, pkey: str, nkey: str) -> None:
    t.set("data.max_prompt_tokens", prompt, pkey)
    t.set("rollout.max_new_tokens", new, nkey)


def set_kl(t: Translation, coef: float, where: str, key: str) -> None:
    """The KL term's size and place; its estimator is the tables' (peers/data: each peer's names, value by value)."""
    t.set("algo.kl_coef", coef, key)
    t.set("algo.kl_in", where, key)


def set_critic(t: Translation, *, path: str, policy_path: str, lr: float, value_clip: float, warmup: int,
               keys: tuple[str, str, str, str]) -> None:
    """The value model of PPO with GAE: its weights (the policy's unless another local directory), learning rate,
    value clip and warm-up steps; keys name the peer's (path, lr, clip, warm-up) settings."""
    path_key, lr_key, clip_key, warmup_key = keys
    if path and path != policy_path:
        if Path(path).expanduser().is_dir():
            t.set("critic.path", path, path_key)
        else:
            t.notes.append(f"{path_key}={path!r} is not a local directory; the plan's critic starts from the "
                           "policy's weights (critic.path='')")
    t.set("critic.lr", lr, lr_key)
    t.set("critic.value_clip", value_clip, clip_key)
    if warmup > 0:
        t.set("critic.warmup_steps", warmup, warmup_key)


def set_dynamic_sampling(t: Translation, rounds: int | None, key: str, rounds_key: str, how: str) -> None:
    """Dynamic sampling on, with at most `rounds` sampling rounds (None or 0: the peer's 'no limit', which evenrl
    bounds by its default); `how` says how the peer's filter differs, when it does."""
    t.set("algo.filter_groups", True, key)
    if rounds:
        t.set("algo.max_generation_rounds", min(rounds, 1000), rounds_key)
    else:
        t.notes.append(f"{rounds_key}: no limit on generation rounds has no evenrl equivalent; evenrl stops after "
                       "algo.max_generation_rounds=4 and trains on the groups it kept")
    if how:
        t.notes.append(how)


def set_overlong(t: Translation, buffer: int, penalty: float, keys: tuple[str, str]) -> None:
    t.set("rewards.overlong_buffer", buffer, keys[0])
    t.set("rewards.overlong_penalty", penalty, keys[1])


def set_reward_models(t: Translation, models: list[tuple[str, float]], key: str, others: list[dict] = ()) -> None:
    """rewards.functions from the peer's reward models ((path, weight) pairs) and any function entries it maps
    (`others`); a model that is not a local directory becomes a note (evenrl never downloads)."""
    entries = list(others)
    for path, weight in models:
        if path and Path(path).expanduser().is_dir():
            entries.append({"model": path, "weight": weight})
        elif path:
            t.notes.append(f"{key}={path!r} is not a local directory; download the reward model, then "
                           "rewards.functions=[{model: /local/dir}]")
    if entries:
        t.set("rewards.functions", entries, key)


def set_model(t: Translation, path: str, key: str) -> None:
    if path:
        t.paths["model.path"] = path
    if path and Path(path).expanduser().is_dir():
        t.set("model.path", path, key)
    elif path:
        t.notes.append(f"{key}={path!r} is not a local directory; set model.path to a local copy for the memory "
                       "estimate")
    t.settings["model.dtype"] = "bfloat16"  # the peers train in bf16; no key of theirs says so


def set_lora(src: Source, t: Translation, *, rank: str, alpha: str, targets: str, dropout: str | None = None,
             rank_default: int = 0, alpha_default: float = 16.0, dropout_default: float = 0.0) -> None:
    """LoRA from the peer's keys (a rank of 0: full fine-tuning). peft's "all-linear" and an absent target list
    become evenrl's default, every linear layer of the decoder blocks."""
    r = src.int(rank, rank_default, lo=0)
    if not r:
        return
    t.set("model.lora.rank", r, rank)
    t.set("model.lora.alpha", src.float(alpha, alpha_default), alpha)
    names = src.raw(targets)
    if isinstance(names, str):
        names = [] if names == "all-linear" else [n.strip() for n in names.strip("[]").split(",") if n.strip()]
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise UsageError(f"{src.fw} {targets}: got {names!r}; need a list of module names or 'all-linear'")
    t.set("model.lora.target_modules", names or [], targets)
    if dropout is not None:
        p = src.float(dropout, dropout_default)
        t.set("model.lora.dropout", p, dropout)
        if p > 0:
            t.notes.append(f"{dropout}={p:g}: dropout masks are drawn per rank, so the update depends on the layout; "
                           "model.lora.dropout=0 keeps it the same on any number of ranks")


def set_parallel(t: Translation, world: int, *, params: bool, optimizer: bool, shard: bool,
                 keys: tuple[str, str] = ("param offload", "optimizer offload")) -> None:
    """Sharding and offload. Any offload the peer asks for becomes FSDP2's one offload mode (parameters,
    gradients and optimizer state together: there is no optimizer-only one), which needs sharding=fsdp even on
    one rank; the translation runs on GPUs, where that offload runs."""
    offload = params or optimizer
    t.set("parallel.sharding", "fsdp" if offload or (shard and world > 1) else "replicated", "fsdp")
    t.set("parallel.cpu_offload", "full" if offload else "none", keys[0] if params else keys[1])
    if optimizer and not params:
        t.notes.append(f"{keys[1]} moves only the optimizer state to the host; evenrl's offload is FSDP2's, which "
                       "moves the sharded parameters, gradients and optimizer state together (it has no "
                       "optimizer-only mode), so the plan uses parallel.sharding=fsdp parallel.cpu_offload=full: "
                       "less device memory than the peer's, the AdamW step on the host")
    elif offload and not shard:
        t.notes.append(f"{keys[0]} on a model the peer does not fully shard becomes FSDP2's offload, which needs "
                       "sharding: the plan uses parallel.sharding=fsdp parallel.cpu_offload=full")


def set_data(t: Translation, path: str, key: str, prompt_field: str, answer_field: str | None = None,
             keys: tuple[str, str] = ("", ""), config: tuple[str, str] = ("", ""),
             split: tuple[str, str] = ("", "")) -> None:
    """data.path from the peer's data: a local file or directory, or a Hugging Face dataset (EasyR1's and verl's
    NAME@SPLIT; TRL's and OpenRLHF's name with their config and split keys, each `(peer key, value)`), written as
    evenrl reads it: ORG/NAME[:CONFIG][@SPLIT] (evenrl.data.hub). Set where the plan can read it (a local path, a
    dataset in this machine's datasets cache); else a note says why, and --write-config writes it all the same.
    keys name the peer's prompt and answer column keys."""
    ds, src = hub.parse(path), key
    if ds is not None:
        ds = hub.HubDataset(ds.repo, config[1] or ds.config, split[1] or ds.split)
        src = " ".join([key] + [k for k, v in (config, split) if v])
        where = str(ds)
        try:
            here = hub.is_cached(ds, key)
        except UsageError:  # several configurations cached and none named, or no datasets library: the plan says
            here = False
    else:
        where = path.split("@")[0] if path else ""  # EasyR1's LOCAL@SPLIT: evenrl reads the local file whole
        here = bool(where) and Path(where).expanduser().exists()
    if where:
        t.paths["data.path"] = where
    if here:
        t.set("data.path", where, src)
    elif ds is not None:
        t.notes.append(f"{src}={path!r}: the Hugging Face dataset {where}, not in this machine's datasets cache "
                       f"({hub.where()}), so the plan cannot read its rows; `evenrl train` downloads it")
    elif path:
        t.notes.append(f"{key}={path!r} is not a local file or directory; set data.path to a local copy")
    t.set("data.prompt_field", prompt_field, keys[0] or key)
    if answer_field:
        t.set("data.answer_field", answer_field, keys[1] or key)


def set_steps(src: Source, t: Translation, steps_key: str, epochs_key: str, epochs_default: int, prompts: int,
              fractional: bool = False) -> None:
    """train.steps from the peer's step count, else its epochs over the local dataset's rows (steps per epoch:
    rows // prompts per step); with neither, a note says the plan's step count is evenrl's default, not the
    peer's. fractional: the peer takes a share of an epoch (TRL's num_train_epochs=0.1, as transformers' Trainer
    does): epochs x steps per epoch, rounded up as the Trainer rounds its max_steps (math.ceil), computed on the
    decimal the file wrote so that 0.1 x 30 is 3, not 4."""
    steps = src.int(steps_key, None) if steps_key else None
    if steps:
        t.set("train.steps", steps, steps_key)
        return
    rows = count_rows(t.settings.get("data.path", ""))
    epochs = _epochs(src, epochs_key, epochs_default) if fractional else src.int(epochs_key, epochs_default)
    if rows:
        per_epoch = max(1, rows // prompts)
        exact = Fraction(str(epochs)) * per_epoch
        total = max(1, math.ceil(exact))
        t.set("train.steps", total, epochs_key)
        if total != exact:
            t.notes.append(f"{epochs_key}={epochs:g}: {epochs:g} x {per_epoch} steps an epoch ({rows} rows, "
                           f"{prompts} prompts a step) = {float(exact):g}, rounded up as transformers' Trainer "
                           f"rounds its steps: train.steps={total}")
    elif src.has(epochs_key):
        t.notes.append(f"{epochs_key}={epochs:g}: the dataset is not here, so its steps per epoch are unknown; the plan "
                       "takes evenrl's train.steps=100 (set train.steps=N for the run's length)")


def _epochs(src: Source, key: str, default: int) -> int | float:
    """A number of epochs that may be a share of one (> 0, at most 10^6); a whole number stays an int."""
    value = src.float(key, default)
    if not 0 < value <= 10**6:
        raise UsageError(f"{src.fw} {key}: got {src.raw(key, default)!r}; need a number of epochs in (0, 10^6]")
    return int(value) if value.is_integer() else value


def check_dataloader(src: Source, t: Translation, key: str, prompts: int, error: str, message: str) -> None:
    rows = count_rows(src.str(key))
    if rows is not None and rows < prompts:
        t.checks.append(Check("config", error, message or "(bare assert len(self.train_dataloader) >= 1)",
                              f"{rows} rows with drop_last=True make no batch of {prompts} prompts"))
