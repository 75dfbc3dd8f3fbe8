"""The reward phase's model scoring on one process: a reward model over a step's samples one forward per sample,
in evenrl's token-capped micro-batches (train.reward_models.reward_model_scores) and in one padded batch (what TRL's
GRPOTrainer does with a reward model), side by side; then an LLM judge (the hf engine, greedy) over the same samples.

    .venv/bin/python benchmarks/reward_models.py            # 256 samples of 20-140 tokens, a 2.4 M-parameter model

Prints each way's time and its largest score difference from the one-sample-per-forward scores.
"""

from __future__ import annotations

import random
import tempfile
import time

import torch

from evenrl.config.rewards import JudgeSpec
from evenrl.engines import HFEngine
from evenrl.models.loading import load_policy, load_reward_model
from evenrl.rewards.judge import last_number
from evenrl.testing import make_tiny_model, make_tiny_reward_model
from evenrl.train.reward_models import Judge, RewardModel, judge_outputs, reward_model_input, reward_model_scores

SAMPLES, TOKEN_CAP = 256, 4096


def main() -> None:
    rng = random.Random(0)
    prompts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(SAMPLES)]
    completions = ["".join(rng.choice("0123456789 +-=abc") for _ in range(rng.randint(16, 136))) for _ in prompts]
    with tempfile.TemporaryDirectory() as d:
        model, tok = load_reward_model(make_tiny_reward_model(f"{d}/rm", hidden=256, layers=4), "rm")
        policy, ptok = load_policy(make_tiny_model(f"{d}/judge", hidden=256, layers=4))
    rm = RewardModel("model:rm", 1.0, model, tok, 512, torch.device("cpu"))
    inputs = [reward_model_input(tok, p, c) for p, c in zip(prompts, completions)]
    print(f"reward model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, {SAMPLES} samples of "
          f"{min(map(len, inputs))}-{max(map(len, inputs))} tokens, torch threads {torch.get_num_threads()}")

    def alone():
        return [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in inputs]

    def micro_batches():
        return reward_model_scores(rm, prompts, completions, list(range(SAMPLES)), TOKEN_CAP)[0]

    def one_batch():
        return reward_model_scores(rm, prompts, completions, list(range(SAMPLES)), 10**9)[0]

    with torch.no_grad():
        alone()  # warm-up
        ref = None
        for name, fn in (("one sample per forward", alone), (f"micro-batches of <= {TOKEN_CAP} tokens", micro_batches),
                         ("one padded batch", one_batch)):
            t0 = time.perf_counter()
            got = fn()
            dt = time.perf_counter() - t0
            ref = ref or got
            diff = max(abs(a - b) for a, b in zip(got, ref))
            print(f"  {name:<34} {dt * 1e3:8.0f} ms   {SAMPLES / dt:8.0f} samples/s   max |diff| {diff:.1e}")

    spec = JudgeSpec(template="Score 0-9. {question}{completion}\nScore:", max_new_tokens=8)
    judge = Judge("judge:tiny", 1.0, spec, HFEngine(policy, eos_token_ids={ptok.eos_token_id},
                                                    pad_token_id=ptok.pad_token_id), policy, ptok, last_number, 7,
                  512, torch.device("cpu"))
    rows = [{"prompt": p, "answer": ""} for p in prompts]
    t0 = time.perf_counter()
    judge_outputs(judge, rows, completions, list(range(SAMPLES)), step=1)
    dt = time.perf_counter() - t0
    print(f"judge (2.4 M params, hf engine, greedy, {spec.max_new_tokens} new tokens): {dt * 1e3:.0f} ms for "
          f"{SAMPLES} samples = {SAMPLES / dt:.0f} samples/s")


if __name__ == "__main__":
    main()
