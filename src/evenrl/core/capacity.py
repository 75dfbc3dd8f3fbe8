"""How much of a step each rank takes: capacity weights from measured speeds (`parallel.capacity_weights: auto`),
and weights limited by per-rank token caps (devices with less memory). Pure functions, torch-free: the planner
uses them too, and every rank computes the same numbers from the same gathered inputs (no coordinator).

Measured weights (`smoothed_weights`): each rank's rate is tokens / busy seconds of its own work (forward and
backward passes, or generation), waits for other ranks excluded. Rates are divided by the fastest, then
smoothed: new = (1 - SMOOTHING) * old + SMOOTHING * measured (the first measurement is taken as it is), kept
within [MIN_RATIO, 1] of the largest, and rounded to 2 significant digits so that timing noise of a few percent
does not move rows from step to step. A rank that measured nothing (no rows, no time) keeps its weight. Weights
only move rows between ranks: the update is the same on any weights (losses use global denominators).

Cap-limited weights (`cap_limited_weights`): with token caps c_r per micro-batch, S micro-steps carry at most
S * c_r tokens on rank r. S is the count the step would need if every rank had the largest cap (so a rank with
less memory adds no micro-steps), raised until the caps hold the whole mini-batch; each rank then gets a share in
proportion to its weight, except that no share exceeds S * c_r: the excess of a capped rank goes to the others, in
proportion to their weights (water-filling). Those shares are the weights the partitioner balances by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SMOOTHING = 0.5
MIN_RATIO = 0.05  # a rank's weight is at least this share of the largest: it keeps getting rows to measure


def smoothed_weights(previous: Sequence[float] | None, tokens: Sequence[float],
                     seconds: Sequence[float]) -> list[float] | None:
    """The next weights from the previous ones (None: none yet) and each rank's measured tokens and busy seconds;
    None while no rank has measured anything."""
    k = len(tokens)
    rates = [t / s if t > 0 and s > 0 else None for t, s in zip(tokens, seconds)]
    known = [x for x in rates if x is not None]
    if not known:
        return list(previous) if previous else None
    fastest = max(known)
    measured = [x / fastest if x is not None else None for x in rates]
    if previous is None or len(previous) != k:
        new = [1.0 if x is None else x for x in measured]
    else:
        new = [p if x is None else (1 - SMOOTHING) * p + SMOOTHING * x for p, x in zip(previous, measured)]
    top = max(new)
    return [_round2(max(x, MIN_RATIO * top) / top) for x in new]


def _round2(x: float) -> float:
    return float(f"{x:.2g}")


def cap_limited_weights(total: float, weights: Sequence[float], caps: Sequence[int]) -> list[float]:
    """Weights to partition `total` tokens by, so that no rank needs more micro-steps under its cap than the
    others (module docstring); `weights` unchanged when every cap is the same or none binds."""
    w = [float(x) for x in weights]
    if total <= 0 or min(caps) == max(caps):
        return w
    sw, largest = sum(w), max(caps)
    steps = max(1, max(math.ceil(total * x / sw / largest - 1e-9) for x in w),
                math.ceil(total / sum(caps) - 1e-9))
    limits = [steps * c for c in caps]
    capped: set[int] = set()
    while True:
        free = [r for r in range(len(w)) if r not in capped]
        if not free:
            return [float(x) for x in limits]
        scale = (total - sum(limits[r] for r in capped)) / sum(w[r] for r in free)
        over = [r for r in free if scale * w[r] > limits[r]]
        if not over:
            break
        capped.update(over)
    if not capped:
        return w
    return [float(limits[r]) if r in capped else max(scale * w[r], 1e-9 * total) for r in range(len(w))]
