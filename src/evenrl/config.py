"""The run configuration: typed, described, loaded from one YAML file plus dotted overrides.

    evenrl plan examples/demo.yaml data.prompts_per_step=512 rollout.samples_per_prompt=8

Names say what they count (prompts per step, samples per prompt, tokens per micro-batch); there is no
overloaded "batch size". Numbers derived from these (samples per step, per-rank rows, micro-steps) live in
`evenrl.plan.Plan` and are never written back here. Pure Python: must not import torch (the planner uses it).
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evenrl.errors import UsageError

# Caps that catch typos (10**12 prompts) before any arithmetic is attempted.
MAX_COUNT = 10_000_000
MAX_TOKENS = 10_000_000


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


class ModelConfig(_Section):
    path: str = Field("", description="Local Hugging Face model directory (holds config.json). Never downloaded.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter and compute dtype of the trained model.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, ~30% more compute.")
    use_chat_template: bool = Field(
        False, description="Wrap each prompt with the tokenizer's chat template (when it has one).")


class DataConfig(_Section):
    path: str = Field("", description="Prompt dataset: a .jsonl or .parquet file, or a local HF dataset directory.")
    prompt_field: str = Field("prompt", description="Column holding the prompt text.")
    answer_field: str = Field("answer", description="Column holding the reference answer given to rewards.")
    extra_fields: list[str] = Field(
        default_factory=list, description="More columns passed through to reward functions (e.g. numbers, target).")
    prompts_per_step: int = Field(
        16, ge=1, le=MAX_COUNT, description="Distinct prompts sampled per RL step (before samples_per_prompt).")
    max_prompt_tokens: int = Field(
        256, ge=1, le=MAX_TOKENS, description="Prompts longer than this are skipped and counted, never truncated.")
    seed: int = Field(0, description="Seed of the prompt order; the order does not depend on the number of ranks.")


class RolloutConfig(_Section):
    samples_per_prompt: int = Field(
        8, ge=1, le=MAX_COUNT, description="Completions sampled per prompt (a GRPO group).")
    max_new_tokens: int = Field(64, ge=1, le=MAX_TOKENS, description="Generation stops after this many tokens.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    engine: Literal["hf"] = Field(
        "hf", description="Rollout engine. 'hf': evenrl's KV-cached sampler on the training model (CPU and GPU).")
    memory_fraction: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="Share of device memory reserved for a separate rollout engine's KV cache (0 for 'hf').")


class RewardSpec(_Section):
    name: str = Field(..., description="Built-in reward (math, format, countdown, knights_knaves, exact_match) "
                                       "or a user function 'package.module:function'.")
    weight: float = Field(1.0, description="Weight of this reward in the summed score.")


class AlgoConfig(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"] = Field(
        "grpo", description="Advantage estimator over each prompt's group of samples.")
    std_scale: Literal["group", "batch", "none"] = Field(
        "group", description="GRPO: divide centred rewards by the group std, the batch std, or nothing.")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="How per-token losses become one number; normalised by global counts.")
    minibatches_per_step: int = Field(
        1, ge=1, le=MAX_COUNT, description="Optimizer steps per rollout: the step's samples are split into this many.")
    epochs_per_step: int = Field(1, ge=1, le=1000, description="Passes over the step's samples (PPO epochs).")
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO ratio clip below 1 (1 - clip_low).")
    clip_high: float = Field(0.2, ge=0.0, le=10.0, description="PPO ratio clip above 1 (1 + clip_high); 0.28 = DAPO clip-higher.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL to the frozen reference model; 0 loads no reference.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (k3: low-variance, always >= 0).")
    kl_in: Literal["loss", "reward"] = Field("loss", description="Apply KL as a loss term or as a reward penalty.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight (0: off).")


class RewardsConfig(_Section):
    functions: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="exact_match")],
        description="Reward functions summed with their weights.")
    timeout_s: float = Field(5.0, gt=0.0, le=3600.0,
                             description="A reward call slower than this scores 0 and is counted.")
    isolate: bool = Field(
        True, description="Score in worker processes, so a reward that crashes or hangs cannot take the trainer "
                          "down (costs ~5-10 ms a step on CPU); false scores in the trainer process, as TRL does, "
                          "with the same time limit (a timer signal) but no memory or CPU-time cap: for cheap, "
                          "trusted reward functions.")
    memory_limit_mib: int = Field(
        2048, ge=0, le=1024**2,
        description="Memory cap of each reward worker process, in MiB (RLIMIT_DATA: its heap and private memory); "
                    "a call that allocates past it fails. 0: no cap. Not applied with isolate=false: it would cap "
                    "the trainer itself.")
    cpu_time_limit_s: float | None = Field(
        None, gt=0.0, le=3600.0,
        description="CPU seconds one reward call may use in a worker (all its threads together); past it the call "
                    "fails. null: the same as timeout_s. Not applied with isolate=false (the trainer's other "
                    "threads would count).")

class TrainConfig(_Section):
    steps: int = Field(100, ge=0, le=MAX_COUNT, description="RL steps (rollout + updates) to run.")
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    max_grad_norm: float = Field(1.0, ge=0.0, description="Global gradient-norm clip; 0 disables.")
    token_cap_per_micro_batch: int = Field(
        4096, ge=1, le=MAX_TOKENS,
        description="Most padded tokens (rows x longest row) in one forward/backward; bounds activation memory.")
    min_rows_per_micro_batch: int = Field(
        1, ge=1, le=1024, description="Smallest non-empty micro-batch (2 for models with BatchNorm in training mode).")
    skip_zero_gradient_samples: bool = Field(
        True, description="Skip the forward/backward of samples whose loss gradient is exactly zero (advantage 0, "
                          "e.g. a group whose rewards are all equal, with no KL-in-loss or entropy term); they still "
                          "count in the loss denominators, so the update is unchanged. Off when min_rows > 1.")
    seed: int = Field(0, description="Seed for sampling and initialisation.")


class ParallelConfig(_Section):
    sharding: Literal["replicated", "fsdp"] = Field(
        "replicated", description="Parameters and optimizer state on every rank, or sharded (FSDP2). "
                                  "evenrl train runs 'replicated' today; 'fsdp' is planned (evenrl plan estimates it).")
    cpu_offload: Literal["none", "optimizer", "full"] = Field(
        "none", description="Keep optimizer state (or parameters and gradients too) in host memory. "
                            "evenrl train runs 'none' today; offload is planned (evenrl plan estimates it).")
    capacity_weights: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(
        None, description="Relative speed of each training rank (mixed GPU models); rank i gets work ~ weight i.")


class CheckpointConfig(_Section):
    every_steps: int = Field(0, ge=0, description="Save every this many steps (0: only at the end).")
    keep: int = Field(2, ge=1, description="Most recent checkpoints kept.")


class LogConfig(_Section):
    run_dir: str = Field("runs/run", description="Directory for config, plan, metrics, checkpoints and plots.")
    samples_every_steps: int = Field(10, ge=0, description="Log a few completions every this many steps (0: never).")
    tensorboard: bool = Field(True, description="Also write TensorBoard event files.")
    progress: bool = Field(True, description="Show a progress bar on rank 0.")


class EvalConfig(_Section):
    path: str = Field("", description="Held-out prompts (same format and fields as data.path) scored with greedy "
                                      "decoding; empty: no evaluation.")
    every_steps: int = Field(0, ge=0, description="Evaluate every this many steps, besides before the first and after "
                                                  "the last (0: only those two).")
    max_prompts: int = Field(256, ge=1, le=MAX_COUNT, description="Evaluate on the first this many prompts.")


class SftConfig(_Section):
    steps: int = Field(200, ge=0, le=MAX_COUNT, description="Supervised optimizer steps.")
    rows_per_step: int = Field(32, ge=1, le=MAX_COUNT, description="Prompt/answer rows per optimizer step.")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="AdamW learning rate for the warm start.")


class RunConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling.")
    rewards: RewardsConfig = Field(default_factory=RewardsConfig, description="Reward functions.")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="Advantages and losses.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation and micro-batching.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Sharding and offload.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Greedy evaluation on held-out prompts.")
    log: LogConfig = Field(default_factory=LogConfig, description="Run directory and logging.")
    sft: SftConfig = Field(default_factory=SftConfig, description="Supervised warm start (evenrl sft).")

    def samples_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.samples_per_prompt


# ---------------------------------------------------------------------------------------------- loading

def _parse_value(text: str) -> Any:
    """Override values are YAML scalars/lists: `8`, `1e-6`, `true`, `[1, 2]`, `null`, `my text`."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides to a nested dict (a copy). Unknown keys are caught by validation."""
    out = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise UsageError(f"override {item!r}: expected key=value, e.g. data.prompts_per_step=64")
        key, _, raw = item.partition("=")
        if not all(key.strip().split(".")):
            raise UsageError(f"override {item!r}: empty key segment; expected e.g. rollout.samples_per_prompt=8")
        set_dotted(out, key.strip(), _parse_value(raw), what=f"override {key}")
    return out


def set_dotted(data: dict, key: str, value: Any, *, what: str = "") -> None:
    """data["a"]["b"]["c"] = value for key "a.b.c", in place; missing sections are created (validation catches
    unknown keys). A value where a section should be is a UsageError, named by `what` (default: the key)."""
    *path, last = key.split(".")
    node = data
    for part in path:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise UsageError(f"{what or key}: {part} is a value, not a section")
        node = nxt
    node[last] = value


def with_settings(cfg: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """A validated copy of cfg with dotted settings ({"data.prompts_per_step": 64}) applied; cfg is unchanged."""
    data = cfg.model_dump()
    for key, value in settings.items():
        set_dotted(data, key, value)
    return RunConfig.model_validate(data)


def flatten(data: dict, prefix: str = "", sep: str = ".") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested sections to joined keys, leaves (lists included) as they are."""
    out = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}{sep}", sep))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def read_text_file(path: str | os.PathLike, what: str, utf8_what: str) -> str:
    """A UTF-8 text file's contents; a missing file, a directory or unreadable bytes is a one-line UsageError
    naming the file and `what` was expected there."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such file; give {what}")
    if p.is_dir():
        raise UsageError(f"{p}: is a directory; give {what}")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{p}: cannot read ({e.__class__.__name__}); give {utf8_what}") from None


def read_yaml(path: str | os.PathLike) -> dict:
    """Read a YAML mapping with safe_load; every failure is a one-line UsageError naming the file."""
    p = Path(path)
    text = read_text_file(p, "a YAML config file", "a UTF-8 YAML file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{p}: invalid YAML{where}; fix the syntax") from None
    if data is None:
        raise UsageError(f"{p}: file is empty; expected a mapping of sections (model, data, rollout, ...)")
    if not isinstance(data, dict):
        raise UsageError(f"{p}: top level is a {type(data).__name__}; expected a mapping of sections")
    return data


def validation_message(err: ValidationError, source: str = "config") -> str:
    """Turn pydantic's multi-line report into one line: field, value, what is allowed (+ how many more)."""
    errors = err.errors()
    first = errors[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        msg = f"{loc}: unknown key; allowed here: {', '.join(_allowed_keys(first['loc']))}"
    else:
        shown = repr(first.get("input"))
        if len(shown) > 60:
            shown = shown[:57] + "..."
        msg = f"{loc}: got {shown}; {first['msg'].lower()}"
    more = len(errors) - 1
    if more:
        msg += f" (and {more} more problem{'s' if more > 1 else ''})"
    return f"{source}: {msg}"


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys of the section an unknown key sits in; list items (`functions.0`) step into the item type."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if typing.get_origin(ann) is list:
            ann = typing.get_args(ann)[0]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            break
    return sorted(model.model_fields)


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a RunConfig from a YAML file (or defaults when path is None) plus dotted overrides."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UsageError(validation_message(e, str(path) if path else "config")) from None


def config_to_yaml(cfg: RunConfig) -> str:
    """The resolved config, as dumped into every run directory."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def describe(model: type[BaseModel] = RunConfig, indent: int = 0) -> str:
    """Every field with its default and description, as commented YAML (docs/config.md is this output)."""
    lines = []
    pad = "  " * indent
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.append(f"{pad}{name}:  # {field.description}")
            lines.append(describe(ann, indent + 1))
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        if isinstance(default, list):
            default = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
        value = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"{pad}{name}: {value}  # {field.description}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m evenrl.config  -> the annotated default config
    print(describe())
