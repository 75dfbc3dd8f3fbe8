"""Rewards that break the run on purpose, for tests/test_faults.py (referenced as fault_rewards:name, with tests/ on
PYTHONPATH). They run in the trainer process (rewards.isolate=false) so that what they do happens to the rank."""

import os
import signal
import time


def huge(completion: str, sample: dict) -> float:
    """Finite but near float32's limit: advantages of +-3e38 overflow the loss and the gradient to inf."""
    return 3e38 if any(c.isdigit() for c in completion) else -3e38


def constant(completion: str, sample: dict) -> float:
    """Every sample scores alike: every advantage is 0 and the run learns nothing."""
    return 1.0


def stop_rank_1(completion: str, sample: dict) -> float:
    """Rank 1 stops while scoring: a hung peer, as a stuck reward or a frozen node would leave it. It hangs with
    SIGTERM's default action (not evenrl's stop-after-the-step handler, which a hang outlasts, nor SIGSTOP, which
    defers SIGTERM): its peers see the same silence, and once rank 0 has failed torch's agent ends it with its SIGTERM
    instead of waiting a fixed 30 s (PContext.close) for a process that never exits, a wait that is torch's."""
    if os.environ.get("RANK") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(3600)
    return 0.0


def freeze_rank_1(completion: str, sample: dict) -> float:
    """Rank 1 freezes while scoring (SIGSTOP: a debugger, a suspended container, a process no thread of which runs):
    no heartbeat, so evenrl's launcher ends it after parallel.liveness_timeout_s."""
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    return 0.0


def kill_rank_1(completion: str, sample: dict) -> float:
    """Rank 1 dies while scoring: a crashed peer."""
    if os.environ.get("RANK") == "1":
        os._exit(9)
    return 0.0
