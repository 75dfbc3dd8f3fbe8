"""Shell text as a launch script reader needs it, never run: quotes, comments, words (shlex's), simple commands
between operators, redirections dropped, if conditions on known values, and bash integer arithmetic.
Used by peers.script; never imports torch.
"""

from __future__ import annotations

import ast
import operator
import re
import shlex

_OPS = {"|", "||", "&", "&&", ";", ";;"}
_REDIRECT = re.compile(r"^[0-9]*(>|>>|<|&>|&>>|>&|<<<)$")


def scan(s: str):
    """(index, char, quote) over s: quote is '', "'" or '"' (the quote the char sits in)."""
    quote, i = "", 0
    while i < len(s):
        c = s[i]
        if quote == "'":
            if c == "'":
                quote = ""
        elif c == "\\" and i + 1 < len(s):
            yield i, c, quote
            i += 1
            c = s[i]
        elif quote == '"':
            if c == '"':
                quote = ""
        elif c in "'\"":
            quote = c
        yield i, c, quote
        i += 1


def strip_comment(s: str) -> str:
    for i, c, q in scan(s):
        if c == "#" and not q and (i == 0 or s[i - 1] in " \t;"):
            return s[:i]
    return s


def open_quote(s: str) -> bool:
    last = ""
    for _, c, q in scan(s):
        last = q
    return bool(last)  # the quote the last character sits in (an opening quote counts; a closing one not)


def balanced_parens(s: str) -> bool:
    depth = 0
    for _, c, q in scan(s):
        if not q:
            depth += (c == "(") - (c == ")")
    return depth <= 0


def matching(s: str, i: int) -> int:
    """Index of the parenthesis closing the one at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] == "(") - (s[j] == ")")
        if depth == 0:
            return j
    return len(s) - 1


_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
          ast.Div: operator.floordiv, ast.Mod: operator.mod}


def arith(expr: str, text: str) -> str:
    """Bash integer arithmetic (+ - * / %); anything else stays as written."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            return _ARITH[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError
    try:
        return str(ev(ast.parse(expr.strip(), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return text


def tokens(s: str) -> list[str]:
    lex = shlex.shlex(s, posix=True, punctuation_chars="|&;<>")
    lex.whitespace_split, lex.commenters = True, ""
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote the script itself would fail on: its words as they stand
        return s.split()


def statements(toks: list[str]):
    """Simple commands between ; && || | & with redirections removed; an if's condition keeps its && and ||."""
    cur: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if t in _OPS and not (cur[:1] in (["if"], ["elif"], ["while"]) and t in ("&&", "||")):
            if cur:
                yield cur
            cur = []
        elif _REDIRECT.match(t) or t in (">", ">>", "<", "&>", ">&", "&>>"):
            if cur and cur[-1].isdigit() and i > 0 and toks[i - 1] == cur[-1]:
                cur.pop()  # the descriptor of `2>&1`, which shlex splits from its operator
            i += 1  # and its target
        elif re.fullmatch(r"[0-9]?>&?[0-9]+|[0-9]?>>?\S+|&>>?\S+", t):
            pass
        else:
            cur.append(t)
        i += 1
    if cur:
        yield cur


def condition(toks: list[str], word: str = "if") -> tuple[bool, str]:
    """An if condition from the script's own values: (taken, a note when it could not be decided)."""
    toks = [t for t in toks if t not in ("then", "[", "]", "[[", "]]", "test")]
    text = " ".join(t if t else '""' for t in toks)
    result: bool | None = None
    joiner, part = "", []
    for t in toks + ["&&"]:
        if t in ("&&", "||"):
            if result is not None and result == (joiner == "||"):
                joiner, part = t, []  # decided already, as bash's && and || stop early
                continue
            value = _test(part)
            if value is None:
                return True, f"could not decide `{word} {text}` from the script's values; took that branch"
            result = value
            joiner, part = t, []
        else:
            part.append(t)
    return bool(result), (f"took the branch of `{word} {text}` (the script's values)" if result else
                          f"passed over the branch of `{word} {text}` (the script's values)")


def _test(toks: list[str]) -> bool | None:
    neg = False
    while toks and toks[0] == "!":
        neg, toks = not neg, toks[1:]
    out: bool | None = None
    if len(toks) == 3 and toks[1] in ("=", "==", "!="):
        out = (toks[0] == toks[2]) != (toks[1] == "!=")
    elif len(toks) == 3 and toks[1] in ("-eq", "-ne", "-gt", "-ge", "-lt", "-le"):
        try:
            a, b = int(toks[0]), int(toks[2])
        except ValueError:
            return None
        out = {"-eq": a == b, "-ne": a != b, "-gt": a > b, "-ge": a >= b, "-lt": a < b, "-le": a <= b}[toks[1]]
    elif len(toks) == 2 and toks[0] in ("-z", "-n"):
        out = (toks[1] == "") == (toks[0] == "-z")
    elif len(toks) == 1:
        out = toks[0] not in ("", "false")
    elif not toks:
        out = False
    return None if out is None else out != neg
