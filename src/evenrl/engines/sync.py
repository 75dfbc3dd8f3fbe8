"""How the trainer's weights reach the engines that sample: the one seam between training and generation.

    sync = make_weight_sync(cfg, engine=..., payload=..., ckpt_root=...)    # None: nothing to move (hf colocated)
    sync.begin(start, found)          # once, where the run starts (after step `start`, from checkpoint `found`)
    sync.before_rollout(step)         # trainers, at the start of every step
    sync.weights_for(step)            # a reserved rollout rank, before generating `step`
    sync.keep(checkpoint_dir, step)   # rank 0, while checkpoint `step` is written: the versions it must carry
    sync.finish()                     # every rank, after the last step

`payload()` yields what is sent, as buckets of (name, whole tensor): the full model (evenrl.distributed.weights.
full_weights, a collective under sharding, so every trainer calls it) or whatever a mode with less to send
provides. The receiving engine loads them with `Engine.update_weights` (its own loader: vLLM's `reload_weights`, in
this process or through files for a child process; the hf engine copies them into its model).

Implementations, by placement:
  Colocated   every training rank generates with its own engine: an engine that keeps its own copy of the weights
              (vLLM) gets the current ones before each rollout.
  Broadcast   reserved rollout ranks (--rollout-devices R): trainer 0 broadcasts each policy version over the push
              group (gloo on CPU, NCCL on GPU) when the schedule of evenrl.core.staleness says; a rollout rank
              receives it on a thread and loads it before the first step that samples from it. With
              rollout.max_staleness k >= 1 the push goes from a host copy in the background, and the versions
              the next k steps sample from are kept on disk (engines.versions) for the checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Protocol

import torch

from evenrl.config import RunConfig
from evenrl.core.staleness import policy_version, push_steps, pushes_at, versions_needed
from evenrl.distributed import collectives as dist
from evenrl.engines.base import Engine
from evenrl.engines.versions import VersionStore, read_version

Payload = Callable[[], Iterable[list[tuple[str, torch.Tensor]]]]


class WeightSync(Protocol):
    def begin(self, start: int, found: Path | None) -> None:
        """Where the run starts: after step `start`, resumed from checkpoint `found` (None: from the beginning)."""

    def before_rollout(self, step: int) -> None:
        """A training rank, at the start of `step`: send what is due (every trainer calls it: a collective)."""

    def weights_for(self, step: int) -> None:
        """A reserved rollout rank, before generating `step`: load the version that samples it."""

    def keep(self, checkpoint_dir: Path, step: int) -> list[int]:
        """Rank 0, writing checkpoint `step` into `checkpoint_dir`: put the policy versions it must carry there;
        returns them."""

    def finish(self) -> None:
        """After the last step: nothing left in flight."""


def make_weight_sync(cfg: RunConfig, *, engine: Engine | None, payload: Payload,
                     ckpt_root: str | os.PathLike) -> WeightSync | None:
    """The sync for this rank's placement, or None where no weights move (the hf engine on the training ranks
    samples from the trained parameters themselves). `engine`: this rank's (None on a trainer when rollout ranks
    are reserved)."""
    if dist.rollout_ranks():
        return Broadcast(cfg, engine=engine, payload=payload, ckpt_root=ckpt_root)
    if engine.needs_weights:
        return Colocated(engine, payload)
    return None


class Colocated:
    def __init__(self, engine: Engine, payload: Payload):
        self.engine, self.payload = engine, payload

    def begin(self, start: int, found: Path | None) -> None:
        return None

    def before_rollout(self, step: int) -> None:
        self.engine.wake()
        self.engine.update_weights(self.payload())

    def weights_for(self, step: int) -> None:
        raise RuntimeError("weights_for: colocated engines sample on the training ranks, not on rollout ranks")

    def keep(self, checkpoint_dir: Path, step: int) -> list[int]:
        return []

    def finish(self) -> None:
        return None


class Broadcast:
    """Both ends of the push to reserved rollout ranks. The version each step samples from is fixed by the step
    (policy_version: the weights after step t-1-k), never by timing, so the samples and a resumed run do not depend on
    how fast either side is."""

    def __init__(self, cfg: RunConfig, *, engine: Engine | None, payload: Payload, ckpt_root: str | os.PathLike):
        self.k, self.steps, self.every = cfg.rollout.max_staleness, cfg.train.steps, cfg.checkpoint.every_steps
        self.engine, self.payload = engine, payload
        self.store = VersionStore(ckpt_root)
        self.rollout_side = dist.is_rollout_rank()
        # generating ahead, nobody waits for a push: trainer 0 sends from a host copy in the background
        self.sender = dist.WeightSender() if dist.is_main() and self.k > 0 else None
        self.receiver: dist.WeightReceiver | None = None
        self.start, self.resumed_from, self.to_keep, self.due = 0, None, set(), set()

    def begin(self, start: int, found: Path | None) -> None:
        """Trainers: which pushed versions the checkpoints to come must carry. A rollout rank: the pushes it will get,
        received from now on in the background (the layout is that of its own copy's payload)."""
        self.start, self.resumed_from = start, found
        if self.rollout_side:
            self.due = set(push_steps(start, self.steps, self.k))
            layout = [[(name, t.shape, t.dtype) for name, t in bucket] for bucket in self.payload()]
            self.receiver = dist.WeightReceiver(layout, len(self.due))
            return
        saves = [c for c in range(start + 1, self.steps + 1) if (self.every and c % self.every == 0) or c == self.steps]
        self.to_keep = {v for c in saves for v in versions_needed(c, self.k)}

    def before_rollout(self, step: int) -> None:
        """Trainer 0 broadcasts the versions due at this step (core.staleness.pushes_at): the current weights, which
        sample step + k, and right after a resume the earlier versions the checkpoint kept for the steps that were
        in flight. Other trainers take part in the payload's gathers only. A pushed version that a later checkpoint
        must carry is also written to disk as it goes out."""
        pushed = [policy_version(u, self.k) for u in pushes_at(step, self.start, self.steps, self.k)]
        # a version due after the last step is not sent, but a checkpoint may still need it (a longer run resumes)
        kept_only = [step - 1] if step - 1 in self.to_keep and step - 1 not in pushed else []
        for version in pushed + kept_only:
            if version == step - 1:
                buckets = self.payload()  # a collective on a sharded model
            elif dist.is_main():
                buckets = read_version(self.resumed_from, version)
            else:
                continue
            if version in pushed:  # running ahead: sent in the background, from a copy (WeightSender)
                buckets = self.sender.send(buckets) if self.sender is not None else dist.push_weights(buckets)
            if dist.is_main() and version in self.to_keep:
                self.store.save(version, buckets)
            else:
                for _ in buckets:
                    pass

    def weights_for(self, step: int) -> None:
        if step in self.due:
            dist.mark(f"step {step} weights (rollout rank)")
            buckets = self.receiver.next()
            if self.engine is None:  # an idle member of an engine group: its leader's engine takes the weights
                return
            self.engine.wake()
            self.engine.update_weights(buckets)

    def keep(self, checkpoint_dir: Path, step: int) -> list[int]:
        """The versions steps step+1 .. step+k sample from, linked into the checkpoint; the staged ones no later
        checkpoint can need are dropped."""
        if not self.k:
            return []
        versions = versions_needed(step, self.k)
        self.store.link_into(checkpoint_dir, versions)
        self.store.prune(below=step + 1 - self.k)
        return versions

    def finish(self) -> None:
        if self.sender is not None:
            self.sender.wait()
        if self.receiver is not None:
            self.receiver.join()
