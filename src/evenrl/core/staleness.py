"""Which policy samples which step when generation runs ahead of training (rollout.max_staleness = k).

A policy's version is the number of RL steps it has been trained for: version 0 is the initial model, version v the
weights after step v. Step t samples from version max(0, t - 1 - k): k = 0 is the synchronous step (the policy
that is being updated sampled its data); with k >= 1 the reserved rollout ranks can make steps t+1 .. t+k while
step t trains. The version is a function of the step alone, never of timing, so a run samples the same data
however fast each side is, and a run resumed from a checkpoint regenerates the steps that were in flight with the
versions they were meant to use (a checkpoint keeps those versions: `versions_needed`).

Pushes: the rollout ranks get a version when the first step that needs it comes up (`push_steps`). The trainers
send the version for step u at the start of step u - k, right after it exists (`pushes_at`), except at the start
of a run or a resume, when every step up to start + 1 + k is sent at once.
"""

from __future__ import annotations


def policy_version(step: int, max_staleness: int) -> int:
    """The version that samples `step` (1-based): the weights after step max(0, step - 1 - k)."""
    return max(0, step - 1 - max_staleness)


def push_steps(start: int, steps: int, max_staleness: int) -> list[int]:
    """The steps in start+1 .. steps before whose generation the rollout ranks load new weights: the first one,
    and each whose version differs from the step before."""
    return [u for u in range(start + 1, steps + 1)
            if u == start + 1 or policy_version(u, max_staleness) != policy_version(u - 1, max_staleness)]


def pushes_at(step: int, start: int, steps: int, max_staleness: int) -> list[int]:
    """The steps whose weights the trainers push at the start of `step` of a run that started (or resumed) after
    `start`, in order. Each push's version is policy_version of the step; it is the trainers' current weights
    (version step - 1) or, right after a resume, an earlier version kept by the checkpoint."""
    due = push_steps(start, steps, max_staleness)
    if step == start + 1:
        return [u for u in due if u <= step + max_staleness]
    return [u for u in due if u == step + max_staleness]


def versions_needed(checkpoint_step: int, max_staleness: int) -> list[int]:
    """Versions other than its own that a run resumed from the checkpoint after `checkpoint_step` must push (the
    steps checkpoint_step+1 .. checkpoint_step+k sample from them), ascending."""
    return sorted({policy_version(u, max_staleness)
                   for u in range(checkpoint_step + 1, checkpoint_step + max_staleness + 1)} - {checkpoint_step})
