"""A training rank's state: everything it builds once and a step reads or changes, as one typed object. A checkpoint
saves and restores it as a whole (evenrl.train.checkpoint: the trained models with their optimizers by name, and
`state_dict`, its small state without model tensors).

Reserved rollout ranks have no Trainer: they run evenrl.train.rollout_rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from evenrl.config import RunConfig
from evenrl.core.model_plan import plan_of
from evenrl.distributed import collectives as dist
from evenrl.distributed.mesh import Mesh
from evenrl.engines import Engine, make_engine
from evenrl.engines.payload import make_payload
from evenrl.engines.sync import WeightSync, make_weight_sync
from evenrl.models.files import read_model_config
from evenrl.models.loading import load_policy, with_value_head
from evenrl.models.lora import adapters_disabled, add_adapters
from evenrl.models.vision import is_vision_model, load_image_processor
from evenrl.models.vision_config import vision_dims_from_config, vision_token_weight
from evenrl.planner.compatibility import check_run
from evenrl.planner.dims import dims_from_config
from evenrl.rewards import RewardFn, resolve
from evenrl.errors import UsageError
from evenrl.rollout import carry_check
from evenrl.rollout.carry import Carry
from evenrl.rollout.source import TrajectorySource
from evenrl.rollout.trajectories import make_turns
from evenrl.train import checkpoint, moe
from evenrl.train.balance import Balance
from evenrl.train.data import PromptSampler, load_data, take_images
from evenrl.train.optimizer import make_adamw
from evenrl.train.reward_models import Scorer, load_scorers
from evenrl.train.parallelize import parallelize


@dataclass
class Trained:
    """A model being trained, with its optimizer and learning-rate schedule: the policy, and with gae the critic."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass
class Prompts:
    """A prompt dataset as the step reads it: the rows (for rewards) and their tokens, in the same order, each
    row's images (encoded bytes or paths; [] for a text prompt), and with rollout.env the environment's opening
    messages the tokens render."""

    rows: list[dict]
    tokens: list[list[int]]
    images: list[list] = field(default_factory=list)
    openings: list[list[dict]] | None = None


@dataclass
class Trainer:
    cfg: RunConfig
    mesh: Mesh  # the job's mesh (distributed.mesh): every size and group the step asks for
    policy: Trained
    critic: Trained | None  # algo.advantage=gae
    reference: torch.nn.Module | None  # frozen, in the compute dtype; algo.kl_coef > 0 without model.lora
    tokenizer: Any
    prompts: Prompts
    eval_prompts: Prompts  # empty without eval.path
    sampler: PromptSampler
    reward_fns: list[tuple[RewardFn, float]]
    engine: Engine | None  # None with reserved rollout ranks: a trainer then generates nothing
    sync: WeightSync | None  # None where no weights move (evenrl.engines.sync.make_weight_sync)
    step: int = 0  # RL steps done
    skipped_prompts: int = 0  # longer than data.max_prompt_tokens, left out of `prompts`
    eos_ids: set[int] = field(default_factory=set)
    image_processor: Any = None  # a vision-language model's (evenrl.models.vision)
    vision_weight: float = 0.0  # a patch through its vision encoder, in language-model tokens (vision_token_weight)
    scorers: list[Scorer] = field(default_factory=list)  # reward models and judges (train.reward_models)
    balance: Balance = field(default_factory=Balance)  # token caps and capacity weights (mixed devices)
    turns: TrajectorySource | None = None  # rollout.env or rollout.agent: the trajectory loop (evenrl.rollout)
    carry: Carry | None = None  # rollout.partial: the samples carried across steps (rollout.carry)

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def temperature(self) -> float:
        """The temperature log-probs are taken at: the sampling one, or 1 for greedy sampling."""
        return self.cfg.rollout.temperature if self.cfg.rollout.temperature > 0 else 1.0

    @contextlib.contextmanager
    def reference_policy(self):
        """The KL reference for the duration of a `with` block: the frozen copy, or with model.lora the policy itself
        with its adapters disabled (the base, on the same weights)."""
        if self.reference is not None:
            yield self.reference
            return
        with adapters_disabled(self.model) as base:
            yield base

    def trained(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        out = {"policy": (self.policy.model, self.policy.optimizer)}
        if self.critic is not None:
            out["critic"] = (self.critic.model, self.critic.optimizer)
        return out

    def state_dict(self) -> dict:
        state = {"lr_scheduler": self.policy.lr_scheduler.state_dict(), "sampler": self.sampler.state_dict(),
                 "rng": checkpoint.rng_state(), "step": self.step, "balance": self.balance.state_dict()}
        if self.critic is not None:
            state["critic_lr_scheduler"] = self.critic.lr_scheduler.state_dict()
        if self.carry is not None:  # every rank's in-flight and waiting samples (a collective)
            state["carry"] = self.carry.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.policy.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.critic is not None:
            self.critic.lr_scheduler.load_state_dict(state["critic_lr_scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])
        self.balance.load_state_dict(state.get("balance"))  # absent from checkpoints of older runs
        if self.carry is not None:
            if "carry" not in state:
                raise KeyError("carry: saved by a run without rollout.partial")
            # every rank checks the whole carry (the same bytes everywhere), so all refuse it together
            why = carry_check.problem(state["carry"], self.cfg, step=state["step"], vocab=carry_check.vocab_of(self.model),
                                      rows=len(self.prompts.rows), eos=self.eos_ids)
            if why:
                raise UsageError(why)
            self.carry.load_pool(state["carry"], dist.rank(), dist.world())
            if not dist.rollout_ranks():  # colocated: the samples this rank generated; reserved: trainer 0's copy
                self.carry.load_live(state["carry"], dist.rank(), dist.world())
            elif dist.is_main():
                self.carry.load_live(state["carry"], None, 1)
        self.step = state["step"]

    def resume(self, found: Path | None) -> None:
        """Continue after the checkpoint `found` (None: start at step 0); the weight sync learns where the run
        starts."""
        if found is not None:
            checkpoint.load(found, self)
        if self.sync is not None:
            self.sync.begin(self.step, found)


def build_trainer(cfg: RunConfig, mesh: Mesh, balance: Balance | None = None) -> Trainer:
    """A training rank's Trainer at step 0: policy (and critic) ready to train, reference, data, engine, sync;
    `balance`: the token caps and capacity weights of the plan (evenrl.train.balance.make_balance; None: the
    config's one cap, equal weights)."""
    torch.manual_seed(cfg.train.seed)
    check_settings(cfg, mesh)
    turns = make_turns(cfg)  # checks the chat template before any weights load
    model, tokenizer = trainable_model(cfg, cfg.model.path, mesh)
    moe.check(cfg, model)  # router replay and the load-balancing loss on what the routers can do
    critic = None
    if cfg.algo.advantage == "gae":  # built like the policy: whatever is applied to one applies to the other
        critic_model, _ = trainable_model(cfg, cfg.critic.path or cfg.model.path, mesh,
                                          head=lambda m: with_value_head(m, cfg.train.seed))
        critic = Trained(critic_model, *adamw(critic_model, cfg, cfg.critic.lr, cfg.critic.warmup_steps))
    reference = None
    if cfg.algo.kl_coef > 0 and not cfg.model.lora.rank:  # frozen: held in the compute dtype, no master copy
        reference, _ = load_policy(cfg.model.path, dtype=cfg.model.dtype, device=mesh.device)
        parallelize(reference, mesh, cfg, role="reference")
    eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    engine = None
    if not dist.rollout_ranks():  # reserved rollout ranks generate everything: no second copy of the weights here
        engine = make_engine(cfg, model, eos_token_ids=eos_ids, pad_token_id=tokenizer.pad_token_id,
                             device=mesh.device)
    sync = make_weight_sync(cfg, engine=engine, payload=make_payload(cfg, model),
                            ckpt_root=Path(cfg.log.run_dir) / "checkpoints")
    processor, weight = vision_setup(cfg, model)
    vision = (processor, model.config) if processor is not None else None
    prompts, skipped = load_prompt_set(cfg, tokenizer, turns, vision=vision)
    eval_prompts = Prompts([], [])
    if cfg.eval.path:
        evals, _ = load_prompt_set(cfg, tokenizer, turns, cfg.eval.path, vision=vision)
        n = cfg.eval.max_prompts
        eval_prompts = Prompts(evals.rows[:n], evals.tokens[:n], evals.images[:n],
                               None if evals.openings is None else evals.openings[:n])
    return Trainer(cfg=cfg, mesh=mesh,
                   policy=Trained(model, *adamw(model, cfg, cfg.train.lr, cfg.train.warmup_steps)), critic=critic,
                   reference=reference, tokenizer=tokenizer, prompts=prompts,
                   eval_prompts=eval_prompts, sampler=PromptSampler(len(prompts.rows), cfg.data.seed),
                   reward_fns=[] if turns else [(resolve(spec.name), spec.weight) for spec in cfg.rewards.functions
                                                if spec.name],
                   engine=engine, sync=sync, skipped_prompts=skipped, eos_ids=eos_ids, image_processor=processor,
                   vision_weight=weight, scorers=[] if turns else load_scorers(cfg, mesh),
                   balance=balance or Balance(), turns=turns, carry=Carry(cfg, turns) if cfg.rollout.partial else None)


def check_settings(cfg: RunConfig, mesh: Mesh) -> None:
    """What does not run together (config.compatibility, the plan's findings too) on this rank's device and the
    run's reserved rollout ranks, refused in one line before anything loads."""
    check_run(cfg, device=mesh.device.type, rollout_devices=len(mesh.rollout_ranks()))


def vision_setup(cfg: RunConfig, model) -> tuple[Any, float]:
    """(image processor, vision_token_weight) of a vision-language policy; (None, 0.0) for a text model."""
    if not is_vision_model(model):
        return None, 0.0
    hf = read_model_config(cfg.model.path)
    processor = load_image_processor(cfg.model.path, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    text = dims_from_config(hf)
    return processor, vision_token_weight(text.layers, text.active_layer_params, vision_dims_from_config(hf))


def load_prompt_set(cfg: RunConfig, tokenizer, turns: TrajectorySource | None, path: str | None = None,
                    vision=None) -> tuple[Prompts, int]:
    """The prompts of data.path (or `path`) and how many were skipped as too long: with rollout.env, the
    environment's openings rendered by the chat template; `vision`: (image processor, model config) of a
    vision-language policy."""
    if turns is None:
        rows, tokens, skipped = load_data(cfg, tokenizer, path, vision=vision)
        return Prompts(rows, tokens, take_images(rows)), skipped
    rows, tokens, openings, skipped = turns.load(tokenizer, path)
    return Prompts(rows, tokens, openings=openings), skipped


def trainable_model(cfg: RunConfig, path: str, mesh: Mesh, head=None):
    """(model, tokenizer) from `path`, ready to train: the policy, or with `head` (a function of the model) the
    critic, so both go through the same construction. With model.lora the policy trains adapters only; the critic
    trains whole."""
    lora = head is None and cfg.model.lora.rank > 0
    # the trained weights in model.weights_dtype whatever model.dtype says (parallelize sets the compute
    # precision): fp32 master weights, or bf16 ones under a Kahan-compensated AdamW (evenrl.train.optimizer); a
    # LoRA base is frozen, so it has no master copy: it is held in model.dtype, under fp32 adapters
    weights = cfg.model.weights_dtype
    model, tokenizer = load_policy(path, dtype=cfg.model.dtype if lora else weights, device=mesh.device)
    if head is not None:
        model = head(model)
        if weights != "float32":  # the value head is made in fp32
            model.to(getattr(torch, weights))
    if lora:
        add_adapters(model, cfg.model.lora)
    parallelize(model, mesh, cfg, role="policy" if head is None else "critic")
    model.train()
    return model, tokenizer


def adamw(model, cfg: RunConfig, lr: float, warmup_steps: int):
    """(AdamW over the model's trainable parameters (evenrl.train.optimizer), linear warm-up over `warmup_steps`
    optimizer steps)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(params, cfg, lr, split=plan_of(model).split)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0)
    return optimizer, scheduler
