"""One rollout engine over several training ranks (rollout.tensor_parallel_size = N > 1, rollout.engine=vllm,
colocated): the N consecutive trainers of an engine group (the mesh's `engine` dimension) are the N workers of one
vLLM engine, each holding 1/N of every layer (vLLM's external_launcher executor, engines.vllm_engine), and every
call runs on all of them in lockstep. TRL's colocate mode, with evenrl's keyed samples:

    engine = EngineGroup(VLLMEngine(cfg, ...))      # engines.make_engine does it
    engine.generate(requests, params)                # on every rank of the group, with its own requests or none

Each rank still owns its share of the step's samples (train.sampling: every trainer is a rollout unit of its own). A
call gathers the members' requests inside the group, the engine generates all of them on every member, and each
rank keeps its own part. A request carries its key and sample indices, so a sample is drawn from the same (seed,
step, prompt, sample[, turn]) stream whichever member asked for it and whatever it was batched with: the layout
does not change what is sampled. Every member calls as often and at the same points (once per step, or per
generation batch; the turn loop's max_turns calls, live trajectories or not); a call where no member has a request
skips the engine. Each request (engines.base.Request) keeps its member's own step, turn, budget and continuation
(max_tokens, first_token: the turn loop's remaining tokens, partial rollouts' rounds), so a member's samples are
what its own engine would make.

Weights: every member loads the whole tensors of each push (distributed.weights.full_weights gives every trainer
every bucket) and vLLM's loader keeps its own slice.
"""

from __future__ import annotations

from evenrl.distributed import collectives as dist
from evenrl.engines.base import Completion, Engine, Request, SamplingParams


class EngineGroup:
    """`engine` (this rank's worker of the group's engine) behind the Engine interface, for one member."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.name, self.needs_weights, self.lockstep = engine.name, engine.needs_weights, None
        members = dist.shape().group_of("engine", dist.rank()) or [dist.rank()]
        self.index = members.index(dist.rank())

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        parts = dist.all_gather_object(list(requests), over="engine")
        if not any(parts):
            return [[] for _ in requests]
        out = self.engine.generate([r for p in parts for r in p], params)  # in member order
        first = sum(len(p) for p in parts[:self.index])
        return out[first:first + len(requests)]

    def update_weights(self, buckets) -> None:
        self.engine.update_weights(buckets)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        self.engine.close()

