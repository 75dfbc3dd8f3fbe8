"""Format reward: did the completion follow the `<think>...</think> <answer>...</answer>` template?

Parsing here is done with str.find, never with backtracking regexes, so the cost is linear in the completion length
whatever the model writes (a regex like `<think>.*?</think>` is quadratic on "<think>" * 10_000).
"""

from __future__ import annotations


def last_tag(text: str, tag: str) -> str | None:
    """Content of the last complete `<tag>...</tag>` pair (the last closing tag and the nearest opening before it).

    Same pick as `re.findall(r"<tag>(.*?)</tag>")[-1]` in TinyZero and Logic-RL, in linear time.  None if absent.
    """
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    opening = f"<{tag}>"
    start = text.rfind(opening, 0, close)
    if start < 0:
        return None
    return text[start + len(opening) : close]


def _with_prefilled_think(completion: str, sample: dict | None) -> str:
    # R1-Zero style prompts end with "<think>", so the model's completion starts inside the think block.
    prompt = (sample or {}).get("prompt")
    if isinstance(prompt, str) and prompt.rstrip().endswith("<think>"):
        return "<think>" + completion
    return completion


def format_reward(completion: str, sample: dict | None = None, strict: bool = False) -> float:
    """1.0 if the completion has the think/answer template, else 0.0.

    Lenient (default): somewhere in the completion, `<think>` ... the last `</think>`, then only whitespace, then
    `<answer>...</answer>`.  Text before or after is allowed (like Open-R1's `format` reward without anchors).
    strict=True: the whole completion, stripped, is `<think>X</think>\\s*<answer>Y</answer>` with each of the four
    tags exactly once and X, Y not blank (Logic-RL's tag-count check plus Open-R1's anchored pattern).
    If sample["prompt"] ends with "<think>", the completion is read as if it began with "<think>".
    """
    text = _with_prefilled_think(completion, sample)
    if strict:
        text = text.strip()
        if any(text.count(t) != 1 for t in ("<think>", "</think>", "<answer>", "</answer>")):
            return 0.0
        if not (text.startswith("<think>") and text.endswith("</answer>")):
            return 0.0
        think, _, rest = text[len("<think>") :].partition("</think>")
        rest = rest.lstrip()
        if not rest.startswith("<answer>"):
            return 0.0
        answer = rest[len("<answer>") : -len("</answer>")]
        return 1.0 if think.strip() and answer.strip() else 0.0
    end_think = text.rfind("</think>")
    if end_think < 0 or text.rfind("<think>", 0, end_think) < 0:
        return 0.0
    rest = text[end_think + len("</think>") :].lstrip()
    if not rest.startswith("<answer>"):
        return 0.0
    return 1.0 if rest.find("</answer>") >= 0 else 0.0


def strict_format_reward(completion: str, sample: dict | None = None) -> float:
    """`format_reward` with strict=True (registered as "format_strict")."""
    return format_reward(completion, sample, strict=True)
