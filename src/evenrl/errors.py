"""Errors a user can fix. The CLI prints them as one line and exits with code 2, no traceback."""

import argparse


class UsageError(Exception):
    """Bad input: a config field, a file, a flag. The message names it, the value and what is allowed."""


def bad(field: str, value, allowed: str) -> UsageError:
    """Build the standard one-line message: `<field>: got <value>; <allowed>`."""
    return UsageError(f"{field}: got {shown(value)}; {allowed}")


def shown(value, limit: int = 80) -> str:
    """A user's value as a one-line message shows it: its repr, cut to `limit` characters in the middle (the end of
    a long path, its file's name, is what tells the user which file)."""
    text = repr(value)
    head = limit // 3
    return text if len(text) <= limit else text[:head] + "..." + text[len(text) - (limit - 3 - head):]


def first_line(e: BaseException) -> str:
    """An exception's first line of text (its type's name when it has none), for one-line messages."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def describe_error(e: BaseException) -> str:
    """`Type: message` of an exception on one line, for failures of contained calls and of imports."""
    try:
        return one_line(f"{type(e).__name__}: {e}")
    except Exception:  # a user exception whose __str__ fails
        return type(e).__name__


def one_line(text: str, limit: int = 200) -> str:
    """`text` with its whitespace runs as single spaces, cut to `limit` characters."""
    text = " ".join(text[: 2 * limit].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are UsageErrors: one line and exit code 2 through the CLI, no usage dump. Flags are
    spelled out: no abbreviations (`--nproc` for --nproc-per-node would break when another --nproc... flag came)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


class RunStopped(Exception):
    """The run cannot go on: a non-finite loss or gradient, a peer that stopped or died. The CLI prints one line
    and exits with code 3; the last good checkpoint is kept and nothing half-written replaces it."""


class NonFinite(RunStopped):
    """A non-finite loss or gradient norm: its cause may lie in the state the step started from (a resumed
    checkpoint's carried samples), so the last good checkpoint is one whose state is sound."""


class Interrupted(Exception):
    """The run stopped at a safe point on SIGINT or SIGTERM, after saving what it could. The CLI prints the message
    and how to resume as one line and exits with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, message: str, signum: int, *, resumable: bool = True):
        super().__init__(message)
        self.signum, self.resumable = signum, resumable
