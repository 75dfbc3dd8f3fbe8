"""Shell text as a launch script reader needs it, never run: quotes, comments, words and operators as bash splits
them (operators only from the script's own text), simple commands between operators, redirections dropped, if
conditions on known values, bash integer arithmetic, and glob patterns matched without backtracking (for ${v#pat},
${v//pat/rep}, ...). Reading is bounded (`Budget`): no script makes
it slow or large. Used by peers.script; never imports torch.
"""

from __future__ import annotations

import ast
import operator
import re

# Bounds on reading one script, so that no text makes it slow or large (its file is at most 1 MiB): characters of a
# variable's value or of one expanded line (shlex's time grows with the square of a word's length: 0.6 s at 200,000
# characters), expansions nested in expansions and `bash -c` in `bash -c`, and steps of work (characters scanned,
# pattern states advanced; the longest script of tests/peer_corpus takes 13,000). A count of steps, not a clock: a
# script is read, or refused, the same on any machine.
MAX_CHARS = 256 * 1024
MAX_DEPTH = 32
MAX_WORK = 4_000_000


class TooMuch(Exception):
    """Reading the script would pass one of the bounds above; the message says which and where."""


class Budget:
    """The steps of work left for one script."""

    def __init__(self, steps: int = MAX_WORK):
        self.left = steps

    def spend(self, steps: int, what: str) -> None:
        self.left -= steps
        if self.left < 0:
            raise TooMuch(f"{what} takes more work than the {MAX_WORK:,} steps a script may take to read")


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
    """Bash integer arithmetic (+ - * / %) in 64-bit integers as bash's (wrapping; / and % truncate toward zero);
    anything else stays as written."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return _int64(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            a, b = ev(node.left), ev(node.right)
            if type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
                q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)  # ZeroDivisionError: as written
                return _int64(q if type(node.op) is not ast.Mod else a - q * b)
            return _int64(_ARITH[type(node.op)](a, b))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return _int64(-ev(node.operand))
        raise ValueError
    try:
        return str(ev(ast.parse(expr.strip(), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return text


def _int64(v: int) -> int:
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)


class Op(str):
    """A control or redirection operator written in the script's own text. Bash finds operators before it expands
    anything, so an expansion's result (`M="<p>"; ... model.path=$M`) is words, never an Op."""


_OPERATORS = ("<<<", "&>>", "<<", ">>", ">&", "<&", "&>", ">|", "<>", "||", "&&", ";;", "|&", "|", "&", ";", "<", ">")
_CONTROL = {"|", "||", "&", "&&", ";", ";;", "|&"}
_PLAIN = re.compile(r"[^\s\\'\"|&;<>]+")
_QUOTED_PLAIN = re.compile(r'[^"\\]+')


def tokens(s: str, split: bool = True) -> list[str]:
    """Words (quotes and escapes removed) and operators (Op) as bash reads a line: a quoted or escaped character is
    part of a word, a blank ends one, `|&;<>` outside quotes make an operator (digits written right before a
    redirection are its descriptor: `2>&1`). split=False: one word, blanks kept (quote removal alone). A quote the
    line never closes (the script itself would fail on it): the line's blank-separated words as they stand."""
    out: list[str] = []
    word: list[str] = []
    quoted = False  # the word has a quoted part: "" is a word, nothing is not
    i, n = 0, len(s)

    def end():
        nonlocal quoted
        if word or quoted:
            out.append("".join(word))
        word.clear()
        quoted = False

    while i < n:
        c = s[i]
        if m := _PLAIN.match(s, i):
            word.append(m.group())
            i = m.end()
        elif c in " \t\n":
            if split:
                end()
            else:
                word.append(c)
            i += 1
        elif c == "\\":
            if i + 1 < n and s[i + 1] != "\n":
                word.append(s[i + 1])
                quoted = True
            i += 2
        elif c == "'":
            j = s.find("'", i + 1)
            if j < 0:
                return s.split() if split else [s]
            word.append(s[i + 1:j])
            quoted, i = True, j + 1
        elif c == '"':
            j = i + 1
            while j < n and s[j] != '"':
                if m := _QUOTED_PLAIN.match(s, j):
                    word.append(m.group())
                    j = m.end()
                elif j + 1 < n and s[j + 1] in '\\"$`\n':  # inside "...", a backslash escapes only these
                    word.append(s[j + 1] if s[j + 1] != "\n" else "")
                    j += 2
                else:
                    word.append("\\")
                    j += 1
            if j >= n:
                return s.split() if split else [s]
            quoted, i = True, j + 1
        else:  # |&;<>
            op = next(o for o in _OPERATORS if s.startswith(o, i))
            i += len(op)
            if not split:
                word.append(op)
                continue
            if op[0] in "<>" and word and not quoted and "".join(word).isdigit():
                op = "".join(word) + op  # 2>&1: the descriptor belongs to the redirection
                word.clear()
            end()
            out.append(Op(op))
    end()
    return out


def unquote(text: str) -> str:
    """Quote removal without word splitting: the value `${A:-"x y"}` or `${A:=word}` stands for."""
    return "".join(tokens(text, split=False))


def literal(value: str) -> str:
    """A value as text that tokens() reads back as the same characters, split only at blanks: what an unquoted
    expansion gives in bash (word splitting; quotes, backslashes and operator characters in the value are data)."""
    return re.sub(r"([\\'\"|&;<>])", r"\\\1", value)


def statements(toks: list[str]):
    """Simple commands between the script's control operators (; && || | &), with its redirections (an operator
    and the word after it) removed; an if's condition keeps its && and ||."""
    cur: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if not isinstance(t, Op):
            cur.append(t)
        elif t in _CONTROL and not (cur[:1] in (["if"], ["elif"], ["while"]) and t in ("&&", "||")):
            if cur:
                yield cur
            cur = []
        elif t in _CONTROL:
            cur.append(t)
        else:
            i += 1  # a redirection's target
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


# ------------------------------------------------------------------------------------------ glob patterns

def glob_items(pattern: str) -> list:
    """A bash glob as items: "*", "?", a literal character, or (negated, ranges) for a bracket expression; a
    backslash makes the next character literal."""
    items: list = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            items.append(("=", pattern[i + 1]))
            i += 2
            continue
        if c == "[":
            bracket = _bracket(pattern, i)
            if bracket is not None:
                item, i = bracket
                items.append(item)
                continue
        if c != "*" or items[-1:] != ["*"]:  # ** is *
            items.append(c if c in "*?" else ("=", c))
        i += 1
    return items


def _bracket(pattern: str, i: int):
    """((negated, ranges), index after it) for the bracket expression at pattern[i], or None if it has no end."""
    j = i + 1
    negated = j < len(pattern) and pattern[j] in "!^"
    j += negated
    ranges, first = [], True
    while j < len(pattern) and (pattern[j] != "]" or first):
        lo = pattern[j + 1] if pattern[j] == "\\" and j + 1 < len(pattern) else pattern[j]
        j += 2 if pattern[j] == "\\" else 1
        hi = lo
        if j + 1 < len(pattern) and pattern[j] == "-" and pattern[j + 1] != "]":
            hi, j = pattern[j + 1], j + 2
        ranges.append((lo, hi))
        first = False
    if j >= len(pattern):
        return None
    return (negated, tuple(ranges)), j + 1


def _fits(item, c: str) -> bool:
    if item == "?":
        return True
    if item[0] == "=":
        return item[1] == c
    negated, ranges = item
    return any(lo <= c <= hi for lo, hi in ranges) != negated


def match_ends(items: list, s: str, start: int, budget: Budget) -> list[int]:
    """Every end j >= start such that s[start:j] matches the glob `items`, ascending: the pattern run as a set of
    states over s once (no backtracking: steps <= characters x pattern items)."""
    m = len(items)

    def closed(states):
        out = set()
        for k in states:
            while k < m and items[k] == "*":
                out.add(k)
                k += 1
            out.add(k)
        return out

    states, ends = closed({0}), []
    j = start
    while True:
        if m in states:
            ends.append(j)
        if j == len(s) or not states:
            return ends
        budget.spend(len(states), "a pattern edit (${var//pattern/...}, ${var%%pattern}, ...)")
        c = s[j]
        states = closed({k if items[k] == "*" else k + 1 for k in states
                         if k < m and (items[k] == "*" or _fits(items[k], c))})
        j += 1


def edited(value: str, op: str, arg: str, budget: Budget) -> str:
    """${v//pat/rep}, ${v/pat/rep} (pat may start with # or %: anchored), ${v#pat}, ${v##pat}, ${v%pat},
    ${v%%pat}: bash's results, with bash's glob patterns."""
    if op in ("#", "##"):
        ends = match_ends(glob_items(arg), value, 0, budget)
        return value[(ends[0] if op == "#" else ends[-1]):] if ends else value
    if op in ("%", "%%"):  # the suffix: the reversed pattern over the reversed value
        ends = match_ends(glob_items(arg)[::-1], value[::-1], 0, budget)
        return value[:len(value) - (ends[0] if op == "%" else ends[-1])] if ends else value
    pat, rep = _split_replacement(arg)
    anchor = pat[:1] if pat[:1] in ("#", "%") else ""
    items = glob_items(pat[len(anchor):])
    if anchor == "#":
        ends = match_ends(items, value, 0, budget)
        return rep + value[ends[-1]:] if ends else value
    if anchor == "%":
        ends = match_ends(items[::-1], value[::-1], 0, budget)
        return value[:len(value) - ends[-1]] + rep if ends else value
    if not items:
        return value
    out, i = [], 0
    while i < len(value):
        ends = match_ends(items, value, i, budget)
        if ends and ends[-1] > i:  # the longest match from here, never an empty one
            out.append(rep)
            i = ends[-1]
            if op == "/":
                break
            continue
        if items[0] == "*":  # no match from here: none further on either (the leading * would have taken it)
            break
        out.append(value[i])
        i += 1
    out.append(value[i:])
    return "".join(out)


def _split_replacement(arg: str) -> tuple[str, str]:
    """pattern/replacement at the first unescaped /; \\/ in the replacement is a /."""
    i = 0
    while i < len(arg):
        if arg[i] == "\\":
            i += 2
            continue
        if arg[i] == "/":
            return arg[:i], arg[i + 1:].replace("\\/", "/")
        i += 1
    return arg, ""
