"""Greedy evaluation on held-out prompts, spread over ranks like the rollout (called by evenrl train).

The score is the mean summed reward over `eval.max_prompts` prompts with greedy decoding, so it shows what
the model does when it is not sampling; it is computed before the first step, every `eval.every_steps`
steps and after the last, and logged as `eval/reward`. With rollout.env each prompt is a greedy trajectory, scored
by its environment (`eval/response_length` then counts every token after the prompt).
"""

from __future__ import annotations

import torch

from evenrl.distributed import collectives as dist
from evenrl.distributed.weights import gathered
from evenrl.core.partition import balanced_partition
from evenrl.rewards import score_all
from evenrl.engines.base import SamplingParams
from evenrl.engines.hf import HFEngine, greedy
from evenrl.models.vision import prompt_image_inputs
from evenrl.train.reward_models import add_model_rewards


def evaluate(run, prompts) -> dict:
    """Greedy scores of `prompts` (a train.trainer.Prompts: rows, tokens, a vision-language model's images, and with
    rollout.env openings)."""
    cfg, rows, prompt_tokens = run.cfg, prompts.rows, prompts.tokens
    costs = [len(t) + cfg.response_tokens() for t in prompt_tokens]
    unit, units, keeps = dist.rollout_unit()  # a tensor-parallel group generates together; one rank scores
    mine = balanced_partition(costs, units, weights=dist.unit_weights(run.balance.rollout)).parts[unit]
    total = torch.zeros(3, dtype=torch.float64)  # summed reward, prompts, summed response length
    if run.turns is not None:  # every rank runs the turn loop, prompts or not (its engine calls gather the model)
        engine = HFEngine(run.model, eos_token_ids=run.eos_ids, pad_token_id=run.pad_id)
        trajectories = run.turns.generate(
            engine, [prompt_tokens[i] for i in mine], mine, SamplingParams(cfg.rollout.max_new_tokens, 0.0), step=0,
            sample_ranges=[(0, 1)] * len(mine), rows=[rows[i] for i in mine],
            openings=[prompts.openings[i] for i in mine])
        done = [t for ts in trajectories for t in ts]
        total += torch.tensor([sum(t.reward for t in done), len(done), sum(len(t.token_ids) for t in done)],
                              dtype=torch.float64)
    else:
        images = prompt_image_inputs(run.image_processor, prompts.images, mine)
        with gathered(run.model):  # sharded: whole on every rank while generating
            completions = greedy(run.model, [prompt_tokens[i] for i in mine],
                                 max_new_tokens=cfg.rollout.max_new_tokens, eos_token_ids=run.eos_ids,
                                 pad_token_id=run.pad_id, images=images) if mine else []
        texts = [run.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        scores, stats = score_all(run.reward_fns, texts, [rows[i] for i in mine], cfg.rewards.timeout_s,
                                  isolate=cfg.rewards.isolate, memory_limit_mib=cfg.rewards.memory_limit_mib,
                                  cpu_time_limit_s=cfg.rewards.cpu_time_limit_s, sandbox=cfg.rewards.sandbox)
        if run.scorers:  # every rank, prompts or not: the models' forwards are collectives when sharded
            scores, _ = add_model_rewards(run.scorers, cfg, texts, [rows[i] for i in mine], mine, 0, scores, stats)
        total += torch.tensor([sum(scores), len(scores), sum(len(c.token_ids) for c in completions)],
                              dtype=torch.float64)
    dist.all_reduce_sum(total if keeps else total.zero_())
    n = max(float(total[1]), 1.0)
    return {"eval/reward": float(total[0]) / n, "eval/response_length": float(total[2]) / n,
            "eval/prompts": int(total[1])}
