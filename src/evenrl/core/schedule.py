"""The step schedule: which rows each rank runs in which micro-step of which mini-batch.

make_schedule() turns one step's sample lengths into a StepSchedule such that
  - mini-batch membership depends only on (N, minibatches, groups), never on the world size, so with loss
    normalised by global counts the update equals the single-device one;
  - inside a mini-batch, rows are balanced over ranks by cost with `balanced_partition` (rank weights = capacity);
  - each rank packs its rows, longest first, into micro-batches whose padded tokens (rows * longest row) stay
    within `token_cap`, and every rank runs the same number of micro-batches (FSDP2 needs equal step counts):
    a rank with fewer first splits its largest multi-row micro-batches, then pads with empty filler steps;
  - with `min_rows` (BatchNorm needs >= 2 rows in training mode), every non-empty micro-batch has >= min_rows rows;
  - `inert` rows (whose gradient is exactly zero, e.g. a GRPO group whose rewards are all equal) stay members of
    their mini-batch, so they count in its loss denominators, but no rank runs them: balancing and packing see
    only the rows that carry gradient;
  - `extra` is work a row brings beyond its padded tokens, in token equivalents, that is never padded: a
    vision-language sample's images through the vision encoder (evenrl.train.step: patches x the encoder's
    compute per patch relative to the language model's per token). It adds to the row's cost in the balance and
    to its micro-batch's tokens under the cap: a micro-batch holds rows x longest + the sum of its rows' extra.

Decisions:
  - Mini-batches are contiguous runs of rows (sizes differ by at most one). With `groups`, each group is a unit
    placed at its first row (groups that are not contiguous are gathered there) and cuts fall on the unit
    boundary nearest to the ungrouped cut (ties: earlier). Groups only constrain mini-batch cuts: rows of one
    group may run on different ranks. Empty mini-batches (minibatches > N, or large groups) are dropped, so
    N == 0 gives a schedule with no mini-batches and M > N gives N mini-batches of one row.
  - min_rows = m: only floor(rows/m) ranks (the highest-weight ones) get rows, so there are enough rows for each
    active rank to hold >= m; after balancing, a rank with 1..m-1 rows takes the shortest row of the most loaded
    rank that has more than m (such a rank always exists). A non-empty mini-batch with fewer than m rows cannot be
    scheduled and raises ScheduleError.
  - token_cap: one cap for every rank, or one per rank (devices with less memory): the partition then gives a
    rank no more than its cap's share of the micro-steps the others need (`core.capacity.cap_limited_weights`),
    so a small-memory rank runs fewer tokens per micro-step in the same number of micro-steps.
    A row longer than the cap (the largest, with per-rank caps) is listed in `oversize` and runs alone (with
    m-1 companions when m > 1); with per-rank caps a row may also exceed the cap of a rank it lands on.
    When m*len > cap, or when a rank's last rows cannot be split into pieces of >= m rows within the cap, the
    schedule exceeds the cap rather than failing mid-run: such a micro-batch holds at most 2m-1 rows, and either
    its longest row cannot share a micro-batch of m rows within the cap or its tokens are <= (2m-1)/m * cap.
    With m == 1 the cap is only ever exceeded by a single oversize row. `StepSchedule.over_cap()` lists them all.
"""

from __future__ import annotations

import heapq
import operator
from bisect import bisect_left
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from evenrl.errors import UsageError, bad
from evenrl.core.capacity import cap_limited_weights
from evenrl.core.partition import balanced_partition, sample_cost

__all__ = ["MicroBatch", "MiniBatch", "StepSchedule", "ScheduleError", "make_schedule", "split_minibatches"]


class ScheduleError(UsageError, ValueError):
    """A constraint that cannot be met; message says which and why (the planner shows it)."""


@dataclass(frozen=True)
class MicroBatch:
    rows: tuple[int, ...]  # global sample indices, ascending; empty tuple = zero-weight filler step
    tokens: int  # padded token count = len(rows) * max(lengths of rows), plus the rows' extra


FILLER = MicroBatch((), 0)


@dataclass(frozen=True)
class MiniBatch:
    rows: tuple[int, ...]  # all rows of this mini-batch, ascending; independent of world
    per_rank: tuple[tuple[MicroBatch, ...], ...]  # len == world; same number (>= 1) of micro-batches per rank


@dataclass(frozen=True)
class StepSchedule:
    world: int
    minibatches: tuple[MiniBatch, ...]
    oversize: tuple[int, ...]  # rows whose own length exceeds token_cap (the largest cap), ascending
    token_cap: int | tuple[int, ...] | None = None  # one per rank where ranks differ
    min_rows: int = 1
    packed: bool = False  # micro-batches run their rows back to back (tokens = the sum of their lengths)

    def cap(self, rank: int) -> int | None:
        """The token cap of `rank`'s micro-batches."""
        return self.token_cap[rank] if isinstance(self.token_cap, tuple) else self.token_cap

    def rank_rows(self, rank: int) -> list[int]:
        """All rows `rank` needs this step, in schedule order (each row is scheduled once, so no duplicates)."""
        if not 0 <= rank < self.world:
            raise IndexError(f"rank {rank} out of range for world {self.world}")
        return [r for mb in self.minibatches for micro in mb.per_rank[rank] for r in micro.rows]

    def micro_steps(self) -> list[int]:
        """Micro-steps per mini-batch (the same on every rank)."""
        return [len(mb.per_rank[0]) for mb in self.minibatches]

    def rank_loads(self) -> list[int]:
        """Padded tokens per rank over the whole step (what the rank's forward/backward passes see)."""
        return [sum(m.tokens for mb in self.minibatches for m in mb.per_rank[r]) for r in range(self.world)]

    def padding_share(self, lengths: Sequence[int], group: int = 1) -> float:
        """The share of the update's token slots that hold padding: rows x longest per micro-batch, or, packed, the
        packed row's end up to a multiple of the `group` of ranks that splits it."""
        real = slots = 0
        for mb in self.minibatches:
            for m in (m for micros in mb.per_rank for m in micros if m.rows):
                n = sum(lengths[i] for i in m.rows)
                real += n
                slots += -(-n // group) * group if self.packed else len(m.rows) * max(lengths[i] for i in m.rows)
        return 1.0 - real / slots if slots else 0.0

    def over_cap(self) -> list[tuple[int, int, int]]:
        """(mini-batch, rank, micro-step) of every micro-batch whose tokens exceed token_cap."""
        if self.token_cap is None:
            return []
        return [
            (b, r, s)
            for b, mb in enumerate(self.minibatches)
            for r, micros in enumerate(mb.per_rank)
            for s, m in enumerate(micros)
            if m.tokens > self.cap(r)
        ]

    def to_dict(self) -> dict:
        """JSON-able summary (counts and totals, not the row lists)."""
        return {
            "world": self.world,
            "rows": sum(len(mb.rows) for mb in self.minibatches),
            "token_cap": list(self.token_cap) if isinstance(self.token_cap, tuple) else self.token_cap,
            "min_rows": self.min_rows,
            "micro_steps": self.micro_steps(),
            "rank_loads": self.rank_loads(),
            "oversize": list(self.oversize),
            "over_cap": [list(x) for x in self.over_cap()],
            "minibatches": [
                {
                    "rows": len(mb.rows),
                    "micro_steps": len(mb.per_rank[0]),
                    "rank_rows": [sum(len(m.rows) for m in micros) for micros in mb.per_rank],
                    "rank_tokens": [sum(m.tokens for m in micros) for micros in mb.per_rank],
                    "fillers": sum(1 for micros in mb.per_rank for m in micros if not m.rows),
                }
                for mb in self.minibatches
            ],
        }


def _err(field: str, value, allowed: str) -> ScheduleError:
    return ScheduleError(str(bad(field, value, allowed)))


def _check_int(field: str, value, lo: int, what: str = "an integer") -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)  # accepts numpy integers, refuses floats
    except TypeError:
        raise _err(field, value, f"need {what} >= {lo}") from None
    if out < lo:
        raise _err(field, value, f"need {what} >= {lo}")
    return out


def _check_float(field: str, value, positive: bool) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = float("nan")
    if isinstance(value, bool) or not (out > 0 if positive else out >= 0) or out == float("inf"):
        raise _err(field, value, f"need a finite number {'>' if positive else '>='} 0")
    return out


def split_minibatches(n: int, minibatches: int, groups: Sequence[Hashable] | None = None) -> list[tuple[int, ...]]:
    """Rows 0..n-1 cut into at most `minibatches` contiguous, non-empty, near-equal mini-batches (world-free).

    Without groups, sizes differ by at most one (the first n % M get the extra row). With groups, each group is a
    unit at its first row and every cut moves to the nearest unit boundary (ties: the earlier one).
    """
    n = _check_int("n", n, 0)
    m = _check_int("minibatches", minibatches, 1)
    q, r = divmod(n, m)
    cuts = [i * q + min(i, r) for i in range(m + 1)]
    if groups is None:
        return [tuple(range(a, b)) for a, b in zip(cuts, cuts[1:]) if b > a]
    if len(groups) != n:
        raise _err("groups", f"{len(groups)} ids", f"need one group id per sample ({n})")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    units = list(members.values())  # dicts keep first-appearance order
    bounds = [0]
    for u in units:
        bounds.append(bounds[-1] + len(u))
    chosen = [0]
    for c in cuts[1:-1]:
        p = bisect_left(bounds, c)
        if p == len(bounds) or (p > 0 and c - bounds[p - 1] <= bounds[p] - c):
            p -= 1
        chosen.append(max(p, chosen[-1]))
    chosen.append(len(units))
    out = []
    for a, b in zip(chosen, chosen[1:]):
        if b > a:
            out.append(tuple(sorted(i for u in units[a:b] for i in u)))
    return out


def make_schedule(
    lengths: Sequence[int],
    *,
    world: int,
    minibatches: int = 1,
    token_cap: int | Sequence[int] | None = None,
    groups: Sequence[Hashable] | None = None,
    weights: Sequence[float] | None = None,
    min_rows: int = 1,
    quadratic_cost: float = 0.0,
    inert: Sequence[bool] | None = None,
    extra: Sequence[int] | None = None,
    packed: bool = False,
) -> StepSchedule:
    """Plan one training step: rows -> mini-batches -> ranks -> micro-batches (see the module docstring).
    packed: micro-batches run their rows back to back (sequence parallelism's forward), so a micro-batch's tokens
    are the sum of its rows' lengths instead of rows x longest."""
    lengths = [_check_int(f"lengths[{i}]", x, 0, "an integer token count") for i, x in enumerate(lengths)]
    if extra is not None and len(extra) != len(lengths):
        raise _err("extra", f"{len(extra)} numbers", f"need one per row ({len(lengths)})")
    add = [0] * len(lengths) if extra is None else [_check_int(f"extra[{i}]", x, 0) for i, x in enumerate(extra)]
    world = _check_int("world", world, 1)
    minibatches = _check_int("minibatches", minibatches, 1)
    caps: list[int | None]
    if not isinstance(token_cap, (list, tuple)):
        token_cap = None if token_cap is None else _check_int("token_cap", token_cap, 1)
        caps = [token_cap] * world
    else:
        caps = [_check_int(f"token_cap[{r}]", x, 1) for r, x in enumerate(token_cap)]
        if len(caps) != world:
            raise _err("token_cap", caps, f"need one token cap per rank ({world}), or one for all")
        token_cap = caps[0] if len(set(caps)) == 1 else tuple(caps)
    min_rows = _check_int("min_rows", min_rows, 1)
    quadratic_cost = _check_float("quadratic_cost", quadratic_cost, positive=False)
    if weights is None:
        w = [1.0] * world
    else:
        w = list(weights)
        if len(w) != world:
            raise _err("weights", w, f"need one capacity weight per rank ({world})")
        w = [_check_float(f"weights[{r}]", x, positive=True) for r, x in enumerate(w)]

    if inert is not None:
        if len(inert) != len(lengths):
            raise _err("inert", f"{len(inert)} flags", f"need one flag per row ({len(lengths)})")
        if min_rows > 1 and any(inert):
            # Dropping rows could leave a mini-batch with 1..min_rows-1 rows to run; keep BatchNorm runs simple.
            raise _err("inert", "rows marked inert", "none when min_rows > 1")
    batches = split_minibatches(len(lengths), minibatches, groups)
    for b, rows in enumerate(batches):
        if len(rows) < min_rows:
            raise ScheduleError(
                f"min_rows: mini-batch {b} has {len(rows)} row(s) but min_rows={min_rows} (a training-mode "
                f"BatchNorm needs that many); use at most {len(lengths) // min_rows} mini-batches, more samples, "
                f"or min_rows=1 (no BatchNorm)"
            )

    cost = [sample_cost(length, 1.0, quadratic_cost) + a for length, a in zip(lengths, add)]
    # Ranks that may get rows when min_rows > 1: the highest-weight ones, ties to the lower rank.
    by_weight = sorted(range(world), key=lambda r: (-w[r], r))
    out = []
    for rows in batches:
        work = rows if inert is None else tuple(i for i in rows if not inert[i])
        active = sorted(by_weight[: min(world, len(work) // min_rows)])
        rank_rows: list[list[int]] = [[] for _ in range(world)]
        if active:
            aw = [w[r] for r in active]
            if isinstance(token_cap, tuple):
                aw = cap_limited_weights(sum(lengths[i] + add[i] for i in work), aw, [caps[r] for r in active])
            part = balanced_partition([cost[i] for i in work], len(active), weights=aw)
            for p, items in enumerate(part.parts):
                rank_rows[active[p]] = [work[i] for i in items]
        if min_rows > 1:
            _fill_short_ranks(rank_rows, cost, w, min_rows)
        chunks = [_pack(rr, lengths, cap, min_rows, add, packed) for rr, cap in zip(rank_rows, caps)]
        steps = max(1, max(len(c) for c in chunks))
        per_rank = []
        for c in chunks:
            if len(c) < steps:
                c = _split_to(c, steps, lengths, min_rows, add, packed)
            micros = sorted(
                (MicroBatch(tuple(sorted(ch)), _tokens(ch, lengths, add, packed)) for ch in c),
                key=lambda m: (-m.tokens, m.rows),
            )
            micros.extend([FILLER] * (steps - len(micros)))
            per_rank.append(tuple(micros))
        out.append(MiniBatch(rows=rows, per_rank=tuple(per_rank)))

    largest = None if token_cap is None else max(caps)
    oversize = () if largest is None else tuple(i for i, length in enumerate(lengths) if length + add[i] > largest)
    return StepSchedule(world=world, minibatches=tuple(out), oversize=oversize, token_cap=token_cap, min_rows=min_rows,
                        packed=packed)


def _fill_short_ranks(rank_rows: list[list[int]], cost: list[float], w: list[float], m: int) -> None:
    """Give each rank holding 1..m-1 rows the shortest rows of the most loaded ranks holding more than m.

    A donor always exists: only floor(rows/m) ranks are active, so if every non-short active rank held exactly m
    rows and one held fewer, there would be fewer than m * active rows. A short rank gains at most m-1 rows.
    """
    load = [sum(cost[i] for i in rr) for rr in rank_rows]
    for d, rr in enumerate(rank_rows):
        while 0 < len(rr) < m:
            donor = max(
                (r for r in range(len(rank_rows)) if len(rank_rows[r]) > m), key=lambda r: (load[r] / w[r], -r)
            )
            src = rank_rows[donor]
            row = min(src, key=lambda i: (cost[i], i))
            src.remove(row)
            rr.append(row)
            load[donor] -= cost[row]
            load[d] += cost[row]
    for rr in rank_rows:
        rr.sort()


def _tokens(chunk: list[int], lengths: list[int], add: list[int], packed: bool) -> int:
    """A micro-batch's tokens: rows x longest (padded; rows longest first), or the sum of its rows (packed)."""
    rows = sum(lengths[i] for i in chunk) if packed else len(chunk) * (lengths[chunk[0]] if chunk else 0)
    return rows + sum(add[i] for i in chunk)


def _pack(rows: list[int], lengths: list[int], cap: int | None, m: int, add: list[int],
          packed: bool = False) -> list[list[int]]:
    """Rows longest first into consecutive chunks: each takes as many rows as fit its longest row under the cap
    (with `add`, as many as keep rows x longest + their extra within it; packed: the sum of rows + extra).

    Taking consecutive rows in length order minimises padding, and filling greedily from the longest gives the
    fewest chunks. The look-ahead keeps the last chunk at >= m rows by leaving exactly m rows for it.
    """
    order = sorted(rows, key=lambda i: (-lengths[i], i))
    n = len(order)
    chunks = []
    i = 0
    while i < n:
        longest = lengths[order[i]]
        fit = n if cap is None or longest == 0 else cap // longest
        if cap is not None and packed:
            fit, used = 0, 0
            while i + fit < n and used + lengths[order[i + fit]] + add[order[i + fit]] <= cap:
                used += lengths[order[i + fit]] + add[order[i + fit]]
                fit += 1
        elif cap is not None and any(add[j] for j in order[i:]):
            fit, extra = 0, 0
            while i + fit < n and (fit + 1) * longest + extra + add[order[i + fit]] <= cap:
                extra += add[order[i + fit]]
                fit += 1
        left = n - i
        take = min(max(fit, m), left)
        if 0 < left - take < m:
            take = left - m if left - m >= m else left
        chunks.append(order[i : i + take])
        i += take
    return chunks


def _split_to(chunks: list[list[int]], steps: int, lengths: list[int], m: int, add: list[int],
              packed: bool = False) -> list[list[int]]:
    """Split chunks (pieces of >= m rows) until there are `steps` of them or none can be split further.

    Extra pieces go one at a time to the chunk whose largest piece has the most padded tokens; a chunk cut into p
    pieces gets near-equal row counts, the smaller pieces holding its longest rows. A piece never has more tokens
    than its chunk, so splitting never breaks the cap.
    """

    def worst(c: list[int], p: int) -> int:
        return max(_tokens(c[start:start + size], lengths, add, packed) for start, size in _pieces(len(c), p))

    pieces = [1] * len(chunks)
    heap = [(-worst(c, 1), c[0], i) for i, c in enumerate(chunks) if len(c) >= 2 * m]
    heapq.heapify(heap)
    extra = steps - len(chunks)
    while extra > 0 and heap:
        _, _, i = heapq.heappop(heap)
        pieces[i] += 1
        extra -= 1
        c = chunks[i]
        if len(c) >= (pieces[i] + 1) * m:
            heapq.heappush(heap, (-worst(c, pieces[i]), c[0], i))
    return [c[start : start + size] for c, p in zip(chunks, pieces) for start, size in _pieces(len(c), p)]


def _pieces(n: int, p: int) -> list[tuple[int, int]]:
    """(start, size) of p consecutive pieces of n rows; sizes differ by at most one, smaller ones first."""
    q, r = divmod(n, p)
    out, start = [], 0
    for k in range(p):
        size = q + (1 if k >= p - r else 0)
        out.append((start, size))
        start += size
    return out


def rollout_shares(prompt_costs: list[float], n: int, world: int, weights=None) -> list[list[tuple[int, int, int]]]:
    """Per rank, the (prompt, first sample, count) it generates. The step's samples, prompt by prompt, are cut into
    `world` runs of near-equal cost (in proportion to the capacity weights), so each rank's work is within one
    sample of its share and a prompt's samples are split over as few ranks as possible (each part repeats the
    prompt's prefill). Every rank computes the same cut; a sample's randomness is keyed, so where it runs does
    not change it."""
    w = list(weights) if weights else [1.0] * world
    total = sum(prompt_costs) * n
    ends = [total * sum(w[: r + 1]) / sum(w) for r in range(world)]
    shares: list[list[list[int]]] = [[] for _ in range(world)]
    done, r = 0.0, 0
    for p, cost in enumerate(prompt_costs):
        for sample in range(n):
            while r < world - 1 and done + cost / 2 > ends[r]:  # a sample goes where its midpoint falls
                r += 1
            if shares[r] and shares[r][-1][0] == p:
                shares[r][-1][2] += 1
            else:
                shares[r].append([p, sample, 1])
            done += cost
    return [[tuple(x) for x in share] for share in shares]
