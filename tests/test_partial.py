"""Partial rollouts (rollout.partial), the pieces below a run: the carry rules (evenrl.core.carry), and the hf engine's
continuation of a sample cut at a token budget: its random draws go on at the next token position of its stream, so
a sample cut and continued under unchanged weights is the sample never cut, and under new weights each position is
what the policy of its round draws there (no position drawn twice, none skipped). The runs are in
tests/test_partial_runs.py; the per-token correction in tests/test_offpolicy.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from e2e import requests
from evenrl.core.carry import CarryRules, finishing_age, outcome, round_tokens
from evenrl.engines.base import Request
from evenrl.engines.hf import SamplingParams, generate, row_seed, sample_from_logits, uniforms
from evenrl.models.loading import load_policy
from evenrl.testing import make_tiny_model
from evenrl.rollout.carry import Carried, pack, unpack
from evenrl.train.data import encode_prompt

pytestmark = pytest.mark.usefixtures("one_thread")
PAD = 0


# ----------------------------------------------------------------------------------------- the carry rules

def test_round_budget_and_outcomes():
    wait, drop = CarryRules(3, 10, 2, "wait"), CarryRules(3, 10, 2, "drop")
    assert [round_tokens(wait, g, a) for g, a in ((0, 0), (3, 1), (6, 2), (9, 1))] == [3, 3, 4, 1]
    assert [round_tokens(drop, g, a) for g, a in ((0, 0), (3, 1), (6, 2))] == [3, 3, 3]
    assert outcome(drop, 3, 0, False) == "carried" and outcome(drop, 2, 0, True) == "done"
    assert outcome(drop, 9, 2, False) == "dropped" and outcome(wait, 10, 2, False) == "done"
    assert outcome(drop, 10, 1, False) == "done"  # cut at max_new_tokens: done, unfinished
    # a sample of length L is done at age ceil(L / B) - 1, unless the limit comes first
    assert [finishing_age(wait, n) for n in (1, 3, 4, 6, 7, 10)] == [0, 0, 1, 1, 2, 2]
    assert [finishing_age(drop, n) for n in (9, 10)] == [2, None]


# ----------------------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tok = load_policy(make_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3))
    prompts = [encode_prompt(tok, t, False) for t in ("7+8=", "countdown 3 5 7 to 15:", "12*3=")]
    return model, prompts


def test_uniform_offsets_continue_each_stream():
    seeds = np.array([row_seed(0, s, k, 1) for s, k in ((1, 0), (4, 2), (9, 7))], dtype=np.uint64)
    offsets = np.array([0, 3, 250], dtype=np.uint64)
    for t in (0, 1, 17):
        together = uniforms(seeds, t, offsets)
        for i in range(3):
            assert together[i] == uniforms(seeds[i:i + 1], t + int(offsets[i]))[0]


def _continue_in_rounds(model, prompt, key, step, params, budget, **kw):
    """One sample generated `budget` tokens at a time, each round re-prefilling prompt + its tokens so far."""
    tokens, logps = [], []
    while len(tokens) < params.max_new_tokens:
        cap = min(budget, params.max_new_tokens - len(tokens))
        [[c]] = generate(model, [Request(prompt + tokens, key, step, range(1, 2), first_token=len(tokens),
                                         max_tokens=cap)], params, eos_token_ids=set(), pad_token_id=PAD, **kw)
        assert len(c.token_ids) == cap
        tokens, logps = tokens + c.token_ids, logps + c.logprobs
    return tokens, logps


@pytest.mark.parametrize("decoder", ["lean", "static", "forward"])
def test_a_cut_sample_continued_with_unchanged_weights_is_the_uncut_one(tiny, decoder):
    """Cut every 3 tokens and continued (re-prefilled), a sample has the uncut sample's tokens position by position
    (and its log-probs to float rounding): the budget changes when tokens are drawn, never which."""
    model, prompts = tiny
    params = SamplingParams(max_new_tokens=11, temperature=1.0, top_p=0.9, samples_per_prompt=2, seed=4)
    whole = generate(model, requests(prompts, [5, 6, 7], 2), params, eos_token_ids=set(), pad_token_id=PAD,
                     decoder=decoder)
    for prompt, key, samples in zip(prompts, [5, 6, 7], whole):
        tokens, logps = _continue_in_rounds(model, prompt, key, 2, params, 3, decoder=decoder)
        assert tokens == samples[1].token_ids
        np.testing.assert_allclose(logps, samples[1].logprobs, atol=1e-5)
    assert len({tuple(s[1].token_ids) for s in whole}) == 3  # the samples differ: the comparison has teeth


def test_one_call_mixes_new_prompts_and_continued_samples(tiny):
    """New prompts (samples sharing a prefill) and continued samples of earlier steps, each with its own step,
    first token and cap, in one call: every row is what it is alone, and stops at its cap."""
    model, prompts = tiny
    params = SamplingParams(max_new_tokens=6, temperature=1.0, samples_per_prompt=3, seed=1)
    kw = dict(eos_token_ids=set(), pad_token_id=PAD)
    new, old = Request(prompts[0], 0, 5), Request(prompts[1] + [11, 12, 13, 14], 2, 3, range(2, 3), first_token=4,
                                                  max_tokens=2)
    alone_new, alone_old = generate(model, [new], params, **kw), generate(model, [old], params, **kw)
    mixed = generate(model, [new, old], params, **kw)
    assert [c.token_ids for c in mixed[0]] == [c.token_ids for c in alone_new[0]]
    assert mixed[1][0].token_ids == alone_old[0][0].token_ids and len(mixed[1][0].token_ids) == 2


def test_one_call_continues_trajectories_at_different_turns(tiny):
    """Trajectories cut at different turns continue in one call (rollout.env with rollout.partial): each row draws
    from its own turn's stream, as a call at that turn alone; the same prompt at another turn draws otherwise."""
    model, prompts = tiny
    params = SamplingParams(max_new_tokens=5, temperature=1.0, samples_per_prompt=3, seed=2)
    kw = dict(eos_token_ids=set(), pad_token_id=PAD)
    asks = dict(sample_ranges=[(1, 1)] * 3, first_token=[0, 2, 1])
    mixed = generate(model, requests(prompts, [0, 1, 2], [4, 3, 4], turn=[0, 2, 1], **asks), params, **kw)
    for i, req in enumerate(requests(prompts, [0, 1, 2], [4, 3, 4], turn=[0, 2, 1], **asks)):
        [[alone]] = generate(model, [req], params, **kw)
        assert mixed[i][0].token_ids == alone.token_ids
    other = generate(model, requests(prompts, [0, 1, 2], [4, 3, 4], turn=[1, 0, 2], **asks), params, **kw)
    assert [c[0].token_ids for c in other] != [c[0].token_ids for c in mixed]


def test_a_trajectorys_turn_loop_state_travels_packed():
    """What a rollout rank sends and a checkpoint holds of a trajectory in flight: its turn loop's state (messages,
    rendering, the environment's pickle, the reply it was cut in, rewards, the loss mask) back as it was, beside a
    single-turn sample's none."""
    talk = {"messages": [{"role": "user", "content": "2+2=\u00e9"}], "history": "<|im_start|>",
            "state": b"\x80\x04\x00", "reply": 3, "complete": False, "mask": "1110001", "turns": 1,
            "reward": 0.1 + 0.2, "failed": False, "error": None, "tool_calls": 2, "tool_errors": 1}
    ints = lambda n: torch.arange(n, dtype=torch.int32)  # noqa: E731
    records = [Carried(1, 0, 2, 5, 0, 1, ints(7), torch.rand(7), torch.ones(7, dtype=torch.int32), talk=talk),
               Carried(2, 1, 0, 6, 1, 0, ints(2), torch.rand(2), torch.ones(2, dtype=torch.int32))]
    back = unpack(pack(records))
    assert back[0].talk == talk and back[1].talk is None
    assert back[0].sampled_versions() == [1, 1, 1, 1] and back[0].key == (1, 0, 2)
    assert unpack(pack(records[1:]))[0].talk is None and "talk" not in pack(records[1:])


def _naive_draws(model, prompt, tokens, seed, first, n, temperature=1.0, top_p=1.0):
    """Position by position from a full forward of prompt + the tokens before it (no cache, no batch): the token the
    stream's uniform at that position picks, and its log-prob."""
    out, lps, ids = [], [], list(prompt) + list(tokens[:first])
    with torch.no_grad():
        for t in range(first, first + n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
            u = torch.from_numpy(uniforms(np.array([seed], dtype=np.uint64), t))
            tok, lp = sample_from_logits(logits, u, temperature, top_p)
            out.append(int(tok))
            lps.append(float(lp))
            ids.append(int(tok))
    return out, lps


def test_continuation_across_a_weight_change_position_by_position(tiny, tmp_path):
    """A sample cut after 4 tokens under weights W0 and continued under W1: its first 4 positions are W0's draws,
    the next ones W1's draws given those 4 (each against a naive full-forward sampler at that position's uniform),
    no position drawn twice or skipped; the continuation differs from what W0 would have drawn (the weights
    mattered)."""
    model, prompts = tiny
    w1, _ = load_policy(make_tiny_model(str(tmp_path / "w1"), seed=3))
    with torch.no_grad():
        for p in w1.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    params = SamplingParams(max_new_tokens=10, samples_per_prompt=1, seed=8)
    prompt, key, step = prompts[2], 4, 6
    [[first]] = generate(model, [Request(prompt, key, step, max_tokens=4)], params, eos_token_ids=set(),
                         pad_token_id=PAD)
    [[rest]] = generate(w1, [Request(prompt + first.token_ids, key, step, first_token=4, max_tokens=6)], params,
                        eos_token_ids=set(), pad_token_id=PAD)
    tokens, logps = first.token_ids + rest.token_ids, first.logprobs + rest.logprobs
    seed = row_seed(8, step, key, 0)
    want0, lp0 = _naive_draws(model, prompt, tokens, seed, 0, 4)
    want1, lp1 = _naive_draws(w1, prompt, tokens, seed, 4, 6)
    assert len(tokens) == 10 and tokens == want0 + want1
    np.testing.assert_allclose(logps, lp0 + lp1, atol=1e-5)
    stayed, _ = _naive_draws(model, prompt, tokens, seed, 4, 6)
    assert stayed != want1


# ----------------------------------------------------------------------------------------- the plan

def _simulate(rules, S, n, median, sigma, steps=400, seed=0):
    """Partial rollouts step by step on random lognormal lengths (whole groups of n): mean samples generated per
    step, decode steps per step, tokens held between steps (carried and waiting), dropped share; and the mean
    longest of S lengths (the synchronous step's decode steps)."""
    import random

    rnd = random.Random(seed)
    live, waiting, out = [], [], {"rows": [], "steps": [], "held": [], "sync": []}
    dropped = total = 0
    for t in range(steps):
        groups = [[min(rules.max_new, max(1, round(rnd.lognormvariate(np.log(median), sigma)))) for _ in range(n)]
                  for _ in range(S // n)]
        out["sync"].append(max(x for g in groups for x in g))
        new = [[t, i, L, 0] for i, g in enumerate(groups) for L in g]  # birth, group, length, tokens
        rows, most, done, gone = new + live, 0, [], set()
        live = []
        for r in rows:
            cap = round_tokens(rules, r[3], t - r[0])
            got = min(cap, r[2] - r[3])
            r[3] += got
            most = max(most, got)
            fate = outcome(rules, r[3], t - r[0], r[3] >= r[2])
            (done if fate == "done" else live if fate == "carried" else []).append(r)
            if fate == "dropped":
                dropped += 1
                gone.add((r[0], r[1]))
        total += len(new)
        waiting += done
        keys = {}
        for r in waiting:
            keys[(r[0], r[1])] = keys.get((r[0], r[1]), 0) + 1
        waiting = [r for r in waiting if keys[(r[0], r[1])] < n and (r[0], r[1]) not in gone]
        if t >= 3 * (rules.max_carry + 1):
            out["rows"].append(len(rows))
            out["steps"].append(most)
            out["held"].append(sum(r[3] for r in live + waiting))
    mean = {k: sum(v) / len(v) for k, v in out.items()}
    return mean, dropped / total


@pytest.mark.parametrize("at_limit,carry", [("wait", 7), ("wait", 2), ("drop", 2)])
def test_the_estimate_agrees_with_a_simulation_of_the_rules(at_limit, carry):
    """evenrl plan's numbers for partial rollouts (planner.partial.estimate) against a step-by-step simulation of
    the carry rules on random lengths: samples generated per step, decode steps of a step, tokens held between
    steps, the synchronous step's longest sample, the dropped share."""
    from evenrl.config import RunConfig
    from evenrl.core.carry import carry_rules
    from evenrl.planner.partial import estimate

    cfg = RunConfig.model_validate({"data": {"prompts_per_step": 16}, "rollout": {
        "samples_per_prompt": 4, "max_new_tokens": 2000, "partial": True, "tokens_per_round": 250,
        "max_carry_steps": carry, "at_max_carry": at_limit, "response_lengths": {"median": 300, "sigma": 1.0}}})
    est = estimate(cfg, replicas=2)
    sim, dropped = _simulate(carry_rules(cfg), 64, 4, 300, 1.0)
    assert est.rows == pytest.approx(sim["rows"], rel=0.05)
    assert est.sync_steps == pytest.approx(sim["sync"], rel=0.05)
    assert est.partial_steps == pytest.approx(sim["steps"], rel=0.05)
    assert est.held_tokens == pytest.approx(sim["held"], rel=0.05)  # measured within 0.5%
    assert est.dropped == pytest.approx(dropped, abs=0.01)
