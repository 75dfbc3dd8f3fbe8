"""Errors a user can fix. The CLI prints them as one line and exits with code 2, no traceback."""


class UsageError(Exception):
    """Bad input: a config field, a file, a flag. The message names it, the value and what is allowed."""


def bad(field: str, value, allowed: str) -> UsageError:
    """Build the standard one-line message: `<field>: got <value>; <allowed>`."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return UsageError(f"{field}: got {shown}; {allowed}")
