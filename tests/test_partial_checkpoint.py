"""A partial-rollout checkpoint's carried samples, checked when a run resumes from it (evenrl.rollout.carry_check):
each way of damaging them (lengths that do not add up, a token id past the vocabulary, a dataset row that does not
exist, NaN log-probs, a talk that does not fit its tokens) is named in one line, for single-turn samples, multi-turn
trajectories and agents' transcripts alike; a sound one passes. The resumed runs that refuse a damaged checkpoint
before rewriting their directory are in tests/test_partial_runs.py."""

from __future__ import annotations

import json

import pytest
import torch

from evenrl.agents.replay import Recorded, to_talk
from evenrl.config import load_config
from evenrl.rollout.carry import Carried, pack
from evenrl.rollout.carry_check import problem
from evenrl.train.checkpoint import last_good

EOS, VOCAB, ROWS, STEP = 2, 50, 10, 3
COMMON = ["rollout.partial=true", "rollout.max_new_tokens=8", "rollout.samples_per_prompt=2"]


def ints(*xs):
    return torch.tensor(xs, dtype=torch.int32)


def sample(birth, position, s, row, tokens, versions, *, ended=False, talk=None) -> Carried:
    return Carried(birth, position, s, row, 0, 0, ints(*tokens), -torch.rand(len(tokens)) - 0.1, ints(*versions),
                   ended, talk)


def single_turn():
    return load_config(None, COMMON), {
        "live": pack([sample(2, 0, 1, 3, [5, 6, 7], [1, 1, 2]), sample(3, 1, 0, 4, [9], [2])]),
        "pool": pack([sample(1, 0, 0, 7, [4, 8, EOS], [0, 1, 1], ended=True),
                      sample(2, 1, 1, 5, [3, EOS], [1, 1], ended=True)])}


def env_talk(n: int, complete: bool) -> dict:
    return {"messages": [{"role": "user", "content": "1+1"}], "history": "<user>1+1", "state": b"\x80\x04N.",
            "reply": 1, "complete": complete, "mask": "1" * (n - 1) + "0", "turns": 1, "reward": 0.5,
            "failed": False, "error": None, "tool_calls": 0, "tool_errors": 0}


def multi_turn():
    return load_config(None, [*COMMON, "rollout.env=calculator"]), {
        "live": pack([sample(3, 0, 1, 3, [5, 6, 7], [2, 2, 2], talk=env_talk(3, False)),
                      sample(3, 1, 1, 2, [11, 12], [2, 2], talk=env_talk(2, False))]),
        "pool": pack([sample(2, 1, 0, 4, [9, 10], [1, 2], talk=env_talk(2, True))])}


def agent_talk(calls: list[Recorded], complete: bool) -> dict:
    talk = to_talk(calls)[0]
    if complete:
        talk.update(complete=True, reward=1.0, failed=False, error=None, failure=None, truncated=False,
                    tool_calls=[0] * len(calls))
    return talk


def agents():
    two = [Recorded([1, 3], 4, [5, 6], [-0.5, -0.5], [1, 1], False, True), Recorded([1, 3, 5, 6, 7], 4, [8])]
    return load_config(None, [*COMMON, "rollout.agent=toy_agents:mixed"]), {
        "live": pack([sample(2, 0, 0, 3, [5, 6, 8], [1, 1, 2], talk=agent_talk(two, False)),
                      sample(2, 1, 0, 4, [5, 6, 8], [1, 1, 2], talk=agent_talk(two, False))]),
        "pool": pack([sample(1, 0, 1, 3, [5, 6, 8], [0, 0, 1], talk=agent_talk(two, True))])}


KINDS = {"single-turn": single_turn, "multi-turn": multi_turn, "agent": agents}


def check(cfg, carry):
    return problem(carry, cfg, step=STEP, vocab=VOCAB, rows=ROWS, eos={EOS})


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_sound_carry_passes(kind):
    cfg, carry = KINDS[kind]()
    assert check(cfg, carry) is None


def _lengths_off_by_3(carry):
    carry["live"]["lengths"][0] += 3


def _token_past_the_vocabulary(carry):
    carry["live"]["tokens"][1] = VOCAB + 7


def _row_that_does_not_exist(carry):
    carry["pool"]["meta"][0, 3] = ROWS + 5


def _every_logprob_nan(carry):
    for part in carry.values():
        part["logprobs"][:] = float("nan")


def _a_later_policy(carry):
    carry["live"]["versions"][0] = STEP


def _shifted_lengths(carry, part):  # the same total, one token moved from a sample to the one before it
    carry[part]["lengths"][0] += 1
    carry[part]["lengths"][1] -= 1


DAMAGE = {  # (damage, kinds it applies to, the line's needle)
    "lengths off by 3": (_lengths_off_by_3, KINDS, "carry.live: the lengths add up to"),
    "token id past the vocabulary": (_token_past_the_vocabulary, KINDS, "is not in the model's vocabulary (0..49)"),
    "row that does not exist": (_row_that_does_not_exist, KINDS, "its prompt is row 15 of the dataset, which has 10"),
    "every log-prob NaN": (_every_logprob_nan, KINDS, "log-probs are not finite"),
    "a later policy's token": (_a_later_policy, KINDS, "sampled by policy version 3, not before the checkpoint's "
                                                       "step 3"),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_each_damage_is_named_in_one_line(kind, damage):
    cfg, carry = KINDS[kind]()
    harm, _, needle = DAMAGE[damage]
    harm(carry)
    why = check(cfg, carry)
    assert why is not None and needle in why and "\n" not in why and len(why) < 200, why
    assert why.startswith("carry.") or " sample (step " in why.split(":")[0], why


def test_what_only_the_samples_own_state_can_tell():
    """A length moved between two samples keeps the total: a single-turn sample's end then falls off its EOS, a
    trajectory's tokens no longer match its loss mask or its transcript's calls."""
    for make, part, needle in ((single_turn, "pool", "its last token is not end-of-sequence"),
                               (multi_turn, "live", "loss mask has 3 entries for 4 tokens"),
                               (agents, "live", "its transcript's calls hold 3 tokens, the sample 4")):
        cfg, carry = make()
        _shifted_lengths(carry, part)
        assert needle in (check(cfg, carry) or ""), (make.__name__, check(cfg, carry))


def _edit_first_talk(part: dict, edit) -> None:
    """The first sample's talk (JSON) in a packed part changed by `edit(talk)`, the others kept."""
    raws = [bytes(x.tolist()) for x in torch.split(part["talk"], part["talk_lengths"].tolist())]
    talk = json.loads(raws[0].decode())
    edit(talk)
    raws[0] = json.dumps(talk).encode()
    part["talk"] = torch.tensor(list(b"".join(raws)), dtype=torch.uint8)
    part["talk_lengths"] = torch.tensor([len(r) for r in raws])


def test_a_talk_that_does_not_fit_the_run():
    cfg, carry = multi_turn()
    _edit_first_talk(carry["live"], lambda t: t.update(complete=True))  # in flight, yet complete
    assert "complete=True, yet it is in flight" in check(cfg, carry)
    assert "neither rollout.env nor rollout.agent" in check(single_turn()[0], multi_turn()[1])
    assert "talk is missing" in check(cfg, single_turn()[1])  # a single-turn checkpoint resumed multi-turn
    cfg, carry = agents()  # a transcript whose prompt names a token past the vocabulary
    _edit_first_talk(carry["live"], lambda t: t["calls"][0][0].__setitem__(1, VOCAB))
    assert "call 1 has a prompt token id outside the vocabulary" in check(cfg, carry)


def test_the_last_good_checkpoint_is_the_newest_whose_carry_is_sound(tmp_path):
    """After a non-finite loss, the checkpoint named to resume from is never one whose carried samples hold the
    cause (evenrl.train.loop)."""
    cfg, sound = single_turn()
    _, damaged = single_turn()
    _every_logprob_nan(damaged)
    root = tmp_path / "checkpoints"
    for step, carry in ((3, sound), (4, damaged)):
        d = root / f"step-{step:06d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"step": step, "time": 0}))
        torch.save({"param_groups": [], "step": step, "carry": carry}, d / "trainer.pt")
    kw = dict(vocab=VOCAB, rows=ROWS, eos={EOS})
    assert last_good(root, cfg, **kw).name == "step-000003"
    assert last_good(root, load_config(None, ["rollout.max_new_tokens=8"]), **kw).name == "step-000004"
    (root / "step-000003" / "trainer.pt").write_bytes(b"damaged")
    assert last_good(root, cfg, **kw) is None
