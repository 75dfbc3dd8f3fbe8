"""Which training ranks sample together, in lockstep, and what that rules out: the one statement of these rules,
read by the planner (`evenrl plan`, planner.model_parallel) and at run time before anything loads
(train.trainer, train.rollout_rank), so the two cannot disagree. Torch-free.

Colocated ranks sample in lockstep in two cases: the hf engine on a tensor-parallel model (parallel.
tensor_parallel_size = T: the T ranks of a tp group sample from their split model together, every decoding step
a collective) and a vLLM engine over several devices (rollout.tensor_parallel_size = N: the N trainers of an engine
group are its workers and every call runs on all of them). On reserved rollout devices neither holds: each rollout
rank samples from its own whole copy, or leads an engine over its group's devices alone.

    problems(cfg, reserved=False, vision=False) -> [(rule, message, fix), ...]    # empty: it can run
"""

from __future__ import annotations

from evenrl.config import RunConfig
from evenrl.errors import UsageError


def lockstep_setting(cfg: RunConfig, reserved: bool) -> str:
    """The setting that makes colocated ranks sample in lockstep ('' when none does)."""
    if reserved:
        return ""
    if cfg.rollout.engine == "vllm" and cfg.rollout.tensor_parallel_size > 1:
        return f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size}"
    if cfg.rollout.engine == "hf" and cfg.parallel.tensor_parallel_size > 1:
        return f"parallel.tensor_parallel_size={cfg.parallel.tensor_parallel_size}"
    return ""


def problems(cfg: RunConfig, *, reserved: bool, vision: bool) -> list[tuple[str, str, str]]:
    """(rule, one-line message, fix) for each way `cfg` asks ranks that sample together for what they cannot do.
    reserved: rollout devices are reserved (parallel.rollout_devices > 0); vision: the model is a vision-language
    model."""
    r, t, key = cfg.rollout, cfg.parallel.tensor_parallel_size, "rollout.tensor_parallel_size"
    out = []
    if r.engine == "hf" and r.tensor_parallel_size > 1 and (reserved or r.tensor_parallel_size != t):
        why = ("a reserved rollout rank samples from a whole copy of its own" if reserved else
               f"it samples from the trained model itself, split over parallel.tensor_parallel_size={t} ranks")
        fix = f"{key}=1" if reserved or t == 1 else f"{key}={t} (or 1: the same)"
        out.append(("tensor-parallel-engine",
                    f"{key}={r.tensor_parallel_size} with rollout.engine=hf: the hf engine's tensor parallelism is "
                    f"the trainer's ({why})", f"{fix}; or rollout.engine=vllm"))
    setting = lockstep_setting(cfg, reserved)
    if setting and r.agent:
        out.append(("tensor-parallel-agents",
                    f"rollout.agent with {setting}: the ranks that sample together call their engine in lockstep, "
                    "and agents' calls are served as they arrive, differently on every rank",
                    f"--rollout-devices R (agents served on reserved rollout devices); or {setting.split('=')[0]}=1"))
    if r.engine == "vllm" and r.tensor_parallel_size > 1 and vision:
        out.append(("tensor-parallel-vision",
                    f"{key}={r.tensor_parallel_size} with a vision-language model: a vLLM engine over several devices "
                    "has not run one anywhere (vLLM's CPU build cannot run Qwen2-VL without torchvision, and this "
                    "project has no machine with several GPUs)", f"{key}=1"))
    return out


def refuse(cfg: RunConfig, *, reserved: bool, vision: bool) -> None:
    """The first problem as one line (UsageError); `evenrl plan` names them all first."""
    found = problems(cfg, reserved=reserved, vision=vision)
    if found:
        _, message, fix = found[0]
        raise UsageError(f"{message}; fix: {fix}")
