"""User reward functions for the end-to-end tests (referenced as toy_rewards:name, with tests/ on PYTHONPATH)."""


def digit_fraction(completion: str, sample: dict) -> float:
    """Share of characters that are digits: a random tiny model gets varied scores, so advantages are non-zero."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def fails_on_some(completion: str, sample: dict) -> float:
    """Raises on about a quarter of completions (chosen by their characters, so the same ones on any layout) and
    scores the rest 0, 0.25, ..., 1: a reward failing on some samples, for rewards.on_failure."""
    code = sum(map(ord, completion))
    if code % 4 == 0:
        raise ValueError(f"deliberate failure on {completion!r}")
    return (code % 5) / 4


def mostly_solved(completion: str, sample: dict) -> float:
    """1 for every completion of a prompt whose first number is below 7 (about 70% of the addition prompts: their
    groups are all-correct and carry no group advantage), else digit_fraction: for dynamic sampling."""
    if int(sample["prompt"].split("+")[0]) < 7:
        return 1.0
    return digit_fraction(completion, sample)


def orphans(completion: str, sample: dict) -> float:
    """Starts int(completion) children that each fork a grandchild (`sleep 77.25`) and exit: orphans, reparented to
    the PID 1 of the worker's namespace. Returns how many it started."""
    import os

    n = 0
    for _ in range(int(completion)):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "77.25"])
            os._exit(0)
        os.waitpid(pid, 0)
        n += 1
    return float(n)
