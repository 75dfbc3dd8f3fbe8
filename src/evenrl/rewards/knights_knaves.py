"""Knights and Knaves puzzles (Logic-RL): knights always tell the truth, knaves always lie; who is which?

sample fields: "prompt" (str), "names" (list of str), "solution" (dict name -> bool, True = knight),
"statements" (list of [speaker index, statement]; a statement is a JSON-friendly nested list:
["knight", i] | ["knave", i] | [op, s1, s2] with op in "and", "or", "iff", "implies").

The completion is read with str.find (its last <answer>) and one regular expression built from the puzzle's
re.escape'd names, `\\b(name|...)\\s+is\\s+an?\\s+(knight|knave)s?\\b` (no nested quantifiers).
"""

from __future__ import annotations

import itertools
import random
import re

from evenrl.rewards.format import last_tag

NAMES = ("Zoey", "Oliver", "Ethan", "Mia", "Liam", "Ava", "Noah", "Emma", "Lucas", "Sofia", "Jack", "Grace",
         "Leo", "Chloe", "Owen", "Lily")
_BINARY = ("and", "or", "iff", "implies")


def truth(statement: list, knights: tuple[bool, ...]) -> bool:
    """Value of a statement when knights[i] says whether person i is a knight."""
    kind = statement[0]
    if kind == "knight":
        return knights[statement[1]]
    if kind == "knave":
        return not knights[statement[1]]
    a, b = truth(statement[1], knights), truth(statement[2], knights)
    return {"and": a and b, "or": a or b, "iff": a == b, "implies": (not a) or b}[kind]


def consistent_assignments(statements: list, n_people: int) -> list[tuple[bool, ...]]:
    """All knight/knave assignments (brute force over 2^n) in which every speaker's statement is true iff the
    speaker is a knight."""
    return [
        knights
        for knights in itertools.product((True, False), repeat=n_people)
        if all(truth(s, knights) == knights[speaker] for speaker, s in statements)
    ]


def _render(statement: list, names: list[str]) -> str:
    kind = statement[0]
    if kind in ("knight", "knave"):
        return f"{names[statement[1]]} is a {kind}"
    a, b = _render(statement[1], names), _render(statement[2], names)
    if kind == "implies":
        return f"if {a} then {b}"
    return f"{a} {'if and only if' if kind == 'iff' else kind} {b}"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _random_statement(rng: random.Random, speaker: int, n_people: int) -> list:
    # A lone claim about oneself decides nothing ("I am a knight") or nothing is consistent ("I am a knave"),
    # so single atoms are about others; compound statements may mention the speaker.
    def atom(people) -> list:
        return [rng.choice(("knight", "knave")), rng.choice(people)]

    if rng.random() < 0.5:
        return atom([i for i in range(n_people) if i != speaker])
    everyone = range(n_people)
    return [rng.choice(_BINARY), atom(everyone), atom(everyone)]


def make_kk_problem(rng: random.Random, n_people: int = 3, max_tries: int = 10_000) -> dict:
    """A puzzle with exactly one consistent assignment: {"prompt", "names", "solution", "statements"}.

    rng: a `random.Random`.  Each person makes one statement: a claim about someone else, or two claims about
    anyone joined by and/or/iff/implies; random puzzles are redrawn until brute force finds a unique solution.
    """
    if not 2 <= n_people <= len(NAMES):
        raise ValueError(f"n_people must be in [2, {len(NAMES)}]; got {n_people}")
    for _ in range(max_tries):
        statements = [[i, _random_statement(rng, i, n_people)] for i in range(n_people)]
        solutions = consistent_assignments(statements, n_people)
        if len(solutions) == 1:
            break
    else:
        raise RuntimeError(f"no unique {n_people}-person puzzle in {max_tries} tries")
    names = rng.sample(NAMES, n_people)
    said = " ".join(f'{names[i]} says, "{_sentence(_render(s, names))}."' for i, s in statements)
    prompt = (
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves "
        f"always lie. You meet {n_people} inhabitants: {', '.join(names[:-1])} and {names[-1]}. {said} "
        "So who is a knight and who is a knave? Think in <think> </think> tags, then give one line per person "
        "inside <answer> </answer> tags, like:\n<answer>\n(1) NAME is a knight\n(2) NAME is a knave\n</answer>"
    )
    return {"prompt": prompt, "names": names, "solution": dict(zip(names, solutions[0])), "statements": statements}


def kk_reward(completion: str, sample: dict) -> float:
    """1.0 if the last <answer> says "<name> is a knight/knave" for every person, matching sample["solution"],
    else 0.0.  A person named both ways (hedging) or not at all is wrong; all-or-nothing like Logic-RL's answer
    score (its -2..2 scale and format score are left to the separate `format` reward and to weights)."""
    answer = last_tag(completion, "answer")
    solution: dict = sample["solution"]
    if answer is None or not solution:
        return 0.0
    names = sorted(solution, key=len, reverse=True)
    pattern = re.compile(rf"\b({'|'.join(map(re.escape, names))})\s+is\s+an?\s+(knight|knave)s?\b", re.IGNORECASE)
    canonical = {name.lower(): name for name in names}
    claims: dict[str, set[bool]] = {}
    for who, role in pattern.findall(answer):
        claims.setdefault(canonical[who.lower()], set()).add(role.lower() == "knight")
    ok = all(claims.get(name) == {bool(is_knight)} for name, is_knight in solution.items())
    return 1.0 if ok else 0.0
