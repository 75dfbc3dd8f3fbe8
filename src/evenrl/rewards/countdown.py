"""Countdown (TinyZero): combine the given numbers with + - * / to reach a target, each number used exactly once.

sample fields: "numbers" (list of int), "target" (int), "prompt" (str), "solution" (one valid equation, for
reference only).  The equation is read from the last <answer>...</answer> (at most MAX_EQUATION_CHARS), parsed with
`ast.parse(mode="eval")` (parsing only: the tree is never compiled or run), rejected unless every node is an integer
literal, + - * /, unary minus/plus or parentheses, and evaluated by a small walker over exact fractions.
"""

from __future__ import annotations

import ast
import random
from fractions import Fraction

from evenrl.rewards.format import last_tag

# Score for an answer that is a well-formed arithmetic expression but uses the wrong numbers or misses the target.
# TinyZero gives 0.1 to *any* text inside <answer> that fails; we give it only to expressions our grammar accepts,
# so tags around garbage (or around `__import__`/`**`) earn nothing.
FORMAT_SCORE = 0.1
# Longer "equations" are not parsed at all; a real one over 3-6 two-digit numbers is ~30 characters.
MAX_EQUATION_CHARS = 200

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


class _Rejected(Exception):
    """The text is not an expression of the allowed grammar."""


def parse_equation(text: str) -> ast.expr:
    """Parse and check an arithmetic expression; raises _Rejected unless it uses only the allowed nodes."""
    if len(text) > MAX_EQUATION_CHARS:
        raise _Rejected("too long")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise _Rejected(str(e)) from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp)):
            continue
        if type(node) in _OPS or isinstance(node, (ast.USub, ast.UAdd)):
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            continue
        raise _Rejected(type(node).__name__)
    return tree.body


def literals(node: ast.expr) -> list[int]:
    """Integer literals of a checked expression, left to right."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]


def evaluate(node: ast.expr) -> Fraction:
    """Exact value of a checked expression (ZeroDivisionError on x / 0)."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    return _OPS[type(node.op)](evaluate(node.left), evaluate(node.right))


def countdown_reward(completion: str, sample: dict) -> float:
    """1.0 if the last <answer> is an expression using each of sample["numbers"] exactly once and equal to
    sample["target"]; FORMAT_SCORE (0.1) if it is a well-formed expression that fails; 0.0 otherwise.
    TinyZero `verl/utils/reward_score/countdown.py` (format_score 0.1, score 1.0)."""
    answer = last_tag(completion, "answer")
    if answer is None or not answer.strip():
        return 0.0
    try:
        expr = parse_equation(answer)
    except _Rejected:
        return 0.0
    if sorted(literals(expr)) != sorted(int(x) for x in sample["numbers"]):
        return FORMAT_SCORE
    try:
        value = evaluate(expr)
    except ZeroDivisionError:
        return FORMAT_SCORE
    return 1.0 if value == Fraction(int(sample["target"])) else FORMAT_SCORE


def make_countdown_problem(
    rng: random.Random, n_numbers: int | None = None, max_number: int = 99, max_target: int = 999
) -> dict:
    """A solvable Countdown problem: {"numbers", "target", "prompt", "solution"}.

    rng: a `random.Random` (seed it for reproducible data).  n_numbers defaults to 3 or 4 (TinyZero's
    Countdown-Tasks-3to4).  The target is built by combining random pairs of the numbers with random operations
    (positive integer intermediate results only), so a solution using every number exactly once exists.
    """
    n = n_numbers if n_numbers is not None else rng.choice((3, 4))
    if n < 2:
        raise ValueError(f"n_numbers must be >= 2; got {n}")
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(n)]
        pool = [(Fraction(x), str(x)) for x in numbers]
        while len(pool) > 1:
            (a, ea), (b, eb) = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
            if a < b:
                (a, ea), (b, eb) = (b, eb), (a, ea)
            choices = [("+", a + b), ("*", a * b)]
            if a > b:
                choices.append(("-", a - b))
            if a % b == 0:
                choices.append(("/", a / b))
            op, value = rng.choice(choices)
            pool.append((value, f"({ea} {op} {eb})"))
        target, solution = pool[0]
        if 1 <= target <= max_target:
            break
    solution = solution[1:-1]
    prompt = (
        f"Using the numbers {numbers}, create an equation that equals {int(target)}. You can use basic arithmetic "
        "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
        "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
    )
    return {"numbers": numbers, "target": int(target), "prompt": prompt, "solution": solution}
