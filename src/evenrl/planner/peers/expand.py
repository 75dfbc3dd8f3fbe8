"""Parameter expansion for peers.script, against the variables a launch script has set so far, never run: `$A`,
`${A:-word}`, `${A:=word}`, `${A:+word}`, `${#A}`, `${A[@]}` and arrays, `${A#pat}` and the other edits
(peers.shell.edited), `$((arithmetic))`; `$(...)` stays unresolved. A variable the script never sets is kept as
`$NAME` and named (`unset`), the script's own arguments (`$@`, `$1`) are named in a note. The result is text
peers.shell.tokens splits as bash would. Bounded as the rest of the reading (peers.shell: value length, nesting,
steps of work).
"""

from __future__ import annotations

import re
import shlex

from evenrl.planner.peers.shell import (MAX_CHARS, MAX_DEPTH, Budget, TooMuch, arith, edited, literal, matching, scan,
                                        unquote)


class Variables:
    """A script's variables as read so far (`vars`: a string, or a list for an array) and their expansion into a
    line. `notes`: where a note for the reader goes; `found`: the trainer's command is read (a variable unset after
    it is not one its arguments need)."""

    def __init__(self, notes: list[str]):
        self.vars: dict[str, str | list[str]] = {}
        self.unset: set[str] = set()
        self.notes = notes
        self.found = False
        self.budget = Budget()
        self.depth = 0  # expansions inside expansions, `bash -c` inside `bash -c`

    def enter(self, what: str) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise TooMuch(f"{what} nested deeper than {MAX_DEPTH} levels")

    def expand(self, s: str, empty_unset: bool = False) -> str:
        self.enter("expansions (${A:-${B:-...}}, $((...)))")
        self.budget.spend(len(s), "expanding a line")
        try:
            out = self._expand(s, empty_unset)
        finally:
            self.depth -= 1
        if len(out) > MAX_CHARS:  # shlex's time grows with the square of a word's length
            raise TooMuch(f"a line would be longer than {MAX_CHARS:,} characters once expanded")
        return out

    def _expand(self, s: str, empty_unset: bool) -> str:
        """The line with its expansions done, as text tokens() reads as bash would: a value in double quotes stays
        one word, an unquoted one splits at blanks only (literal), "${A[@]}" gives one word per element."""
        out, i, size = [], 0, 0
        quoted = {j: q for j, _, q in scan(s)}
        while i < len(s):
            c = s[i]
            q = quoted.get(i, "")
            if c == "\\" and q != "'" and i + 1 < len(s):
                out.append(s[i:i + 2])
                i += 2
                continue
            if c != "$" or q == "'" or i + 1 >= len(s):
                out.append(c)
                i += 1
                continue
            value, i = self._dollar(s, i, empty_unset)
            text = _render(value, q == '"')
            out.append(text)
            size += len(text)
            if size > MAX_CHARS:  # before joining: `$A$A$A...` must not build gigabytes first
                raise TooMuch(f"a line would be longer than {MAX_CHARS:,} characters once expanded")
        return "".join(out)

    def _dollar(self, s: str, i: int, empty_unset: bool) -> tuple[str | Text | list[str], int]:
        if s.startswith("$((", i):
            end = matching(s, i + 1)
            expr = unquote(self.expand(s[i + 3:end - 1], empty_unset=True))
            expr = re.sub(r"\b([A-Za-z_]\w*)\b", lambda m: _scalar(self.vars.get(m.group(1), 0)) or "0", expr)
            return arith(expr, s[i:end + 1]), end + 1
        if s.startswith("$(", i):
            end = matching(s, i + 1)
            return "$(...)", end + 1
        if s.startswith("${", i):
            end = s.find("}", i)
            depth, j = 0, i + 2
            while j < len(s):  # nested ${A:-${B}}
                if depth > MAX_DEPTH:
                    raise TooMuch(f"expansions (${{A:-${{B:-...}}}}) nested deeper than {MAX_DEPTH} levels")
                if s.startswith("${", j):
                    depth += 1
                elif s[j] == "}":
                    if depth == 0:
                        end = j
                        break
                    depth -= 1
                j += 1
            if end < 0:
                return "$", i + 1
            return self._braced(s[i + 2:end], empty_unset), end + 1
        m = re.match(r"[A-Za-z_]\w*|[0-9@*#?$!-]", s[i + 1:])
        if not m:
            return "$", i + 1
        return _scalar(self._lookup(m.group(0), empty_unset)), i + 1 + m.end()

    def _braced(self, body: str, empty_unset: bool) -> str | Text | list[str]:
        edit = re.match(r"([A-Za-z_]\w*)(//|/|##|#|%%|%)(.*)$", body, re.S)
        if edit and edit.group(1) in self.vars:
            return edited(_scalar(self._lookup(edit.group(1), empty_unset)), edit.group(2),
                          self.expand(edit.group(3)), self.budget)
        m = re.match(r"(#?)([A-Za-z_]\w*|[0-9]+|[@*])(\[[^\]]*\])?(?:(:?[-=+?])(.*))?$", body, re.S)
        if not m:
            return "${" + body + "}"
        count, name, index, op, word = m.groups()
        value = self.vars.get(name)
        if isinstance(value, list):
            idx = (index or "[0]")[1:-1]
            if idx in ("@", "*"):
                return str(len(value)) if count else list(value) if idx == "@" else " ".join(value)
            value = value[int(idx)] if idx.isdigit() and int(idx) < len(value) else ""
        empty = value is None or (op or "").startswith(":") and value == ""
        if op and op.endswith(("-", "=")) and empty:
            text = Text(self.expand(word or ""))
            if op.endswith("="):
                self.vars[name] = unquote(text)
            return text
        if op and op.endswith("+"):
            return "" if empty else Text(self.expand(word or ""))
        if value is None and index in ("[@]", "[*]"):  # an array the script never sets (a sourced file's): no
            self._lookup(name, empty_unset)            # words, as in bash; the note names it
            return []
        if value is None:
            return _scalar(self._lookup(name, empty_unset))
        return str(len(value)) if count else value

    def _lookup(self, name: str, empty_unset: bool) -> str | list[str]:
        if name in ("@", "*") or name.isdigit() and name != "0":
            note = ("the script's own arguments ($@, $1, ...) are not known here: give them after FILE as "
                    "overrides")
            if note not in self.notes:
                self.notes.append(note)
            return ""
        value = self.vars.get(name)
        if value is None:
            if name in ("#", "?", "$", "!", "-", "0"):
                return "0"
            if not empty_unset and not self.found:  # what the trainer's arguments need, not what comes after
                self.unset.add(name)
            return "" if empty_unset else Text(f"${name}")
        return value


class Text(str):
    """Shell text an expansion gives back to be read again (the word of ${A:-word}, an unset variable's own
    $NAME): its quotes are syntax, where a variable's value is data."""


def _scalar(value: str | list[str]) -> str:
    """$A of an array is its first element, as in bash."""
    return (value[0] if value else "") if isinstance(value, list) else value


def _render(value: str | Text | list[str], in_quotes: bool) -> str:
    """An expansion's value as text for tokens(): a list is "${A[@]}"'s words (in double quotes: the quotes closed
    around them, so that each element is one word and the text before and after joins the first and the last)."""
    if isinstance(value, list):
        words = " ".join(shlex.quote(v) for v in value) if in_quotes else " ".join(map(literal, value))
        return f'"{words}"' if in_quotes else words
    if isinstance(value, Text):
        return unquote(value).replace("\\", "\\\\").replace('"', '\\"') if in_quotes else value
    return value.replace("\\", "\\\\").replace('"', '\\"') if in_quotes else literal(value)
