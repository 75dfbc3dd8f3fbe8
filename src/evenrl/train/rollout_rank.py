"""A reserved rollout rank's whole run (`--rollout-devices R`: the last R processes only generate).

Per step: the step's prompts (the same PromptSampler as the trainers, so no prompt is sent), the weights of the
version that samples the step (pushed by the trainers, received in the background by the weight sync), this
replica's samples out to the trainers, point to point. With rollout.max_staleness k it runs up to k steps ahead of
the trainers: step t needs the version after step t-1-k, which the trainers push as soon as they have it. It saves
and logs nothing; the trainers' checkpoints tell it where a resumed run continues.
"""

from __future__ import annotations

from pathlib import Path

import torch

from evenrl.config import RunConfig
from evenrl.core.canonical import unit_batches
from evenrl.core.staleness import policy_version
from evenrl.distributed import collectives as dist
from evenrl.distributed.mesh import Mesh
from evenrl.engines import Engine, make_engine
from evenrl.engines.payload import make_payload
from evenrl.engines.sync import Broadcast
from evenrl.models.loading import load_policy, set_tf32
from evenrl.models.lora import add_adapters
from evenrl.models.vision import prompt_image_inputs
from evenrl.errors import UsageError
from evenrl.rollout import carry_check
from evenrl.rollout.carry import Carry, serve_step
from evenrl.rollout.generate import generate_batch
from evenrl.rollout.source import TrajectorySource
from evenrl.rollout.trajectories import make_turns
from evenrl.train import checkpoint
from evenrl.train.data import PromptSampler
from evenrl.train.trainer import Prompts, check_settings, load_prompt_set, vision_setup


def serve(cfg: RunConfig, mesh: Mesh, found: Path | None) -> None:
    """Generate every step's samples of this replica, from step 1 or after checkpoint `found`."""
    check_settings(cfg, mesh)
    turns = make_turns(cfg)  # checks the chat template before any weights load
    # one whole copy in the engine's dtype: the hf engine samples from it, and it gives the push its layout (all a
    # vLLM rank needs of it: its tensors' shapes, on the meta device, so the device is the engine's alone)
    device = mesh.device if cfg.rollout.engine == "hf" else torch.device("meta")
    model, tokenizer = load_policy(cfg.model.path, dtype=cfg.model.dtype, device=device)
    set_tf32(cfg.model.tf32)  # the trainers' matmul precision: the same products on both sides
    if cfg.model.lora.rank:  # the trainers' adapters, overwritten by every push; the base is the trainers' already
        add_adapters(model, cfg.model.lora)
    eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    # an engine over several rollout devices is started by the first rank of its group; the others leave their
    # devices to it and take part in the pushes and the sends only, with no samples of their own
    group = dist.shape().group_of("engine", dist.rank())
    engine = None if group[0] != dist.rank() else make_engine(
        cfg, model, eos_token_ids=eos_ids, pad_token_id=tokenizer.pad_token_id, device=mesh.device)
    processor, _ = vision_setup(cfg, model)
    prompts, _ = load_prompt_set(cfg, tokenizer, turns, vision=(processor, model.config) if processor else None)
    sampler = PromptSampler(len(prompts.rows), cfg.data.seed)
    start, carry = 0, Carry(cfg, turns) if cfg.rollout.partial else None
    if found is not None:  # only where the run continues and which prompts come next; the weights come pushed
        start = checkpoint.read_meta(found)["step"]
        state = checkpoint.read_state(found)
        sampler.load_state_dict(state["sampler"])
        if carry is not None:  # the in-flight samples this replica continues, checked as the trainers check them
            why = carry_check.problem(state.get("carry"), cfg, step=start, vocab=carry_check.vocab_of(model),
                                      rows=len(prompts.rows), eos=eos_ids)
            if why:
                raise UsageError(f"{found / 'trainer.pt'}: {why}; {checkpoint.EARLIER}")
            replicas = dist.rollout_ranks()
            carry.load_live(state["carry"], replicas.index(dist.rank()), len(replicas))
    sync = Broadcast(cfg, engine=engine, payload=make_payload(cfg, model),
                     ckpt_root=Path(cfg.log.run_dir) / "checkpoints")
    sync.begin(start, found)
    for step in range(start + 1, cfg.train.steps + 1):
        prompt_ids = sampler.next_prompts(cfg.data.prompts_per_step)
        sync.weights_for(step)
        if carry is not None:
            serve_step(cfg, carry, engine, prompts, step, prompt_ids)
        else:
            generate_and_send(cfg, engine, prompts, step, prompt_ids, turns, processor)
    dist.finish_sends()
    sync.finish()


def generate_and_send(cfg: RunConfig, engine: Engine | None, prompts: Prompts, step: int, prompt_ids: list[int],
                      turns: TrajectorySource | None, processor=None) -> None:
    """One step, with the weights of policy_version(step) loaded: this replica's share of the samples, the step's
    prompts balanced over the replicas by cost, sent to the trainers without waiting for them (each trainer gets
    the samples it starts from, as in a colocated step). A sample's key is what it is on any layout, so the samples
    equal the colocated ones; with rollout.env they are whole trajectories, the environments stepped here.
    `processor`: a vision-language model's image processor (the prompts' images go to the engine). The replicas
    are the engines (one per rollout rank, or per group of rollout.tensor_parallel_size of them: engine None on
    the group's other ranks, which send empty shares)."""
    replicas = [g[0] for g in dist.shape().groups("engine")]
    costs = [len(prompts.tokens[i]) + cfg.response_tokens() for i in prompt_ids]
    dist.mark(f"step {step} generate (rollout rank)")
    completions = []  # an idle member of an engine group makes none
    calls = unit_batches(cfg, costs, len(replicas), None)[replicas.index(dist.rank())] if engine is not None else []
    for mine in calls:
        ids = [prompt_ids[p] for p, _, _ in mine]
        completions += generate_batch(cfg, engine, turns, prompts, step, mine, ids, 0,
                                      prompt_image_inputs(processor, prompts.images, ids) if turns is None else None)
    if engine is not None:
        engine.sleep()
    made = {(c.prompt_key, c.sample_index): c for samples in completions for c in samples}
    # as the trainers split: by rollout unit (a tensor-parallel group), to the rank of each that keeps the samples
    units = dist.shape().trainers // dist.shape().tp
    shares = dist.per_trainer([[x for b in batches for x in b] for batches in unit_batches(
        cfg, costs, units, dist.unit_weights(dist.capacity()))])
    dist.send_rollouts(step, policy_version(step, cfg.rollout.max_staleness),
                       [[made[(p, i)] for p, first, count in share for i in range(first, first + count)
                         if (p, i) in made] for share in shares])
