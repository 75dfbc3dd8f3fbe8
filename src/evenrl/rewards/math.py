"""Math answer reward: extract the final answer, compare it with sample["answer"] using math-verify.

sample fields: "answer" (str or number; the gold final answer, LaTeX allowed, e.g. "\\frac{1}{2}" or "42";
a gold string containing \\boxed{...} is reduced to its last boxed content). Geometry3K-style answers work as
EasyR1's math score (mathruler) grades them: numbers and LaTeX values (2\\sqrt{3}, \\frac{40}{3}, 60^\\circ) by
equivalence, and a multiple-choice letter ("B", "(B)") against the choice a completion names first
("\\boxed{B}", "\\boxed{(B) 12}", "\\boxed{B: 12}").

What reads the completion: `extract_answer` (linear scans, no regex backtracking), then, for an answer of at most
MAX_ANSWER_CHARS, math-verify. Its `parse` reads LaTeX with latex2sympy2_extended (an ANTLR grammar building sympy
objects) and plain expressions (only digits, '.', whitespace and + - * × ÷ / ^ ( ) pass its pattern) with sympy's
`parse_expr(evaluate=False)`, which runs the rewritten text with eval(); `verify` compares the sympy objects and
can take unbounded time and memory. math-verify catches every Exception inside parse and verify, MemoryError
included, so an allocation past the reward worker's memory cap usually ends as "no match" (0 via the string check)
rather than a counted failure; the wall-clock and CPU-time limits of `evenrl.rewards.score_all` still end the call.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import signal
import threading

from evenrl.rewards.format import last_tag

# math-verify's own time limit (seconds), used only when nothing else bounds the call (see _math_verify_timeout).
MATH_VERIFY_TIMEOUT_S = 5
# Longer extracted answers skip math-verify (its LaTeX parser can take seconds on kilobytes of garbage) and are
# only compared as strings; real final answers are far shorter.
MAX_ANSWER_CHARS = 512

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
# A multiple-choice letter, alone or leading its choice's text: "B", "(B)", "\text{B}", "B. 12", "(B) 12", "B: 12".
_CHOICE = re.compile(r"\(?([A-Z])\)?(?:[.:)]|\s|$)")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` whose braces balance (escaped `\\{ \\}` don't count), else None.

    One left-to-right pass pairs every brace, so the cost stays linear even for "\\boxed{" * 10_000.
    """
    close_of: dict[int, int] = {}
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            close_of[stack.pop()] = i
        i += 1
    pos = text.rfind("\\boxed")
    while pos >= 0:
        brace = pos + len("\\boxed")
        while brace < n and text[brace] == " ":
            brace += 1
        if brace < n and text[brace] == "{" and brace in close_of:
            return text[brace + 1 : close_of[brace]]
        pos = text.rfind("\\boxed", 0, pos)
    return None


def extract_answer(completion: str) -> str | None:
    """Final answer of a completion: last balanced \\boxed{}, else last <answer>...</answer>, else last number."""
    boxed = last_boxed(completion)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    tagged = last_tag(completion, "answer")
    if tagged is not None and tagged.strip():
        return tagged.strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _normalise(s: str) -> str:
    s = s.strip().strip("$").strip()
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""), (" ", "")):
        s = s.replace(old, new)
    return s.rstrip(".")


def _as_float(s: str) -> float | None:
    if not _NUMBER.fullmatch(s) or "/" in s:
        return None
    value = float(s.replace(",", ""))
    return value if math.isfinite(value) else None


def _same(pred: str, gold: str) -> bool:
    """Cheap exact match after light LaTeX normalisation, or equal finite decimals."""
    p, g = _normalise(pred), _normalise(gold)
    if p and p == g:
        return True
    pf, gf = _as_float(p), _as_float(g)
    return pf is not None and gf is not None and math.isclose(pf, gf, rel_tol=1e-9, abs_tol=1e-9)


def _math_verify_timeout() -> int | None:
    """Time limit to hand math-verify, or None to switch its limit off.

    math-verify enforces its limit with signal.alarm, which only works in the main thread and, worse, ends with
    alarm(0): it would silently cancel an outer ITIMER_REAL such as the one `score_all` arms around every reward
    call.  So its limit is used only in the main thread with no outer timer running; otherwise the caller's limit
    (score_all's timer or its worker kill) is what bounds the call.
    """
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return None
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return MATH_VERIFY_TIMEOUT_S


class _DropTimeoutDisabledWarning(logging.Filter):
    # Switching math-verify's limit off is deliberate here (see above); its one-time warning would only alarm users.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.lru_cache(maxsize=1)
def _math_verify():
    """(parse, verify) from math-verify, or None if it is not installed; imported lazily (it pulls in sympy)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
    return parse, verify


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None):
    # A group's completions share one gold answer; parse it once.
    parse, _ = _math_verify()
    return parse("\\boxed{" + gold + "}", parsing_timeout=timeout)


def _choice(s: str) -> str | None:
    """The choice letter an answer names first, or None."""
    s = s.strip().strip("$").strip()
    if s.startswith("\\text{") and s.endswith("}"):
        s = s[len("\\text{"):-1].strip()
    m = _CHOICE.match(s)
    return m.group(1) if m else None


def answers_match(pred: str, gold: str) -> bool:
    """math-verify equivalence (symbolic/numeric), falling back to `_same` if math-verify is missing or fails; a
    gold choice letter matches the choice the prediction names first."""
    letter = _choice(gold)
    if letter is not None and len(_normalise(gold).strip("()")) == 1:
        return _choice(pred) == letter
    mv = _math_verify()
    if mv is not None and len(pred) <= MAX_ANSWER_CHARS:
        parse, verify = mv
        timeout = _math_verify_timeout()
        try:
            gold_parsed = _parse_gold(gold, timeout)
            pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=timeout)
            if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout):
                return True
        except Exception:  # math-verify's own errors (e.g. its timeout); the string check below still applies
            pass
    return _same(pred, gold)


def math_reward(completion: str, sample: dict) -> float:
    """1.0 if the completion's final answer equals sample["answer"] (math-verify, else exact match), else 0.0.

    Answer extraction: `extract_answer` (last \\boxed{}, else <answer> tag, else last number).
    """
    gold = str(sample["answer"])
    if "\\boxed" in gold:
        gold = last_boxed(gold) or gold
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, gold.strip()) else 0.0
