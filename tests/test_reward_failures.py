"""rewards.on_failure=mask: a sample whose reward call failed is left out of learning exactly.

Unit level: the step's advantages, denominators and schedule against a naive computation over the valid samples.
End to end: `evenrl train` with a reward that fails on some samples gives the same weights on 1 and 3 processes,
and with min_rows_per_micro_batch=2 (masked rows then run with their loss dropped instead of being skipped)."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch

from e2e import evenrl_many, final_params, max_diff, metrics
from evenrl.config import load_config
from evenrl.core.batch import Batch
from evenrl.core.masking import counted_lengths, zero_gradient_rows
from evenrl.distributed.mesh import Mesh
from evenrl.train.balance import Balance
from evenrl.train.step import add_advantages, plan_step
from evenrl.train.update import minibatch_denominators

EPS = 1e-6


def _everyone(seed: int, prompts: int = 5, k: int = 4) -> Batch:
    g = torch.Generator().manual_seed(seed)
    n = prompts * k
    lengths = torch.randint(0, 6, (n,), generator=g)
    return Batch({
        "sample_index": torch.arange(n),
        "group": torch.arange(n) // k,
        "reward": torch.randint(0, 3, (n,), generator=g).float() / 2,
        "reward_failed": torch.rand(n, generator=g) < 0.3,
        "response_len": lengths,
        "total_len": lengths + 3,
        "finished": torch.ones(n, dtype=torch.bool),
    })


def _naive_grpo_over_valid(everyone: Batch) -> list[float]:
    rewards, groups, failed = (everyone[c].tolist() for c in ("reward", "group", "reward_failed"))
    out = []
    for i in range(len(rewards)):
        if failed[i]:
            out.append(0.0)
            continue
        mates = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and not failed[j]]
        std = statistics.stdev(mates) if len(mates) > 1 else 0.0
        out.append((rewards[i] - sum(mates) / len(mates)) / (std + EPS))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("overrides", [[], ["algo.kl_coef=0.05"], ["train.skip_zero_gradient_samples=false"]])
def test_masked_samples_have_no_advantage_no_denominator_and_run_nowhere(seed, overrides):
    cfg = load_config(None, ["rewards.on_failure=mask", "algo.minibatches_per_step=2", *overrides])
    run = SimpleNamespace(cfg=cfg, balance=Balance(), model=torch.nn.Identity(), mesh=Mesh())  # one process
    everyone = _everyone(seed)
    local = everyone.select(list(range(len(everyone))))
    add_advantages(run, local, everyone)
    assert torch.allclose(everyone["advantage"].double(), torch.tensor(_naive_grpo_over_valid(everyone),
                                                                       dtype=torch.float64), atol=1e-5)
    failed, lens = everyone["reward_failed"].tolist(), everyone["response_len"].tolist()
    schedule = plan_step(run, everyone)
    ran = {r for mb in schedule.minibatches for micros in mb.per_rank for m in micros for r in m.rows}
    for mb in schedule.minibatches:
        denom = minibatch_denominators(counted_lengths(cfg, everyone), mb.rows)
        valid = [lens[r] for r in mb.rows if not failed[r]]
        assert (denom.tokens, denom.seqs) == (sum(valid), sum(x > 0 for x in valid))
    assert not any(failed[r] for r in ran) and any(failed)
    assert all(r in ran for r in range(len(everyone)) if not failed[r] and everyone["advantage"][r] != 0)


def test_zero_mode_ignores_the_flags():
    cfg = load_config(None, ["algo.minibatches_per_step=2"])  # on_failure: zero, the default
    run, everyone = SimpleNamespace(cfg=cfg), _everyone(0)
    add_advantages(run, everyone.select(list(range(len(everyone)))), everyone)
    plain = _everyone(0)
    plain["reward_failed"] = torch.zeros(len(plain), dtype=torch.bool)
    add_advantages(run, plain.select(list(range(len(plain)))), plain)
    assert torch.equal(everyone["advantage"], plain["advantage"])
    assert torch.equal(counted_lengths(cfg, everyone), everyone["response_len"])
    assert zero_gradient_rows(cfg, everyone) == (everyone["advantage"] == 0).tolist()


@pytest.mark.slow
def test_mask_gives_the_same_model_on_one_and_three_processes(assets, tmp_path):
    """A reward that raises on about a quarter of the samples; KL in the loss, so a masked row that ran would
    move the weights. 1 process, 3 processes and min_rows=2 (masked rows run, loss dropped) agree; on_failure=zero
    trains on the failed samples and ends elsewhere."""
    args = [assets["cfg"], "train.steps=3", "algo.kl_coef=0.05", "rewards.on_failure=mask",
            "rewards.functions=[{name: exact_match}, {name: 'toy_rewards:fails_on_some', weight: 0.5}]"]
    runs = {"three": ["--nproc-per-node", "3"], "one": [], "min_rows": ["train.min_rows_per_micro_batch=2"],
            "zero": ["rewards.on_failure=zero"]}
    done = evenrl_many({name: ["train", *args, f"log.run_dir={tmp_path / name}", *more]
                        for name, more in runs.items()})
    rows = [r for r in metrics(tmp_path / "one") if r["step"] > 0]
    masked = [r["reward/masked_samples"] for r in rows]
    assert all(m > 0 for m in masked) and masked == [r["reward/failures"] for r in rows]
    # failures per entry, summed over ranks: the same on 3 processes; a warning per step names the entry and its error
    by_entry = [(r["reward/failures/exact_match"], r["reward/failures/fails_on_some"]) for r in rows]
    assert by_entry == [(0, m) for m in masked]
    assert by_entry == [(r["reward/failures/exact_match"], r["reward/failures/fails_on_some"])
                        for r in metrics(tmp_path / "three") if r["step"] > 0]
    warned = [line for line in done["one"].stdout.splitlines() if "reward fails_on_some failed on" in line]
    assert len(warned) == 3 and all("first error: ValueError: deliberate failure on" in w for w in warned), warned
    assert all(r["reward/masked_samples"] == 0 for r in metrics(tmp_path / "zero") if r["step"] > 0)
    one = final_params(tmp_path / "one")
    assert max_diff(one, final_params(tmp_path / "three")) <= 1e-5
    assert max_diff(one, final_params(tmp_path / "min_rows")) <= 1e-5
    assert max_diff(one, final_params(tmp_path / "zero")) > 1e-4
