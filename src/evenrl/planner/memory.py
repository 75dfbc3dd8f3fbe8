"""Per-rank memory estimate, phase by phase, from a local Hugging Face config.json, and the knobs that make a run fit.

    evenrl plan CONFIG --nproc-per-node 4 --device cuda --device-memory-gib 80   # shows the breakdown

Model: decoder-only Llama/Qwen2/Qwen3/Mistral-like and their mixtures of experts, the dimensions read by
evenrl.planner.dims; encoder-decoder configs are refused with a message and the planner then skips the estimate.

Precision: the trained weights, their gradients and AdamW's two moments are fp32 whatever model.dtype says
(model.dtype=bfloat16 is mixed precision: bf16 compute over fp32 master weights), so the state is 16 bytes per
parameter (w = 4, g = 4, o = 8 below); with model.weights_dtype=bfloat16 all of it is bf16, and the Kahan-compensated
AdamW (evenrl.train.optimizer) keeps a bf16 compensation beside its two bf16 moments: 10 bytes (w = 2, g = 2, o = 6),
and no autocast copies (the weights are bf16 already). c, the compute dtype's bytes (4 or 2), sizes only transient
copies, activations and the KV cache.
P = parameter count, T = training ranks, S = T under sharding=fsdp (else 1), t = tokens of the largest
micro-batch on one rank, g = samples the busiest rank generates, len = max_prompt_tokens + max_new_tokens (with
rollout.env: + max_trajectory_tokens).

Resident on every phase (0 on the device with cpu_offload=full, which keeps them in host memory instead):
  parameters       wP/S                 fp32 master weights (bf16 weights: 2P/S)
  optimizer        oP/S                 AdamW's two fp32 moments (fused step: no temporaries); bf16: two bf16
                                        moments and the Kahan compensation (foreach step: temporaries the size of
                                        the gradients, which it writes into)
  reference model  cP/S                 when algo.kl_coef > 0: frozen, in the compute dtype, sharded like the policy
  critic           (w + o)P/S           when algo.advantage=gae: the value model's fp32 weights and AdamW moments,
                                        sized as the policy, sharded and offloaded like it (its gradients and
                                        activations exist only during its own update, after the policy's, whose
                                        output-layer chunks make the policy's update the larger)
  reward models    cP'/S for each reward model and judge (rewards.functions {model: ...} / {judge: ...}, P' its
                   parameters): frozen, in the compute dtype, sharded like the policy; 0 when replicated on cuda
                   (host memory outside the reward phase) or with cpu_offload=full; a judge under engine vllm on
                   cpu: its own weights cP' + KV cache (as the rollout reserve below), on cuda: see reward
  rollout reserve  memory_fraction * device memory (engine hf: reserved for nothing, a warning says so);
                   engine vllm on cpu: its own weights cP + its KV cache (memory_fraction * RAM, 0: 1 GiB), held
                   throughout (vLLM has no sleep mode on CPU)
  overhead         1 GiB on cuda (context, allocator), 0.3 GiB on cpu
rollout (generation with the HF sampler on the training ranks; with reserved rollout devices (--rollout-devices)
the training ranks generate nothing and hold no engine: this phase is the resident part only):
  rollout engine   engine vllm on cuda: memory_fraction (0: 0.3) * device memory, vLLM's gpu_memory_utilization
                   (its weights and KV cache); asleep (freed) during the other phases
  gathered model   cP + c*unit          fsdp: the whole model gathered once in the compute dtype, freed after;
                                        T > 1: plus the largest unit's all-gather buffer while it is copied out
  autocast copies  2 * linear weights   replicated bf16: torch.autocast caches a bf16 copy of every fp32 weight
                                        that requires grad for as long as the forward runs, also under no_grad
  KV cache         g * len * L * 2 * kv_dim * c
reward (only with reward models or judges; they run one after the other: the one needing most is counted):
  reward models in use   cP' replicated on cuda (brought in); fsdp: c * (root + 2 * block) of a reward model, cP' of
                         a judge (its generation gathers it whole); a vllm judge on cuda: its engine's share,
                         memory_fraction (0: 0.3) * device memory, asleep outside the phase
  reward activations     reward model: t * (a' + h') * c, one layer at a time (no grad); judge: its KV cache,
                         s * len' * L' * 2 * kv_dim' * c, s = the busiest rank's samples (one generate batch),
                         len' = template characters + max_prompt_tokens + max_new_tokens + the judge's max_new_tokens
log-probs (old/reference log-probs, no grad):
  fsdp units       c * (root + 2 * block)   the root unit (embeddings, final norm, head) stays gathered through a
                                        forward, with the block in use and the next one prefetched
  autocast copies  as above
  layer activations t * a * c         one layer's intermediates at a time (no grad: nothing is kept)
  log-prob logits  min(t * V, C) * (c + 8)   the output layer's chunk of logits (core.fused_head: C values at a
                                        time, never all t * V), its fp32 form and the exp of it
update (forward + backward + gradient reduction + optimizer step):
  gradients        gP/S                 fp32, or bf16 with bf16 weights (0 with cpu_offload=full)
  fsdp units       as above, plus the largest unit's unsharded gradient (c bytes, and an fp32 copy for the
                   reduce-scatter when c = 2)
  autocast copies  as above
  activations      t * L * a * c        a = 4h + 2*q_dim + 2*kv_dim + 4i  elements per token per layer
                   t * (L*h + a) * c    with gradient checkpointing: each layer's input, plus one layer recomputed
  logits           min(t * V, C) * (2c + 12)   the backward's chunk: logits recomputed (and upcast), softmax,
                                        gradient (and its compute-dtype copy); no [t, V] tensor (core.fused_head)
  gradient buckets gP                   replicated, T > 1: the all-reduce copies every gradient into flat buckets
                                        before the old ones are freed (after the backward: activations are gone)
  update = resident + gradients + max(units + unit gradient + copies + activations + logits, gradient buckets)
peak = the largest phase (they never overlap).
Sequence parallelism (parallel.sequence_parallel_size = SP > 1, Ulysses): the training ranks are T/SP
data-parallel groups of SP consecutive ranks; a group takes samples as one unit, up to SP x token_cap tokens per
micro-batch (the cap stays per rank, as verl's ppo_max_token_len_per_gpu), and every rank holds 1/SP of them
(padded to a multiple of SP): t = ceil(group tokens / SP), so activations and the output layer's chunk are a
rank's slice. Attention trades tokens for heads with an all-to-all of q, k, v and its output:
  all-to-all       4 * t * h * c         forward (log-probs), twice that in the update (forward and backward)
Where SP does not divide the KV heads the runtime repeats them to lcm(KV heads, SP), and k, v count that many
heads. Weights, gradients and optimizer state are sharded over all T ranks as before (FSDP does not see SP);
generation is not split (every rank generates its own samples).
Tensor parallelism (parallel.tensor_parallel_size = TP > 1): a replica is SP x TP consecutive ranks; a rank holds
its share of the model (planner.split_model: every weight but the norms /TP, Pr parameters) for P wherever it
appears above, and FSDP shards and gradient reduction span the data group, S = T/TP ranks (dp x sp); activations
are planner.split_model's (q, k, v and the MLP width /TP, the residual stream and o_proj's and down_proj's gathered
inputs whole), the output layer's chunk t x V/TP, the KV cache kv_dim/TP (with the hf engine a TP group generates
its samples together: g is the group's), the all-to-all 4 t h c / TP, plus
  tensor-parallel buffers  t * max(q, i) * c   log-probs, twice that in the update (split_model's docstring)
A mixture of experts: P counts every expert (memory holds them all; a token computes with its top-k, the step-time
estimate's active weights), an MoE layer's activations add its dispatch buffers (planner.dims.ModelDims.act_elems)
and the largest FSDP unit is an MoE block. Expert parallelism (parallel.expert_parallel_size = EP: an ep group of
ranks holds 1/EP of every layer's experts each, and FSDP shards them over the other T/EP): the routed experts'
share Pe of P is held /EP replicated, with its autocast copies, gradient buckets and the reference model's (/T with
fsdp, T every training rank, with TP too); an FSDP unit gathers E/EP experts, the hf sampler all (replicated:
Pe (1 - 1/EP) more); and each MoE layer's tokens go out and come back by all-to-all (on average: a rank's experts get
t * k of the group's pairs; routing all of them to one rank's experts would give it EP times that; with TP a rank
sends 1/TP of its group's tokens, and the routed experts are not split by TP: planner.split_model):
  expert dispatch  2 * t * k * h * c / TP   log-probs (one layer's send and receive), twice that in the update
With rollout.router_replay (off: none) the step's routes travel with its rows in the smallest integer type (b bytes:
1 up to 256 experts): a micro-batch's on the device while it runs, and one layer's widened to int64 by the hook:
  route records    t * M * k * b + t * k * 8   (M MoE layers, k experts per token); on the host the rank's rows'
                   records, g * len * M * k * b, counted in the plan's assumptions
With model.lora (A adapter parameters: planner.adapters) the base is frozen in the compute dtype and only the
adapters train: parameters cP/S + 4A/S, optimizer 8A/S, gradients 4A/S, autocast copies 2A, gradient buckets 4A, no
reference model; units and the gathered model hold the adapters too; activations add their rank-wide middles.
With model.lora.experts the routed experts' adapters Ae (part of A) are divided by EP as the experts are, and each
MoE layer folds them into its experts' weights (E/EP experts in the compute dtype, F bytes: planner.adapters), held
from its forward to its backward:
  folded experts   M * F in the update (F with activation checkpointing), F in the log-prob forward, and with the
                   hf sampler F for E experts (it runs them gathered)

The activation count adapts Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198, sec. 4.1: 34*s*b*h + 5*a*s^2*b bytes per layer for GPT in 16-bit) to SwiGLU MLPs
(gate, up, SiLU(gate), product: 4i), grouped-query attention (q, k, v, context: 2*q_dim + 2*kv_dim), RMSNorm
inputs (2h), the inputs of the QKV and MLP projections (2h), no dropout masks, and SDPA/flash attention (no
s^2 score matrix). Worst case: every sample is max_prompt_tokens + max_new_tokens long.
benchmarks/memory.py measures the state and each phase on CPU beside this estimate (docs/performance.md).
t and g: the busiest rank's worst case on the mesh (planner.rank_work, the trainer's own rollout split).
Pure Python: the planner imports this without torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from evenrl.config import RunConfig
from evenrl.models.vision_config import worst_image_tokens, worst_vision_tokens
from evenrl.planner.dims import ModelDims, read_model_dims
from evenrl.planner.layout import Layout
from evenrl.planner.adapters import (adapted_projections, adapter_params, expert_adapter_params, folded_expert_bytes,
                                     lora_note)
from evenrl.planner.rank_work import replicas, share_of, worst_case_shape
from evenrl.planner.split_model import rank_share

GIB = 1024**3
# bytes per trained parameter by model.weights_dtype: (weights, gradients, AdamW's state): fp32 weights and gradients
# and two fp32 moments; bf16 weights and gradients, two bf16 moments and the bf16 Kahan compensation
STATE = {"float32": (4, 4, 8), "bfloat16": (2, 2, 6)}
# Values per chunk of logits in core.fused_head (its _CHUNK_ELEMENTS; the planner cannot import torch, a test keeps
# the two equal): the output layer never holds more than this many logits at once.
HEAD_CHUNK = 1 << 24
OVERHEAD_GIB = {"cuda": 1.0, "cpu": 0.3}
# The three phases of a step and the components each holds on top of the resident ones (render shows them so).
# vLLM's defaults where rollout.memory_fraction is 0 (engines.vllm_engine; the planner cannot import it)
VLLM_GPU_SHARE = 0.3
VLLM_CPU_KV_BYTES = float(1 << 30)
RESIDENT = ("parameters", "optimizer", "reference model", "critic", "reward models", "rollout reserve", "overhead")
PHASES = {"rollout": ("gathered model", "autocast copies", "KV cache", "rollout engine"),
          "reward": ("reward models in use", "reward activations"),  # only with reward models or judges
          "log-probs": ("fsdp units", "autocast copies", "layer activations", "vision layer activations",
                        "log-prob logits", "log-prob all-to-all", "log-prob tensor-parallel buffers",
                        "log-prob expert dispatch", "route records"),
          "update": ("gradients", "fsdp units", "autocast copies", "activations", "vision activations", "logits",
                     "all-to-all", "tensor-parallel buffers", "expert dispatch", "route records",
                     "gradient buckets")}


# ------------------------------------------------------------------------------------------ estimate

@dataclass
class MemoryEstimate:
    breakdown: dict[str, float]  # GiB per component, display order
    total_gib: float
    capacity_gib: float  # 0 = unknown
    params: int
    micro_tokens: int
    rollout_samples: int
    host_gib: float  # offloaded to host memory (per rank)
    phases: dict[str, float] = field(default_factory=dict)  # GiB per phase, resident included (PHASES)
    assumptions: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        return None if not self.capacity_gib else self.total_gib <= self.capacity_gib

    def to_dict(self) -> dict:
        return {"breakdown_gib": {k: round(v, 3) for k, v in self.breakdown.items()},
                "total_gib": round(self.total_gib, 3), "capacity_gib": round(self.capacity_gib, 3),
                "fits": self.fits, "params": self.params, "micro_tokens": self.micro_tokens,
                "rollout_samples_per_rank": self.rollout_samples, "host_gib": round(self.host_gib, 3),
                "phases_gib": {k: round(v, 3) for k, v in self.phases.items()}, "assumptions": self.assumptions}


def compute_bytes(dtype: str) -> int:
    """Bytes of the compute dtype: 4 for float32, 2 for the 16-bit ones."""
    return 4 if dtype == "float32" else 2


def estimate_memory(cfg: RunConfig, layout: Layout, dims: ModelDims,
                    ranks: tuple[int, ...] | None = None) -> MemoryEstimate:
    """The peak of the busiest of `ranks` (default: every training rank) on layout.device_memory_gib."""
    c = compute_bytes(cfg.model.dtype)
    par = cfg.parallel
    sp, tp, _ = replicas(cfg, layout)
    share = rank_share(dims, tp)  # this rank's part of a tensor-parallel group's model (all of it at TP 1)
    tp = share.tp  # 1 for a model the plan cannot split (planner.tensor_parallel refuses it)
    t = max(layout.training_ranks, 1) // tp  # the data group: FSDP's shards and the gradient reduction
    fsdp = par.sharding == "fsdp"
    shard = t if fsdp else 1
    # Offload needs fsdp and an accelerator, and no TP or EP (the rules refuse it otherwise); such a plan is estimated
    # as if nothing were offloaded, which is what a corrected config would hold.
    offload = par.cpu_offload == "full" and fsdp and layout.device != "cpu" and tp == 1 == par.expert_parallel_size
    w, g, o = STATE[cfg.model.weights_dtype]  # bytes per trained parameter (LoRA's adapters: fp32, the config's rule)
    notes = [("fp32 master weights, fp32 gradients, AdamW's 2 fp32 moments: 16 bytes per parameter" if w == 4 else
              "bf16 weights, bf16 gradients, AdamW's 2 bf16 moments and its bf16 Kahan compensation "
              "(model.weights_dtype=bfloat16): 10 bytes per parameter")
             + (f"; tensor parallel {tp}: {share.params / 1e6:,.1f} M of {dims.params / 1e6:,.1f} M held per rank "
                f"(every weight but the norms{', routers and routed experts' if dims.experts else ''} split)"
                if tp > 1 else "")
             + (f", sharded over {t} ranks" if fsdp and t > 1 else "")
             + ("; bf16 compute" if c == 2 else ""),
             "attention via SDPA/flash (no s^2 scores); worst case: every sample at max length"]
    if par.cpu_offload == "full" and not offload:
        notes.append("cpu_offload=full cannot run on this layout (see the findings); estimated without offload")
    vision = dims.vision
    extra = worst_vision_tokens(cfg, dims.layers, dims.active_layer_params, vision)
    tokens, gen = worst_case_shape(cfg, layout, extra, ranks)
    P, L, V = share.params, dims.layers, share.vocab
    # a vision encoder's weights are held like the rest; a frozen one has no gradients or optimizer moments
    Pv = vision.params if vision else 0
    trained = P + (0 if cfg.model.freeze_vision_tower else Pv)
    held = w * (P + Pv)  # bytes of the parameters
    lora = cfg.model.lora
    A = adapter_params(dims, lora.rank, lora.target_modules, tp, lora.experts) if lora.rank else 0
    Ae = expert_adapter_params(dims, lora.rank) if lora.rank and lora.experts else 0  # split like the experts
    if lora.rank:  # the adapters train, over the whole base frozen in the compute dtype
        trained, held = A, 4 * A + c * (P + Pv)
        notes[0] = lora_note(cfg, A, t if fsdp else 1)
    device_state = 0 if offload else 1
    # the routed experts' share: held /EP replicated, sharded /T (EP x the FSDP shards over the other T/EP ranks: the
    # training ranks, the tensor-parallel ones too, where the rest is sharded over the data group)
    ep = par.expert_parallel_size
    Pe = dims.experts_total
    spread = max(layout.training_ranks, 1) if fsdp else ep
    experts_saved = 1 - shard / spread  # the share of the experts' state that EP takes off this rank
    held -= (w if not lora.rank else c) * Pe * experts_saved + w * Ae * experts_saved
    params_b = held / shard * device_state
    trained_here = trained - (Ae if lora.rank else Pe) * experts_saved
    opt_b = o * trained_here / shard * device_state
    grads_b = g * trained_here / shard * device_state
    if dims.experts:
        notes.append(f"mixture of experts: {dims.experts} experts, top {dims.top_k}, in {dims.moe_layers} of {L} "
                     f"layers: {P / 1e6:,.1f} M parameters held, {dims.active_params / 1e6:,.1f} M active per token"
                     + (f"; expert parallelism {ep}" if ep > 1 else ""))
    ref_full = c * (P + Pv - Pe * experts_saved) if cfg.algo.kl_coef > 0 and not lora.rank else 0
    ref = ref_full / shard * device_state
    host = ((held + (g + o) * trained) / shard + ref_full / shard) if offload else 0
    critic = 0
    if cfg.algo.advantage == "gae":
        critic = params_b + opt_b
        host += (w + g + o) * P / shard if offload else 0
        notes.append("critic (algo.advantage=gae) sized as the policy, sharded and offloaded the same way")
    reserve = cfg.rollout.memory_fraction * layout.device_memory_gib * GIB
    engine = 0.0
    reserved = layout.rollout_devices > 0 and layout.training_ranks >= 1
    if reserved:  # the trainers generate nothing; the rollout devices hold the engines (a note sizes them)
        reserve, gen = 0.0, 0
        notes.append(f"training ranks only; each of the {layout.rollout_devices} rollout devices holds the "
                     f"{cfg.rollout.engine} engine: the model in the compute dtype ({c * dims.params / GIB:.2f} GiB) and its "
                     "KV cache")
    elif cfg.rollout.engine == "vllm" and layout.device == "cuda":
        engine, reserve = (cfg.rollout.memory_fraction or VLLM_GPU_SHARE) * layout.device_memory_gib * GIB, 0.0
    elif cfg.rollout.engine == "vllm":
        reserve = c * (dims.params + Pv) + (reserve or VLLM_CPU_KV_BYTES)  # the engine's own whole copy
    sampler = not reserved and cfg.rollout.engine == "hf"  # evenrl's sampler runs the training model here
    overhead = OVERHEAD_GIB[layout.device] * GIB
    block_adapters = A // L
    # autocast's bf16 copies of fp32 weights (bf16 weights need none; LoRA's frozen base is in model.dtype already)
    copies = (2 * (trained_here if lora.rank else share.linear - Pe * experts_saved)
              if (c == 2 and w == 4 and not fsdp) else 0)
    block = share.block - (dims.experts - dims.experts // ep) * dims.expert_params  # E/EP experts gathered
    units = c * (share.root + 2 * (block + block_adapters)) if fsdp else 0
    largest = max(share.root, block + block_adapters)
    trained_unit = block_adapters if lora.rank else largest  # the largest unit's parameters that get gradients
    unit_grads = trained_unit * (c + (4 if c < 4 else 0)) if fsdp else 0
    # SP not dividing the (rank's) KV heads: the runtime repeats them to lcm(KV heads, SP), which k and v then hold
    kv_repeat = 2 * (math.lcm(share.kv_heads, sp) - share.kv_heads) * dims.head_dim
    act_elems = share.act_elems + kv_repeat
    if lora.rank:  # each adapter's rank-wide middle, and with dropout its own copy of the layer's input
        adapted = adapted_projections(dims, lora.target_modules).values()
        act_elems += lora.rank * len(adapted) + (sum(a for a, _ in adapted) if lora.dropout > 0 else 0)
    if cfg.model.gradient_checkpointing:
        act = tokens * (L * dims.hidden + act_elems) * c
    else:
        act = tokens * L * act_elems * c
    folded = folded_expert_bytes(dims, c, ep) if Ae else 0  # one MoE layer's experts, adapters folded in
    act += folded * (1 if cfg.model.gradient_checkpointing else dims.moe_layers)
    length = cfg.sample_tokens()
    per_sample = worst_image_tokens(cfg, vision) * vision.merge ** 2 if vision else 0  # patches
    patches = tokens // length * per_sample
    if vision:
        notes.append(f"vision encoder {Pv / 1e6:.1f} M params"
                     f"{', frozen (no gradients or AdamW moments)' if cfg.model.freeze_vision_tower else ''}; worst "
                     f"case {per_sample // vision.merge ** 2:,} image tokens per sample ({patches:,} patches per "
                     f"micro-batch), each patch ~{extra / per_sample:.2f} tokens of compute in the balance and the "
                     "token cap")
    if vision and cfg.model.gradient_checkpointing:
        vision_act = patches * (vision.depth * vision.width + vision.act_elems) * c
    else:
        vision_act = patches * vision.depth * vision.act_elems * c if vision else 0
    parts = {
        "parameters": params_b, "optimizer": opt_b, "reference model": ref, "critic": critic,
        "rollout reserve": reserve, "overhead": overhead,
        "gathered model": ((c * (P + Pv + A + (largest if t > 1 else 0)) if fsdp else
                            (w if not lora.rank else c) * Pe * experts_saved + w * Ae * experts_saved)
                           + (folded_expert_bytes(dims, c, 1) if Ae else 0)) if sampler else 0,
        "autocast copies": copies,
        "KV cache": gen * length * L * 2 * share.kv_dim * c if sampler else 0,
        "rollout engine": engine,
        "fsdp units": units,
        "layer activations": tokens * (share.act_elems + kv_repeat) * c + folded,
        "vision layer activations": patches * vision.act_elems * c if vision else 0,
        "log-prob logits": min(tokens * V, HEAD_CHUNK) * (c + 8),
        "gradients": grads_b,
        "activations": act,
        "vision activations": vision_act,
        "logits": min(tokens * V, HEAD_CHUNK) * (2 * c + 12),
        "log-prob all-to-all": 4 * tokens * dims.hidden // tp * c if sp > 1 else 0,
        "all-to-all": 2 * 4 * tokens * dims.hidden // tp * c if sp > 1 else 0,
        "log-prob tensor-parallel buffers": tokens * share.gather_elems * c,
        "tensor-parallel buffers": 2 * tokens * share.gather_elems * c,
        # a tensor-parallel rank dispatches 1/TP of its group's tokens
        "log-prob expert dispatch": 2 * tokens * dims.top_k * dims.hidden * c // tp if ep > 1 and dims.experts else 0,
        "expert dispatch": 4 * tokens * dims.top_k * dims.hidden * c // tp if ep > 1 and dims.experts else 0,
        "route records": route_record_bytes(cfg, dims, tokens),
        "gradient buckets": g * trained_here if (not fsdp and t > 1) else 0,
    }
    scorers = scorer_memory(cfg, layout, dims, tokens, samples_rank=math.ceil(cfg.samples_per_step() * share_of(
        cfg, layout)))
    parts["reward models"], parts["reward models in use"], parts["reward activations"] = scorers
    resident = sum(parts[k] for k in RESIDENT)
    phases = {
        "rollout": resident + parts["gathered model"] + (copies if sampler else 0) + parts["KV cache"] + engine,
        "log-probs": resident + units + copies + parts["layer activations"] + parts["vision layer activations"]
        + parts["log-prob logits"] + parts["log-prob all-to-all"] + parts["log-prob tensor-parallel buffers"]
        + parts["log-prob expert dispatch"] + parts["route records"],
        "update": resident + grads_b + max(units + unit_grads + copies + act + vision_act + parts["logits"]
                                           + parts["all-to-all"] + parts["tensor-parallel buffers"]
                                           + parts["expert dispatch"] + parts["route records"],
                                           parts["gradient buckets"]),
    }
    if parts["route records"]:
        rows = math.ceil(cfg.samples_per_step() * share_of(cfg, layout))
        notes.append(f"router replay: the rank's {rows} rows carry their routes on the host, "
                     f"{route_record_bytes(cfg, dims, rows * length) / GIB * 1024:.1f} MiB at most")
    if any(spec.model or spec.judge for spec in cfg.rewards.functions):
        phases["reward"] = resident + scorers[1] + scorers[2]
    total = max(phases.values())
    return MemoryEstimate({k: v / GIB for k, v in parts.items()}, total / GIB, layout.device_memory_gib,
                          dims.params + Pv,
                          tokens, gen, host / GIB, {k: v / GIB for k, v in phases.items()}, notes)


def route_record_bytes(cfg: RunConfig, dims: ModelDims, tokens: int) -> int:
    """Routes of `tokens` tokens (rollout.router_replay): M x k ids each in the smallest integer type, and one
    layer's widened to int64 by the router's hook; 0 without replay or experts."""
    if cfg.rollout.router_replay == "off" or not dims.experts:
        return 0
    width = 1 if dims.experts <= 256 else 2 if dims.experts <= 1 << 15 else 4  # evenrl.core.moe.route_dtype
    return tokens * dims.moe_layers * dims.top_k * width + tokens * dims.top_k * 8


@functools.lru_cache(maxsize=64)
def _dims_at(path: str) -> ModelDims:
    return read_model_dims(path)


def scorer_dims(cfg: RunConfig, dims: ModelDims) -> list[tuple[Any, str, ModelDims]]:
    """(rewards.functions entry, model path, dims) of each reward model and judge whose config.json reads (the
    others are the rules' errors); a judge without a model of its own is the policy's base (`dims`)."""
    out = []
    for spec in cfg.rewards.functions:
        if spec.model or spec.judge:
            path = spec.model or spec.judge.model
            try:
                out.append((spec, path or cfg.model.path, _dims_at(path) if path else dims))
            except ValueError:
                continue
    return out


def scorer_params(spec, d: ModelDims) -> tuple[int, int, int]:
    """(parameters, matmul weights, FSDP root unit) of a rewards.functions entry's model: a reward model scores
    with one number where a causal LM projects onto the vocabulary, so it has no LM head."""
    head = d.vocab * d.hidden if spec.model else 0
    untied = 0 if d.tied else head
    return d.params - untied, d.linear_params - head, d.root_params - untied


def scorer_memory(cfg: RunConfig, layout: Layout, dims: ModelDims, tokens: int,
                  samples_rank: int) -> tuple[float, float, float]:
    """Bytes of the reward models and judges (module docstring): resident, and the weights the reward phase brings
    in or gathers and its activations (a reward model's one layer, a judge's KV cache) for the one that needs the
    most: the phase runs them one after the other."""
    c = compute_bytes(cfg.model.dtype)
    fsdp = cfg.parallel.sharding == "fsdp"
    t = max(layout.training_ranks, 1) if fsdp else 1
    offload = cfg.parallel.cpu_offload == "full" and fsdp and layout.device != "cpu"
    on_host = not fsdp and layout.device == "cuda"  # replicated: in host memory outside the reward phase
    resident, busiest = 0.0, (0.0, 0.0)
    for spec, _, d in scorer_dims(cfg, dims):
        params, _, root = scorer_params(spec, d)
        weights, act = 0.0, 0.0
        if spec.judge and cfg.rollout.engine == "vllm":  # an engine of its own, like the policy's
            if layout.device == "cuda":  # asleep outside the phase
                weights = (cfg.rollout.memory_fraction or VLLM_GPU_SHARE) * layout.device_memory_gib * GIB
            else:
                resident += c * params + (cfg.rollout.memory_fraction * layout.device_memory_gib * GIB
                                          or VLLM_CPU_KV_BYTES)
        elif spec.judge:
            resident += 0 if on_host or offload else c * params / t
            weights = c * params if on_host or fsdp else 0  # fsdp: generation gathers the whole judge
            length = len(spec.judge.template) + cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens \
                + spec.judge.max_new_tokens  # a template character is at most one token
            act = samples_rank * length * d.layers * 2 * d.kv_heads * d.head_dim * c
        else:
            resident += 0 if on_host or offload else c * params / t
            weights = c * params if on_host else c * (root + 2 * d.layer_params) if fsdp else 0
            act = tokens * (d.act_elems + d.hidden) * c
        busiest = max(busiest, (weights, act), key=sum)
    return resident, *busiest
