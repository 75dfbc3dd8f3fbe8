"""What an LLM judge reward needs besides the model: its prompt, filled from a sample, and the parsers that read its
output as a number (rewards.functions entries `{judge: {template, parser, ...}}`; the model side is
evenrl.train.reward_models).

A parser is `fn(judge_output: str, sample: dict) -> float`, the shape of a reward, so that `score_all` runs it
contained like any reward call: an output it cannot read raises, and the sample's reward call counts as failed
(rewards.on_failure decides what happens to it). Pure text, no torch.
"""

from __future__ import annotations

import re

from evenrl.errors import UsageError, bad
from evenrl.errors import one_line
from evenrl.rewards.registry import RewardFn, resolve

# Longest judge output a parser reads: a verdict is short; a judge that rambles is cut, not scanned whole.
MAX_OUTPUT_CHARS = 4096
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def fill_template(template: str, question: str, completion: str, answer) -> str:
    """The judge's prompt: {question}, {completion} and {answer} replaced in one pass, so braces inside the sample's
    own text are never read as placeholders."""
    values = {"{question}": question, "{completion}": completion, "{answer}": "" if answer is None else str(answer)}
    return re.sub(r"\{question\}|\{completion\}|\{answer\}", lambda m: values[m.group(0)], template)


def _numbers(output: str) -> list[str]:
    found = _NUMBER.findall(output[:MAX_OUTPUT_CHARS])
    if not found:
        raise ValueError(f"no number in the judge's output {one_line(repr(output), 80)}")
    return found


def last_number(output: str, sample: dict) -> float:
    """The last number the judge wrote ("... so the score is 7" -> 7.0)."""
    return float(_numbers(output)[-1])


def first_number(output: str, sample: dict) -> float:
    """The first number the judge wrote ("8/10, because ..." -> 8.0)."""
    return float(_numbers(output)[0])


def yes_no(output: str, sample: dict) -> float:
    """1.0 when the first of the words yes/no the judge wrote (any case) is yes, 0.0 when it is no."""
    m = _YES_NO.search(output[:MAX_OUTPUT_CHARS])
    if m is None:
        raise ValueError(f"neither yes nor no in the judge's output {one_line(repr(output), 80)}")
    return 1.0 if m.group(1).lower() == "yes" else 0.0


PARSERS: dict[str, RewardFn] = {"last_number": last_number, "first_number": first_number, "yes_no": yes_no}


def resolve_parser(spec: str, field: str = "judge parser") -> RewardFn:
    """A built-in parser by name (a key of PARSERS) or a user function 'package.module:function'; `field` names the
    config entry in the one-line error."""
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" not in spec:
        raise bad(field, spec, f"one of {', '.join(PARSERS)}, or 'package.module:function'")
    try:
        return resolve(spec)
    except UsageError as e:
        raise UsageError(f"{field}: {str(e).partition(': ')[2]}") from None
