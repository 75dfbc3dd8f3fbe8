"""Rewards scored by models on the training ranks: reward models (a rewards.functions entry `{model: PATH}`: a Hugging
Face sequence classifier with one label, scoring (prompt, completion)) and LLM judges (`{judge: {...}}`: a causal
LM run by the rollout engine on a prompt made from the sample, its output read as a number by a parser).
`step.add_rewards` and `evaluate` call `add_model_rewards` after the function rewards; a sample's reward is the
weighted sum over every entry, and a failed entry (a judge output the parser cannot read, an input longer than the
model takes) fails the sample's reward as a failed function does (rewards.on_failure).

Why the scores do not depend on the layout:
  * a reward model's micro-batches (at most train.token_cap_per_micro_batch tokens, packed by the update's packer)
    are cut from the whole step's samples in sample order and only then dealt to the ranks, so a sample meets the
    same batch-mates in the same shapes on any layout: the same score, bit for bit (reward_model_scores);
  * a judge's sample is keyed by (judge seed, step, the policy sample's index in the step), as the policy's own
    samples are: the same verdict on any rank, any number of ranks, and again after a resume.
    A judge's prompts are batched per rank, as the policy's rollout is: its logits, and so a greedy near-tie or a
    sampling boundary, can differ in the last float bit between layouts, as the policy's own samples can.
Under parallel.sharding=fsdp both models are sharded over the training ranks like the policy: every rank runs as
many reward-model forwards as the busiest one (empty ones are fillers), and the judge generates inside
distributed.weights.gathered. Replicated on a GPU, their weights stay in host memory outside the reward phase and
move to the device for it (a GPU-only path: on CPU nothing moves; it has not run on a GPU).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from evenrl.config import RunConfig
from evenrl.config.rewards import JudgeSpec
from evenrl.core.partition import balanced_partition
from evenrl.core.schedule import make_schedule
from evenrl.distributed import collectives as dist
from evenrl.distributed.mesh import Mesh
from evenrl.engines import Engine, HFEngine
from evenrl.engines.base import Request, SamplingParams
from evenrl.errors import UsageError
from evenrl.models.files import read_model_config
from evenrl.models.loading import is_sharded, load_policy, load_reward_model
from evenrl.rewards import FAILURE_KINDS, score_all
from evenrl.rewards.judge import fill_template, resolve_parser
from evenrl.rewards.registry import RewardFn
from evenrl.train.data import encode_prompt
from evenrl.train.parallelize import parallelize, scorer_home


@dataclass
class RewardModel:
    name: str  # in the reward stats: "model:<directory name>"
    weight: float
    model: torch.nn.Module
    tokenizer: Any
    positions: int  # the longest input the model takes
    device: torch.device


@dataclass
class Judge:
    name: str  # "judge:<directory name>"
    weight: float
    spec: JudgeSpec
    engine: Engine
    model: torch.nn.Module | None  # the hf engine's model (None under vllm, which holds its own)
    tokenizer: Any
    parser: RewardFn
    seed: int  # the judge's sampling streams: derived from train.seed and the entry's position
    positions: int
    device: torch.device


Scorer = RewardModel | Judge


def load_scorers(cfg: RunConfig, mesh: Mesh) -> list[Scorer]:
    """The reward models and judges of rewards.functions, in entry order, ready on this training rank."""
    out: list[Scorer] = []
    for i, spec in enumerate(cfg.rewards.functions):
        field = f"rewards.functions.{i}"
        if spec.model:
            model, tokenizer = load_reward_model(spec.model, f"{field}.model", dtype=cfg.model.dtype,
                                                 device=scorer_home(cfg, mesh.device))
            parallelize(model, mesh, cfg, role="scorer")
            out.append(RewardModel(f"model:{Path(spec.model).name}", spec.weight, model, tokenizer,
                                   _positions(model.config), mesh.device))
        elif spec.judge is not None:
            out.append(_load_judge(cfg, mesh, spec.judge, spec.weight, i))
    return out


def _load_judge(cfg: RunConfig, mesh: Mesh, spec: JudgeSpec, weight: float, i: int) -> Judge:
    field = f"rewards.functions.{i}.judge"
    path = spec.model or cfg.model.path
    if spec.model and not Path(spec.model).expanduser().is_dir():
        raise UsageError(f"{field}.model: got {spec.model!r}; a local directory holding a causal LM saved with "
                         "save_pretrained, or a hub id (org/name)")
    parser = resolve_parser(spec.parser, f"{field}.parser")
    positions = int(read_model_config(path).get("max_position_embeddings") or 1 << 20)
    name = f"judge:{Path(path).name}"
    seed = int.from_bytes(hashlib.blake2b(f"evenrl-judge/{cfg.train.seed}/{i}".encode(), digest_size=8).digest(),
                          "little")
    if cfg.rollout.engine == "vllm":
        from evenrl.engines.vllm_engine import VLLMEngine
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        engine = VLLMEngine(cfg, eos_token_ids=eos, device=mesh.device, path=path, max_len=positions)
        return Judge(name, weight, spec, engine, None, tokenizer, parser, seed, positions, mesh.device)
    model, tokenizer = load_policy(path, dtype=cfg.model.dtype, device=scorer_home(cfg, mesh.device))
    parallelize(model, mesh, cfg, role="scorer")
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    engine = HFEngine(model, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
    return Judge(name, weight, spec, engine, model, tokenizer, parser, seed, positions, mesh.device)


def _positions(hf_config) -> int:
    return int(getattr(hf_config, "max_position_embeddings", None) or 1 << 20)


@contextlib.contextmanager
def on_device(model, device: torch.device):
    """The scorer's weights on `device` for the block: a replicated model kept in host memory (GPU) comes in and
    goes back after; a sharded or CPU one stays where it is."""
    move = model is not None and device.type != "cpu" and not is_sharded(model)
    if move:
        model.to(device)
    try:
        yield
    finally:
        if move:
            model.to("cpu")


# ------------------------------------------------------------------------------------------ scoring

def add_model_rewards(scorers: list[Scorer], cfg: RunConfig, completions: list[str], rows: list[dict],
                      keys: list[int], step: int, scores: list[float], stats: dict) -> tuple[list[float], dict]:
    """`scores` and `stats` of the function rewards (rewards.score_all's) with every reward model's and judge's
    weighted score added, failures counted the same way. `keys` name the samples within `step` (the policy
    samples' index in the step), the judges' sampling keys. Every training rank calls it, with or without rows:
    under sharding the models' forwards are collectives."""
    scores, stats = list(scores), {**stats, "failed": list(stats["failed"]), "by_reward": dict(stats["by_reward"])}
    for scorer in scorers:
        if isinstance(scorer, RewardModel):
            values, errors = reward_model_scores(scorer, [r["prompt"] for r in rows], completions, keys,
                                                 cfg.train.token_cap_per_micro_batch, dist.capacity())
            entry = _entry(values, errors)
        else:
            outputs, errors = judge_outputs(scorer, rows, completions, keys, step,
                                            alone=cfg.train.reproducibility == "bitwise")
            values, entry = _parse(scorer, cfg, outputs, errors, rows)
        for i, v in enumerate(values):
            if v is None:
                stats["failed"][i] = True
            else:
                scores[i] += scorer.weight * v
        for kind in FAILURE_KINDS:
            stats[kind] += entry[kind]
        stats["failures"] = sum(stats[kind] for kind in FAILURE_KINDS)
        stats["by_reward"][scorer.name] = entry
    return scores, stats


def reward_model_scores(rm: RewardModel, prompts: list[str], completions: list[str], keys: list[int], token_cap: int,
                        weights: list[float] | None = None) -> tuple[list[float | None], list[str | None]]:
    """The reward model's score of each (prompt, completion), or None with the reason where the input is longer
    than the model takes. `keys` name the samples over all ranks (their order is the samples' order).

    The step's inputs are cut into micro-batches of at most `token_cap` tokens over all ranks' samples at once, in
    key order (the update's packer, core.schedule, as one rank), and those micro-batches are then dealt to the ranks
    by their tokens (core.partition, `weights` the ranks' capacity): a sample meets the same batch-mates, in the same
    shapes, on any layout, so its score is the same bits on 1 or N ranks. The inputs' token ids go round once
    (an all-gather), the scores once."""
    inputs = [reward_model_input(rm.tokenizer, p, c) for p, c in zip(prompts, completions)]
    errors = [None if len(ids) <= rm.positions else f"raised: {len(ids)} tokens; the reward model takes "
              f"{rm.positions}" for ids in inputs]
    mine = [(k, ids) for k, ids, e in zip(keys, inputs, errors) if e is None]
    every = sorted((kv for part in dist.all_gather_object(mine) for kv in part), key=lambda kv: kv[0])
    micro = make_schedule([len(ids) for _, ids in every], world=1, token_cap=token_cap).minibatches[0].per_rank[0]
    micro = [m for m in micro if m.rows]
    share = balanced_partition([m.tokens for m in micro], dist.world(), weights=weights).parts[dist.rank()]
    runs = [micro[j].rows for j in share]
    if is_sharded(rm.model):  # every rank as many forwards as the busiest (empty ones are fillers)
        runs += [()] * (max(dist.all_gather_object(len(runs))) - len(runs))
    scored: dict[int, float] = {}
    pad = rm.tokenizer.pad_token_id
    with on_device(rm.model, rm.device), torch.no_grad():
        for rows in runs:
            batch = [every[i][1] for i in rows] or [[pad, pad]]
            width = max(len(ids) for ids in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, row in enumerate(batch):  # right padding: each row's tokens keep positions 0..n-1
                ids[j, :len(row)] = torch.tensor(row, dtype=torch.long)
                mask[j, :len(row)] = 1
            device = next(rm.model.parameters()).device
            logits = rm.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            scored.update({every[i][0]: float(logits[j, 0].float()) for j, i in enumerate(rows)})
    for part in dist.all_gather_object(scored):
        scored.update(part)
    return [scored[k] if e is None else None for k, e in zip(keys, errors)], errors


def reward_model_input(tokenizer, prompt: str, completion: str) -> list[int]:
    """(prompt, completion) as the reward model reads it: one user turn and one assistant turn through its chat
    template when it has one (TRL and OpenRLHF reward models are trained on such conversations), else the plain
    concatenation with the tokenizer's usual special tokens."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": completion}], tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt + completion, add_special_tokens=True)["input_ids"])


def judge_outputs(judge: Judge, rows: list[dict], completions: list[str], keys: list[int],
                  step: int, alone: bool = False) -> tuple[list[str | None], list[str | None]]:
    """The judge's text for each sample (None with the reason where its prompt does not fit the judge). `alone`
    (train.reproducibility=bitwise): one prompt per engine call, so a verdict does not depend on which samples a
    rank holds; a sharded judge then makes as many calls on every rank as the busiest."""
    spec = judge.spec
    prompts = [encode_prompt(judge.tokenizer, fill_template(spec.template, r["prompt"], c, r.get("answer")),
                             spec.use_chat_template) for r, c in zip(rows, completions)]
    errors = [None if 0 < len(p) and len(p) + spec.max_new_tokens <= judge.positions else
              f"raised: the judge's prompt has {len(p)} tokens (+{spec.max_new_tokens} to generate); the judge "
              f"takes {judge.positions}" for p in prompts]
    fits = [i for i, e in enumerate(errors) if e is None]
    params = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, seed=judge.seed)
    judge.engine.wake()
    calls = [[i] for i in fits] if alone else [fits]
    if alone and judge.model is not None and is_sharded(judge.model):
        calls += [[]] * (max(dist.all_gather_object(len(calls))) - len(calls))
    made = []
    with on_device(judge.model, judge.device):  # every rank generates: with sharding it is a collective
        for call in calls:
            made += judge.engine.generate([Request(prompts[i], keys[i], step) for i in call], params)
    judge.engine.sleep()
    outputs: list[str | None] = [None] * len(rows)
    for i, samples in zip(fits, made):
        outputs[i] = judge.tokenizer.decode(samples[0].token_ids, skip_special_tokens=True)
    return outputs, errors


def _parse(judge: Judge, cfg: RunConfig, outputs: list[str | None], errors: list[str | None],
           rows: list[dict]) -> tuple[list[float | None], dict]:
    """The judge's outputs read by its parser, contained like a reward call (rewards.score_all)."""
    done = [i for i, o in enumerate(outputs) if o is not None]
    rc = cfg.rewards
    parsed, pstats = score_all([(judge.parser, 1.0)], [outputs[i] for i in done], [rows[i] for i in done],
                               rc.timeout_s, isolate=rc.isolate, memory_limit_mib=rc.memory_limit_mib,
                               cpu_time_limit_s=rc.cpu_time_limit_s, sandbox=rc.sandbox)
    values: list[float | None] = [None] * len(outputs)
    for j, i in enumerate(done):
        values[i] = None if pstats["failed"][j] else parsed[j]
    entry = _entry(values, errors)  # the prompts that did not fit, then what the parser failed on
    for kind in FAILURE_KINDS:
        entry[kind] += pstats[kind]
    first = next(iter(pstats["by_reward"].values()), {}).get("first_error") if done else None
    entry["first_error"] = entry["first_error"] or first
    return values, entry


def _entry(values: list[float | None], errors: list[str | None]) -> dict:
    """One entry of stats["by_reward"], as score_all writes them: the raw mean (failures as 0), failures by kind,
    the first failure's message. `errors` hold "kind: message" for the samples that never reached the model."""
    entry = {"mean": sum(v for v in values if v is not None) / max(len(values), 1),
             **{kind: 0 for kind in FAILURE_KINDS}, "first_error": None}
    for e in errors:
        if e is not None:
            kind, _, message = e.partition(": ")
            entry[kind] += 1
            entry["first_error"] = entry["first_error"] or message
    return entry
