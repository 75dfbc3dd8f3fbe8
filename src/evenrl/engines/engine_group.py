"""One rollout engine over several training ranks (rollout.tensor_parallel_size = N > 1, rollout.engine=vllm,
colocated): the N consecutive trainers of an engine group (the mesh's `engine` dimension) are the N workers of one
vLLM engine, each holding 1/N of every layer (vLLM's external_launcher executor, engines.vllm_engine), and every
call runs on all of them in lockstep. TRL's colocate mode, with evenrl's keyed samples:

    engine = EngineGroup(VLLMEngine(cfg, ...))      # engines.make_engine does it
    engine.generate(prompts, keys, params, step=s)   # on every rank of the group, with its own requests or none

Each rank still owns its share of the step's samples (train.sampling: every trainer is a rollout unit of its own). A
call gathers the members' requests inside the group, the engine generates all of them on every member, and each
rank keeps its own part. A request carries its key and sample indices, so a sample is drawn from the same (seed,
step, prompt, sample[, turn]) stream whichever member asked for it and whatever it was batched with: the layout
does not change what is sampled. Every member calls as often and at the same points (once per step, or per
generation batch; the turn loop's max_turns calls, live trajectories or not); a call where no member has a request
skips the engine. Each request keeps its member's own budget and continuation (max_tokens, first_token: the turn
loop's remaining tokens, partial rollouts' rounds), so a member's samples are what its own engine would make.

Weights: every member loads the whole tensors of each push (distributed.weights.full_weights gives every trainer
every bucket) and vLLM's loader keeps its own slice.
"""

from __future__ import annotations

from evenrl.distributed import collectives as dist
from evenrl.engines.base import Completion, Engine, SamplingParams


class EngineGroup:
    """`engine` (this rank's worker of the group's engine) behind the Engine interface, for one member."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.name, self.needs_weights, self.lockstep = engine.name, engine.needs_weights, None
        members = dist.shape().group_of("engine", dist.rank()) or [dist.rank()]
        self.index = members.index(dist.rank())

    def generate(self, prompts, keys, params: SamplingParams, *, step, sample_ranges=None, images=None,
                 turn: int = 0, first_token=None, max_tokens=None) -> list[list[Completion]]:
        k, n = len(prompts), params.samples_per_prompt
        ranges = [(0, n)] * k if sample_ranges is None else [(int(a), int(c)) for a, c in sample_ranges]
        steps = [step] * k if isinstance(step, int) else [int(s) for s in step]
        # each request keeps its member's own budget (the turn loop's, a partial rollout's round)
        caps = list(max_tokens) if max_tokens is not None else [params.max_new_tokens] * k
        mine = (list(prompts), list(keys), ranges, images, steps, list(first_token or [0] * k), caps, turn)
        parts = dist.all_gather_object(mine, over="engine")
        if len({p[7] for p in parts}) > 1:  # a bug, not a user's error: the members fell out of step
            raise RuntimeError(f"engine group: members called for turns {sorted({p[7] for p in parts})}")
        if not any(p[0] for p in parts):
            return [[] for _ in prompts]
        def joined(i: int) -> list:  # field i of every member's requests, in member order
            return [x for p in parts for x in (p[i] if p[i] is not None else [None] * len(p[0]))]

        gathered_images = joined(3)
        out = self.engine.generate(joined(0), joined(1), params, step=joined(4), sample_ranges=joined(2),
                                   images=gathered_images if any(x is not None for x in gathered_images) else None,
                                   turn=turn, first_token=joined(5), max_tokens=joined(6))
        first = sum(len(p[0]) for p in parts[:self.index])
        return out[first:first + k]

    def update_weights(self, buckets) -> None:
        self.engine.update_weights(buckets)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        self.engine.close()

