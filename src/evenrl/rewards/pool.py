"""`score_all`, the safe runner of rewards: every reward call is a contained call (evenrl.isolation.pool: a wall-clock
limit and, in worker processes, a CPU-time limit and a memory cap), so that a reward that raises, hangs, crashes or
runs out of memory costs its completion's score, not the run. How each limit works: docs/rewards.md.
"""

from __future__ import annotations

import numbers
import time
from math import isfinite, nan

from evenrl.errors import one_line
from evenrl.isolation.pool import FAILURE_KINDS, Limits, run_contained
from evenrl.rewards.registry import RewardFn, reward_name

__all__ = ["FAILURE_KINDS", "score_all"]


def score_all(
    fns_with_weights: list[tuple[RewardFn, float]],
    completions: list[str],
    samples: list[dict],
    timeout_s: float = 10.0,
    *,
    isolate: bool = True,
    memory_limit_mib: int = 0,
    cpu_time_limit_s: float | None = None,
    sandbox: str = "tools",
) -> tuple[list[float], dict]:
    """Weighted sum of rewards per completion: scores[i] = sum_k w_k * fn_k(completions[i], samples[i]).

    Limits per call: `timeout_s` of wall-clock time (always), `cpu_time_limit_s` of CPU time (None: timeout_s) and
    a `memory_limit_mib` cap on the worker process (0: none); the last two hold only in worker processes, never
    for calls run inline in the caller (isolate=False, or a reward that cannot be sent to a worker). sandbox:
    rewards.sandbox ("all": the workers run in the sandbox, docs/sandbox.md).

    A failed call contributes 0.  stats:
      "failures", "raised", "bad_value", "timeout", "memory", "cpu": failed calls in total and by kind (ints);
      "failed": per completion, whether any of its calls failed (list of bool);
      "by_reward": {name: {"mean": raw mean over completions, failures as 0; one count per failure kind;
                   "first_error": the first failure's one-line message or None}};
      "seconds": wall time; "isolated": whether worker processes were used.
    """
    if len(completions) != len(samples):
        raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
    start = time.perf_counter()
    fns = [fn for fn, _ in fns_with_weights]
    n = len(completions)
    jobs = [(k * n + i, k, (c, s)) for k in range(len(fns)) for i, (c, s) in enumerate(zip(completions, samples))]
    limits = Limits(timeout_s, timeout_s if cpu_time_limit_s is None else cpu_time_limit_s, memory_limit_mib, sandbox)
    results, isolated = run_contained(fns, jobs, limits, isolate=isolate, what="reward")
    results = {job_id: _as_score(kind, value) for job_id, (kind, value) in results.items()}
    return _summarise(fns_with_weights, n, results, time.perf_counter() - start, isolated)


def _as_score(kind: str, value) -> tuple[str, object]:
    """A finished call's value as a score: a finite real number, else a bad value."""
    if kind != "ok":
        return kind, value
    if isinstance(value, numbers.Real):
        try:
            value = float(value)
        except (OverflowError, TypeError, ValueError):
            value = nan
        if isfinite(value):
            return "ok", value
    return "bad_value", f"returned {_short_repr(value)}"


def _summarise(fns_with_weights, n, results, seconds, isolated) -> tuple[list[float], dict]:
    scores = [0.0] * n
    failed = [False] * n
    stats: dict = {kind: 0 for kind in FAILURE_KINDS}
    stats["by_reward"] = {}
    for k, (fn, weight) in enumerate(fns_with_weights):
        name = reward_name(fn)
        while name in stats["by_reward"]:  # the same function listed twice
            name += "'"
        entry = {"mean": 0.0, **{kind: 0 for kind in FAILURE_KINDS}, "first_error": None}
        total = 0.0
        for i in range(n):
            kind, value = results[k * n + i]
            if kind == "ok":
                total += value
                scores[i] += weight * value
            else:
                failed[i] = True
                entry[kind] += 1
                stats[kind] += 1
                entry["first_error"] = entry["first_error"] or value
        entry["mean"] = total / n if n else 0.0
        stats["by_reward"][name] = entry
    stats["failures"] = sum(stats[kind] for kind in FAILURE_KINDS)
    stats["failed"] = failed
    stats["seconds"] = seconds
    stats["isolated"] = isolated
    return scores, stats


def _short_repr(value) -> str:
    try:
        return one_line(repr(value))
    except Exception:
        return f"<unprintable {type(value).__name__}>"
