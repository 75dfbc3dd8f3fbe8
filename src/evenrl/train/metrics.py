"""What a step reports: its metrics row (`step_metrics`), the time and CUDA memory of each phase (`Timer`), the
run's phase breakdown at the end (`phase_table`) and the warning for steps that learn nothing (`Idle`)."""

from __future__ import annotations

import time

import torch

from evenrl.config import RunConfig
from evenrl.core.batch import Batch
from evenrl.core.carry import oldest_token_age
from evenrl.core.masking import masked_rows
from evenrl.distributed import collectives as dist
from evenrl.rewards.overlong import overlong_penalty
from evenrl.rollout.trajectories import overlong_lengths


class Timer:
    """Seconds per phase; entering a phase also tells the other ranks where this one is (dist.mark), so a failed
    collective can name the rank that stopped and the phase it stopped in."""

    def __init__(self, step: int):
        self.step = step
        self.seconds: dict[str, float] = {}
        # CUDA only: the most memory torch's allocator handed out within each phase (max_memory_allocated, reset as
        # the phase starts), the number `evenrl plan` estimates per phase; the CPU allocator keeps no such count
        self.peak_gib: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                dist.mark(f"step {timer.step} {name}")
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t
                if torch.cuda.is_available():
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    timer.peak_gib[name] = max(timer.peak_gib.get(name, 0.0), peak)

        return _Ctx()


# Calls (rewards, environment steps, agents) the wall-clock backstop ended in the step, all ranks' (the trainers').
BACKSTOP = "limits/wall_clock_backstop"


def step_metrics(cfg: RunConfig, lr: float, everyone: Batch, schedule, stats: dict, failures: dict[str, int],
                 timer: Timer, sp: int = 1) -> dict:
    """The step's metrics row: rewards, lengths, throughput, per-rank load, staleness and the phase times, from the
    all-ranks view (`everyone`), so every rank computes the same row; `sp`: the mesh's sequence-parallel size."""
    rewards, lens = everyone["reward"].double(), everyone["response_len"].double()
    elapsed = max(sum(timer.seconds.values()), 1e-9)
    out = {
        "reward/mean": float(rewards.mean()) if len(rewards) else float("nan"),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "advantage/abs_mean": float(everyone["advantage"].abs().mean()) if len(rewards) else 0.0,
        "response/length_mean": float(lens.mean()) if len(lens) else 0.0,
        "response/finished_fraction": float(everyone["finished"].float().mean()) if len(lens) else 0.0,
        "samples": len(rewards),
        "perf/tokens_per_s": float(everyone["total_len"].sum()) / elapsed,
        "perf/samples_per_s": len(rewards) / elapsed,
        "lr": lr,
        "load/rank_tokens": [int(x) for x in schedule.rank_loads()],
        "load/micro_steps": sum(schedule.micro_steps()),
        # token slots of the update's micro-batches that hold padding (packed rows: only the split's rounding)
        "load/padding_share": schedule.padding_share(everyone["total_len"].tolist(), sp),
        # samples no rank ran because their gradient is exactly zero (train.skip_zero_gradient_samples)
        "load/skipped_samples": sum(len(mb.rows) for mb in schedule.minibatches) - sum(
            len(m.rows) for mb in schedule.minibatches for micros in mb.per_rank for m in micros),
    }
    if "vision_tokens" in everyone:  # the part of load/rank_tokens that is the vision encoder's (its images)
        vision = everyone["vision_tokens"].tolist()
        out["load/rank_vision_tokens"] = [sum(vision[i] for mb in schedule.minibatches for m in mb.per_rank[r]
                                              for i in m.rows) for r in range(schedule.world)]
    if cfg.rollout.max_staleness > 0 or cfg.rollout.partial:  # steps between the sampling policy and the trained one
        staleness = (timer.step - 1 - everyone["version"]).tolist()  # partial: of a sample's first token
        most = oldest_token_age(cfg.rollout.max_staleness, cfg.rollout.max_carry_steps if cfg.rollout.partial else 0)
        out["rollout/staleness_mean"] = sum(staleness) / max(len(staleness), 1)
        out["rollout/staleness_hist"] = [staleness.count(d) for d in range(most + 1)]
    if cfg.rewards.overlong_buffer > 0:
        rc = cfg.rewards
        pen = overlong_penalty(*overlong_lengths(cfg, everyone), rc.overlong_buffer, rc.overlong_penalty)
        out["reward/overlong_penalty_mean"] = float(pen.mean()) if len(pen) else 0.0
    out.update(stats)
    out.update({f"time/{k}": v for k, v in timer.seconds.items()})
    out.update({f"memory/{k}_peak_gib": v for k, v in timer.peak_gib.items()})  # empty without CUDA
    if "turns" in everyone:  # rollout.env: trajectories
        out.update(trajectory_metrics(everyone))
    # summed over ranks by gather_rows: samples whose reward failed, each entry's failed calls, and the calls of
    # rewards, environment steps and agents that the wall-clock backstop ended (their fate depended on the load)
    out["reward/failures"] = int(failures.get("", 0))
    out.update({f"reward/failures/{name}": int(n) for name, n in failures.items() if name and name != BACKSTOP})
    out[BACKSTOP] = int(failures.get(BACKSTOP, 0))
    masked = masked_rows(cfg, everyone)
    out["reward/masked_samples"] = 0 if masked is None else int(masked.sum())  # left out of learning
    return out


def trajectory_metrics(everyone: Batch) -> dict:
    """Turns per trajectory, sampled tokens, and the share of tool calls that could be read and run."""
    calls, errors = int(everyone["tool_calls"].sum()), int(everyone["tool_errors"].sum())
    n = max(len(everyone), 1)
    out = {"rollout/turns_mean": float(everyone["turns"].sum()) / n,
           "response/sampled_length_mean": float(everyone["sampled_len"].sum()) / n,
           "tools/calls_per_trajectory": calls / n,
           "tools/cut_calls": int(everyone["cut_calls"].sum())}  # cut at their token limit: never made
    if "segment" in everyone:  # rollout.agent: calls that extended their sample, and the samples split off
        splits = int((everyone["segment"] > 0).sum())
        out.update({"agent/calls_per_trajectory": float(everyone["turns"].sum()) / max(n - splits, 1),
                    "agent/chained_calls": int(everyone["turns"].sum()) - n,
                    "agent/history_breaks": int(everyone["history_breaks"].sum()),
                    "agent/split_samples": splits})
    if calls:
        out["tools/success_rate"] = (calls - errors) / calls
    return out


class Idle:
    """Steps that learn nothing: every sample's advantage is 0 (each group's rewards were all equal, e.g. a 0/1
    reward the model never or always earns), so the policy gradient is zero. Warns at the first step of each such
    streak, and once at the end when it happened at all."""

    def __init__(self):
        self.steps: list[int] = []
        self.failed = 0  # of those, steps in which every sample had failed (its reward, trajectory or agent)

    def see(self, step: int, metrics: dict) -> None:
        if metrics.get("samples", 0) and metrics.get("advantage/abs_mean", 1.0) == 0.0:
            failed = metrics.get("reward/failures", 0) >= metrics["samples"]
            if not self.steps or self.steps[-1] != step - 1:
                why = ("every one had failed: see the failures above" if failed else
                       "check the reward on a few samples.jsonl rows")
                print(f"evenrl: warning: step {step} learned nothing: every group's rewards were equal, so all "
                      f"{metrics['samples']} samples have advantage 0 ({why})", flush=True)
            self.steps.append(step)
            self.failed += failed

    def summary(self, steps: int) -> None:
        if self.steps:
            why = (f"in {self.failed} of them every sample had failed (reward/failures), not the reward's doing"
                   if self.failed else "the reward does not tell this model's samples apart")
            print(f"evenrl: note: {len(self.steps)} of {steps} steps learned nothing (all advantages 0); {why}",
                  flush=True)


PHASES = ["weights", "rollout", "reward", "values", "advantage", "exchange", "logprobs", "update"]


def phase_table(seconds: dict[str, float], steps: int) -> str:
    """Rank 0's time per phase summed over the run's steps, so the next speed-up is chosen from data.
    `seconds` holds the phase timers plus "step" (wall time of whole steps); "other" is what no phase covers."""
    total = seconds.get("step", sum(v for k, v in seconds.items() if k != "step"))
    names = [p for p in PHASES if p in seconds] + sorted(k for k in seconds if k not in PHASES and k != "step")
    rows = [(p, seconds[p]) for p in names] + [("other", max(0.0, total - sum(seconds[p] for p in names)))]
    lines = [f"phase breakdown over {steps} step{'s' if steps != 1 else ''} (rank 0):",
             f"  {'phase':<10} {'seconds':>9} {'%':>6}"]
    lines += [f"  {name:<10} {sec:9.2f} {100 * sec / max(total, 1e-9):6.1f}" for name, sec in rows]
    lines.append(f"  {'total':<10} {total:9.2f} {100.0:6.1f}")
    return "\n".join(lines)
