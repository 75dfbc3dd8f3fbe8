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
from evenrl.core.canonical import prompt_batches
from evenrl.core.partition import balanced_partition
from evenrl.distributed.exact import canonical_sum
from evenrl.rewards import score_all
from evenrl.engines.base import Request, SamplingParams
from evenrl.engines.hf import HFEngine, greedy
from evenrl.models.vision import prompt_image_inputs
from evenrl.train.reward_models import add_model_rewards


def evaluate(run, prompts) -> dict:
    """Greedy scores of `prompts` (a train.trainer.Prompts: rows, tokens, a vision-language model's images, and with
    rollout.env openings). Under train.reproducibility=bitwise the prompts go in canonical batches
    (rollout.batch_prompts consecutive ones, dealt whole: core.canonical) and the batches' scores are added in their
    order (distributed.exact.canonical_sum), so the numbers are the same bits on any layout."""
    cfg, prompt_tokens = run.cfg, prompts.tokens
    costs = [len(t) + cfg.response_tokens() for t in prompt_tokens]
    unit, units, keeps = dist.rollout_unit()  # a tensor-parallel group generates together; one rank scores
    weights = dist.unit_weights(run.balance.rollout)
    bitwise = cfg.train.reproducibility == "bitwise"
    if bitwise:
        every = prompt_batches(len(prompt_tokens), cfg.rollout.batch_prompts)
        dealt = balanced_partition([sum(costs[i] for i in b) for b in every], units, weights=weights).parts \
            if every else [[] for _ in range(units)]
        batches = [[every[j] for j in part] for part in dealt]
    else:
        batches = [[part] for part in balanced_partition(costs, units, weights=weights).parts]
    calls = max(len(b) for b in batches)  # every rank as many turn loops (their engine calls gather the model)
    mine = batches[unit] + [[]] * (calls - len(batches[unit]))
    if run.turns is None:
        with gathered(run.model):  # sharded: whole on every rank while generating
            totals = [_score_greedy(run, prompts, b) for b in mine]
    else:
        totals = [_score_trajectories(run, prompts, b) for b in mine]
    if bitwise:
        keyed = [(b[0], t) for b, t in zip(mine, totals) if b and keeps]
        total = torch.tensor(canonical_sum([k for k, _ in keyed], [t for _, t in keyed], 3), dtype=torch.float64)
    else:
        total = torch.tensor(totals[0], dtype=torch.float64)
        dist.all_reduce_sum(total if keeps else total.zero_())
    n = max(float(total[1]), 1.0)
    return {"eval/reward": float(total[0]) / n, "eval/response_length": float(total[2]) / n,
            "eval/prompts": int(total[1])}


def _score_trajectories(run, prompts, mine: list[int]) -> list[float]:
    """[summed reward, prompts, summed length] of greedy trajectories from the prompts `mine` (every rank runs the
    turn loop, prompts or not)."""
    cfg = run.cfg
    engine = HFEngine(run.model, eos_token_ids=run.eos_ids, pad_token_id=run.pad_id)
    trajectories = run.turns.generate(
        engine, [Request(prompts.tokens[i], i, 0, range(1)) for i in mine],
        SamplingParams(cfg.rollout.max_new_tokens, 0.0), rows=[prompts.rows[i] for i in mine],
        openings=[prompts.openings[i] for i in mine])
    done = [t for ts in trajectories for t in ts]
    return [sum(t.reward for t in done), len(done), sum(len(t.token_ids) for t in done)]


def _score_greedy(run, prompts, mine: list[int]) -> list[float]:
    """[summed reward, prompts, summed length] of one greedy completion of each of the prompts `mine`, scored by
    the reward functions and models (every rank scores, prompts or not: the models' forwards are collectives when
    sharded)."""
    cfg, rows = run.cfg, prompts.rows
    images = prompt_image_inputs(run.image_processor, prompts.images, mine)
    completions = greedy(run.model, [prompts.tokens[i] for i in mine], max_new_tokens=cfg.rollout.max_new_tokens,
                         eos_token_ids=run.eos_ids, pad_token_id=run.pad_id, images=images) if mine else []
    texts = [run.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
    scores, stats = score_all(run.reward_fns, texts, [rows[i] for i in mine], cfg.rewards.timeout_s,
                              isolate=cfg.rewards.isolate, memory_limit_mib=cfg.rewards.memory_limit_mib,
                              cpu_time_limit_s=cfg.rewards.cpu_time_limit_s, sandbox=cfg.rewards.sandbox)
    if run.scorers:
        scores, _ = add_model_rewards(run.scorers, cfg, texts, [rows[i] for i in mine], mine, 0, scores, stats)
    return [sum(scores), len(scores), sum(len(c.token_ids) for c in completions)]
