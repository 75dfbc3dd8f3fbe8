"""The rules of train.reproducibility=bitwise (docs/reproducibility.md): what it costs is said, and a resume that cannot
continue the same run bit for bit is named. What it cannot make bit-identical yet is refused before anything loads
by config.compatibility's rows (bitwise-*).

    evenrl plan CONFIG train.reproducibility=bitwise --nproc-per-node 3

Pure Python: never imports torch.
"""

from __future__ import annotations

from evenrl.core.canonical import prompt_batches
from evenrl.planner.types import Finding, Plan

# what a bitwise run records in its checkpoints (evenrl.train.checkpoint) and a resume compares
RECORDED = ("train.reproducibility", "parallel.sequence_parallel_size", "parallel.tensor_parallel_size",
            "parallel.expert_parallel_size")
_ROUNDING = "train.reproducibility=rounding"


def recorded(cfg) -> dict:
    """The settings of `cfg` a bitwise resume must find unchanged, by their dotted names."""
    return {"train.reproducibility": cfg.train.reproducibility,
            "parallel.sequence_parallel_size": cfg.parallel.sequence_parallel_size,
            "parallel.tensor_parallel_size": cfg.parallel.tensor_parallel_size,
            # the same bits at any EP measured for Qwen3-MoE and gpt-oss only (docs/reproducibility.md)
            "parallel.expert_parallel_size": cfg.parallel.expert_parallel_size}


def rule_reproducibility(p: Plan) -> list[Finding]:
    c = p.config
    if c.train.reproducibility != "bitwise":
        return []
    out = []
    units = max(p.layout.training_ranks, 1) // max(c.parallel.tensor_parallel_size, 1)
    if p.layout.rollout_devices:
        units = p.layout.rollout_devices
    batches = len(prompt_batches(c.data.prompts_per_step, c.rollout.batch_prompts))
    if batches < units:
        out.append(Finding("warning", "bitwise-idle-generation",
                           f"rollout.batch_prompts={c.rollout.batch_prompts} cuts the step's "
                           f"{c.data.prompts_per_step} prompts into {batches} generation batches for {units} "
                           f"generating ranks: {units - batches} of them generate nothing",
                           f"rollout.batch_prompts={max(1, c.data.prompts_per_step // units)}"))
    split = [f"parallel.{k}_parallel_size={n}" for k, n in (("tensor", c.parallel.tensor_parallel_size),
                                                             ("sequence", c.parallel.sequence_parallel_size)) if n > 1]
    where = (f"any number of data-parallel groups of {' and '.join(split)} (not an unsplit model's bits)" if split
             else "any number of processes")
    out.append(Finding("note", "bitwise", f"train.reproducibility=bitwise: the run is the same bits on {where}: "
                       "generation in batches of rollout.batch_prompts="
                       f"{c.rollout.batch_prompts} prompts, whole micro-batches of "
                       f"train.token_cap_per_micro_batch={c.train.token_cap_per_micro_batch} tokens dealt to ranks, "
                       "gradients summed in fixed point, one CPU thread per process; each step logs weights/hash "
                       "(evenrl report RUN OTHER_RUN finds the first step two runs differ)", ""))
    if p.resumed is not None:
        now = recorded(c)
        changed = [k for k in RECORDED if k in p.resumed and p.resumed[k] != now[k]]
        if changed:
            was = ", ".join(f"{k}={p.resumed[k]}" for k in changed)
            out.append(Finding("warning", "bitwise-resume", f"resuming a checkpoint written with {was}: the steps "
                               "from here are bit-identical on any layout, but not to the run that wrote it",
                               " ".join(f"{k}={p.resumed[k]}" for k in changed)))
    return out
