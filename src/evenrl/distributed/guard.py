"""Failures of collectives, said in one line: each rank leaves where it is (`mark`) in the group's store, and a
collective that fails (a peer died: at once; a peer stopped: after the collective timeout) raises RunStopped naming
this rank's phase and where each other rank last said it was (`guard`), instead of a backend traceback after a
fixed 10 minutes."""

from __future__ import annotations

import contextlib
import re
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as tdist

from evenrl.distributed.mesh import G, active, rank
from evenrl.errors import RunStopped

# called after each mark: a launcher worker's heartbeat record takes the new phase at once (evenrl.train.liveness)
on_mark: list[Callable[[], None]] = []


def mark(phase: str) -> None:
    """Say where this rank is (e.g. "step 3 exchange"): kept here and, with several ranks, in the group's store,
    so that a failed collective on any rank can name the peer that stopped and where (one small store write)."""
    G.phase = phase
    if G.store is not None:
        try:
            G.store.set(f"phase/{rank()}", phase)
        except Exception:  # the store's host (rank 0) is gone: the next collective fails and says so in one line
            pass
    for hook in on_mark:
        hook()


@contextlib.contextmanager
def guard(op: str):
    """A backend error inside a collective becomes one RunStopped line: this rank, its phase, the operation, the
    backend's reason, and where the other ranks last were."""
    t0 = time.monotonic()
    try:
        yield
    except RuntimeError as e:
        if not active() or tdist.get_world_size() == 1:
            raise
        reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).strip().splitlines() or [type(e).__name__])[0])[:160]
        raise RunStopped(f"rank {rank()} in {G.phase}: {op} failed after {time.monotonic() - t0:.0f} s ({reason}); "
                         f"{whereabouts()}") from None


def whereabouts() -> str:
    """Where each other rank last said it was. The store lives on rank 0 (or torchrun's agent), which may itself be
    gone; nothing here waits for long."""
    try:
        G.store.set_timeout(timedelta(seconds=5))
        seen = {r: G.store.get(f"phase/{r}").decode() if G.store.check([f"phase/{r}"]) else "not started"
                for r in range(tdist.get_world_size()) if r != rank()}
    except Exception:  # the store's host is gone too
        return "the rendezvous store (on rank 0 or the launcher) is unreachable: rank 0 may have stopped or died"
    behind = {r: p for r, p in seen.items() if p != G.phase}
    if not behind:
        return f"every other rank also reached {G.phase}"
    return "; ".join(f"rank {r} was last in {p}" for r, p in behind.items()) + " (stopped, died or still busy)"
