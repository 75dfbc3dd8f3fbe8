"""When the loop saves and when it stops early: checkpoint.every_steps and checkpoint.every_minutes, and SIGINT /
SIGTERM (Ctrl-C, Slurm's preemption signal, the launcher passing either on) as a request to stop at the next safe
point. The step in progress finishes, every rank saves the same checkpoint and the run ends with
`evenrl.errors.Interrupted` (the CLI's one line saying how to resume, exit 130 or 143). A second signal stops at
once, without saving (KeyboardInterrupt).

The ranks agree after every step with one all-reduce of two flags (a signal arrived; the time cadence is due on
this rank's clock), so they all save, or stop, after the same step whatever each one was sent and when.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from evenrl.config import RunConfig
from evenrl.distributed import collectives as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A signal this soon after the first is the same request arriving twice: Slurm signals every process of a job step,
# and evenrl's launcher, signalled too, passes it on.
REPEAT_S = 2.0


class Stopping:
    """Installed for the run (a context manager): the signal handlers and the time of the last save."""

    def __init__(self, cfg: RunConfig):
        self.every_steps = cfg.checkpoint.every_steps
        self.every_s = cfg.checkpoint.every_minutes * 60.0
        # With rollout.max_staleness k >= 1 a checkpoint carries the policy versions of the next k steps, staged
        # only for the saves the weight sync knows ahead (engines.sync.Broadcast.begin): no saves by time or signal.
        self.planned_only = cfg.rollout.max_staleness > 0
        self.last_steps = cfg.train.steps
        self.signal: int | None = None
        self.started = False  # the steps have begun: before, a signal stops the run with nothing to save
        self._at = 0.0
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "Stopping":
        if threading.current_thread() is threading.main_thread():  # Python runs handlers in the main thread only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        if self.signal is not None:
            if time.monotonic() - self._at < REPEAT_S:  # the same request twice (Slurm signals the launcher too)
                return
            self.__exit__()  # the second one: stop now, nothing saved
            raise KeyboardInterrupt
        self.signal, self._at = signum, time.monotonic()
        if dist.is_main():  # os.write: print is not safe inside a signal handler
            os.write(2, f"\nevenrl: {signal.Signals(signum).name}: {self._intent()}\n".encode())

    def _intent(self) -> str:
        """What a signal now leads to, said when it arrives."""
        if not self.started:  # set-up (loading, a checkpoint read): nothing of this run to save yet
            return "stopping before the first step, once set-up ends; nothing is saved (again to stop at once)"
        if self.planned_only:
            return ("stopping after the step in progress, keeping the latest checkpoint (with rollout.max_staleness "
                    ">= 1 checkpoints are written at checkpoint.every_steps only; again to stop at once)")
        return "stopping after the step in progress and saving a checkpoint (again to stop at once, without saving)"

    def after_step(self, step: int) -> tuple[bool, bool]:
        """(save, stop) after `step`, the same on every training rank (a collective)."""
        self.started = True
        due = bool(self.every_s) and not self.planned_only and time.monotonic() - self.last_save >= self.every_s
        signalled, due = self._agree(due)
        stop = signalled and step < self.last_steps  # after the last step the run ends anyway
        save = (step == self.last_steps or due or (stop and not self.planned_only)
                or bool(self.every_steps and step % self.every_steps == 0))
        return save, stop

    def _agree(self, due: bool) -> tuple[bool, bool]:
        """(any rank was signalled, any rank's time cadence is due): one all-reduce. A signalled run takes the signal
        any rank got (SIGINT before SIGTERM) as its own, so every rank reports the same."""
        got = [float(self.signal == sig) for sig in SIGNALS]
        flags = dist.all_reduce_sum(torch.tensor([*got, float(due)])).tolist()
        if flags[0] or flags[1]:
            self.signal = int(SIGNALS[0] if flags[0] else SIGNALS[1])
        return bool(flags[0] or flags[1]), bool(flags[2])

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def before_start(self) -> bool:
        """Whether a signal reached any rank while the run was being set up (a collective)."""
        signalled = self._agree(False)[0]
        self.started = not signalled
        return signalled
