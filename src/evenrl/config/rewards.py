"""The `rewards` section: reward functions, reward models and LLM judges (RewardSpec, JudgeSpec) and the limits and
policies their calls run under. Pure Python."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from evenrl.config.section import MAX_TOKENS, Section

class JudgeSpec(Section):
    model: str = Field("", description="Local Hugging Face causal LM directory (or hub id, as model.path) of the "
                                        "judge; empty: the policy's "
                                        "base (model.path as it was loaded, frozen; not the policy being trained).")
    template: str = Field(
        ..., min_length=1, max_length=20_000,
        description="The judge's prompt. {question} becomes the dataset row's prompt, {completion} the policy's "
                    "completion (required), {answer} the row's reference answer; no other text is replaced.")
    parser: str = Field(
        "last_number", description="How the judge's output becomes a score: last_number, first_number, yes_no "
                                   "(yes 1, no 0: the first of the two words), or a user function "
                                   "'package.module:function' taking (judge_output, sample) as a reward does. An "
                                   "output it cannot read is a failed reward call (rewards.on_failure).")
    max_new_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description="Most tokens the judge generates per sample.")
    temperature: float = Field(0.0, ge=0.0, le=100.0,
                               description="The judge's sampling temperature; 0 is greedy. Its samples are keyed "
                                           "like the policy's (step, sample), so any layout gets the same verdicts.")
    use_chat_template: bool = Field(
        True, description="Wrap the judge prompt as one user turn with the judge tokenizer's chat template (when "
                          "it has one).")

    @field_validator("template")
    @classmethod
    def _has_completion(cls, value: str) -> str:
        if "{completion}" not in value:
            raise PydanticCustomError("judge_template", "the template must hold {completion}, where the policy's "
                                                        "completion goes")
        return value


class RewardSpec(Section):
    name: str = Field("", description="Built-in reward (math, format, countdown, knights_knaves, exact_match) "
                                      "or a user function 'package.module:function'.")
    model: str = Field("", description="Local Hugging Face reward model directory (or hub id, as model.path): a "
                                       "sequence-classification "
                                       "model with one label (AutoModelForSequenceClassification), scoring "
                                       "(prompt, completion) as its tokenizer's chat template renders them "
                                       "(prompt + completion without one). Frozen, in model.dtype, on the "
                                       "training ranks (sharded like the policy under parallel.sharding=fsdp).")
    judge: JudgeSpec | None = Field(None, description="An LLM judge: a causal LM prompted with `template`, run by "
                                                      "rollout.engine; its output read by `parser`.")
    weight: float = Field(1.0, description="Weight of this reward in the summed score.")

    @model_serializer(mode="wrap")
    def _as_written(self, handler):
        """The entry as one writes it: its kind and its weight, not the other kinds' empty values."""
        return {k: v for k, v in handler(self).items() if k == "weight" or v}

    @model_validator(mode="after")
    def _one_kind(self):
        given = [k for k in ("name", "model", "judge") if getattr(self, k)]
        if len(given) != 1:
            raise PydanticCustomError("reward_kind", "each entry has one of name (a reward function), model (a "
                                                     "reward model directory) or judge (a judge section); got "
                                                     "{got}", {"got": " and ".join(given) or "none of them"})
        return self


class RewardsConfig(Section):
    functions: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="exact_match")],
        description="Rewards summed with their weights, each entry one of: a function {name: ...}, a reward model "
                    "{model: PATH} or an LLM judge {judge: {template: ..., ...}} (docs/reward-models.md). Not used "
                    "with rollout.env: the environment scores its trajectories (under the limits below).")
    timeout_s: float = Field(
        60.0, gt=0.0, le=3600.0,
        description="Wall-clock backstop of one reward call (with rollout.env: one environment step): it stops code "
                    "that waits without using CPU (a sleep, a lock, a socket). A call past it fails as a timeout "
                    "(scored per on_failure; a step ends its trajectory as failed), counted in "
                    "limits/wall_clock_backstop and warned about: where it fires depends on how busy the machine "
                    "is, so keep it well above what calls take on a loaded machine; cpu_time_limit_s is the limit "
                    "meant to decide. With isolate=false the only limit.")
    isolate: bool = Field(
        True, description="Score in worker processes without network, so a reward that crashes or hangs cannot "
                          "take the trainer down (costs ~5-10 ms a step on CPU); false scores in the trainer process, "
                          "as TRL does, with the same time limit (a timer signal) but no memory or CPU-time cap and "
                          "the trainer's network: for cheap, trusted reward functions.")
    sandbox: Literal["tools", "all", "none"] = Field(
        "tools",
        description="tools: code the model writes (the python tool) runs in a sandbox (its own unprivileged user, "
                    "PID, mount and network namespaces, a read-only system and a private /tmp, rlimits, Landlock "
                    "and a seccomp filter where the machine has them; docs/sandbox.md); a run that offers the tool on a machine that cannot make one stops at start "
                    "with the reason. all: reward and environment workers run in it too (needs isolate; they see "
                    "the directories on the trainer's Python path read-only and nothing else of its files). none: "
                    "model-written code runs unsandboxed (rlimits and the time limit only), logged at every step: "
                    "only on a machine where namespaces cannot be had, knowingly.")
    memory_limit_mib: int = Field(
        2048, ge=0, le=1024**2,
        description="Memory cap of each reward worker process, in MiB (RLIMIT_DATA: its heap and private memory); "
                    "a call that allocates past it fails. 0: no cap. Not applied with isolate=false: it would cap "
                    "the trainer itself.")
    cpu_time_limit_s: float = Field(
        5.0, gt=0.0, le=3600.0,
        description="CPU seconds one reward call (or environment step) may use in a worker, all its threads "
                    "together; past it the call fails (kind cpu). The limit that decides a call's fate: code that "
                    "does the same work uses the same CPU time on an idle or a loaded machine (timeout_s is only "
                    "the wall-clock backstop). Not applied with isolate=false (the trainer's other threads would "
                    "count).")
    on_failure: Literal["zero", "mask"] = Field(
        "zero", description="A sample whose reward call failed (raised, non-number, timeout, memory, CPU): 'zero' "
                            "scores it 0 and trains on it; 'mask' leaves it out of learning (no advantage, not in "
                            "its group's statistics, nor in the loss denominators).")
    warn_failed_share: float = Field(
        0.1, ge=0.0, le=1.0,
        description="Warn after every step in which one entry of functions failed on more than this share of the "
                    "step's samples, naming the entry and its first error (every entry's failed calls are in the "
                    "metrics as reward/failures/NAME). 0: on any failure; 1: never.")
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

    @model_validator(mode="after")
    def _sandbox_all_needs_workers(self):
        if self.sandbox == "all" and not self.isolate:
            raise PydanticCustomError("sandbox_isolate", "sandbox 'all' runs the reward and environment workers in "
                                                         "the sandbox, and isolate: false has none; set isolate: "
                                                         "true or sandbox: tools")
        return self
