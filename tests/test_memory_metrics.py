"""The per-phase CUDA memory peaks that evenrl.train.metrics.Timer records (metrics memory/<phase>_peak_gib), with
torch.cuda's allocator statistics stood in for, so the bookkeeping is checked on a CPU-only machine too. The real
numbers were read on an H100 by benchmarks/gpu.py (docs/performance.md)."""

import torch

from evenrl.train.metrics import Timer


class FakeAllocator:
    """torch.cuda's peak counter: reset sets the peak to what is allocated now; allocations raise it."""

    def __init__(self):
        self.now = 0
        self.peak = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def free(self, n: int) -> None:
        self.now -= n

    def reset(self, device=None) -> None:
        self.peak = self.now


def test_timer_records_each_phase_peak_and_keeps_the_larger_of_two_entries(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak)
    gib = 2**30
    fake.alloc(4 * gib)  # resident (weights, optimizer state): counted in every phase, as the planner does
    timer = Timer(1)
    with timer("rollout"):
        fake.alloc(2 * gib)
        fake.free(2 * gib)
    with timer("logprobs"):
        fake.alloc(1 * gib)
        fake.free(1 * gib)
    with timer("update"):
        fake.alloc(3 * gib)
        fake.free(3 * gib)
    with timer("logprobs"):  # a phase entered twice in a step keeps its larger peak
        fake.alloc(gib // 2)
        fake.free(gib // 2)
    assert timer.peak_gib == {"rollout": 6.0, "logprobs": 5.0, "update": 7.0}


def test_timer_records_no_memory_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    timer = Timer(1)
    with timer("rollout"):
        pass
    assert timer.peak_gib == {} and "rollout" in timer.seconds
