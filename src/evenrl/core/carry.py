"""The rules of partial rollouts (rollout.partial), pure and torch-free (the planner uses them too): how many tokens
an in-flight sample gets in a step, what becomes of it after the step, and how old its tokens can be.

A sample is born in the step that drew its prompt, and is generated in steps birth, birth + 1, ...; its age in a
step is step - birth. In each it gets at most B = rollout.tokens_per_round new tokens (`round_tokens`), except in
its last allowed step (age == max_carry_steps) with at_max_carry=wait, where it gets all it has left. After the
step (`outcome`) it is
  done      it ended (EOS) or reached rollout.max_new_tokens: trained once every sample of its group is done
  carried   continued in the next step, from its tokens, under the next step's policy
  dropped   age == max_carry_steps, at_max_carry=drop and still unfinished: its whole group is dropped
So a sample's tokens after any step, and the version that sampled each, follow from (birth, step, EOS positions)
alone, never from timing; a sample that is never cut has the tokens the same stream gives uncut (its random draws
are keyed by token position: evenrl.engines.base.Request's first_token).

A multi-turn trajectory (rollout.env) spends its step's B sampled tokens across turns (`step_budget`): its replies
and the environment's turns in between, until B are spent (cut inside a reply, continued there) or it is complete;
its `outcome` is done once complete, whatever its length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

OUTCOMES = ("done", "carried", "dropped")


@dataclass(frozen=True)
class CarryRules:
    budget: int     # B: new tokens per sample per step
    max_new: int    # a sample's most sampled tokens: rollout.max_new_tokens, or a trajectory's (cfg.sampled_tokens)
    max_carry: int  # rollout.max_carry_steps
    at_limit: str   # rollout.at_max_carry: wait | drop


def carry_rules(cfg) -> CarryRules:
    """The run's rules from its config: a sample's most tokens are what the engine samples for it (a completion, or
    with rollout.env all its turns' replies: cfg.sampled_tokens), tokens_per_round 0 a quarter of them, rounded up."""
    r, most = cfg.rollout, cfg.sampled_tokens()
    return CarryRules(budget=r.tokens_per_round or math.ceil(most / 4), max_new=most, max_carry=r.max_carry_steps,
                      at_limit=r.at_max_carry)


def round_tokens(rules: CarryRules, generated: int, age: int) -> int:
    """The most new tokens a sample holding `generated` tokens gets in a step at `age` (>= 1 while it is live)."""
    left = rules.max_new - generated
    if age >= rules.max_carry and rules.at_limit == "wait":
        return left
    return min(rules.budget, left)


def step_budget(rules: CarryRules, age: int) -> int | None:
    """The most tokens a multi-turn trajectory samples, over all its turns, in a step at `age` (None: no limit,
    its last allowed step with at_max_carry=wait); each reply stays within max_new_tokens."""
    return None if age >= rules.max_carry and rules.at_limit == "wait" else rules.budget


def outcome(rules: CarryRules, generated: int, age: int, ended: bool) -> str:
    """What a sample is after a step at `age` that left it with `generated` tokens (`ended`: its last is EOS)."""
    if ended or generated >= rules.max_new:
        return "done"
    return "dropped" if age >= rules.max_carry else "carried"


def finishing_age(rules: CarryRules, length: int) -> int | None:
    """The age at which a sample whose uncut response has `length` tokens (EOS included; max_new: never ends) is
    done, or None when it is dropped first."""
    generated, age = 0, 0
    while True:
        generated += round_tokens(rules, generated, age)
        if generated >= min(length, rules.max_new):
            return age
        if outcome(rules, generated, age, False) == "dropped":
            return None
        age += 1


def oldest_token_age(max_staleness: int, max_carry: int) -> int:
    """Steps between the trained policy and the oldest that can have sampled a token it trains on."""
    return max_staleness + max_carry
