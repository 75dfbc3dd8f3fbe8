"""train.reproducibility=bitwise, the parts that need no run: canonical batches (core.canonical) are the same on
any number of ranks, the plan's resume finding, the process settings' refusal, the weights' hash, `evenrl report`'s
comparison of two runs. The runs themselves: tests/test_bitwise_runs.py; the reductions on gloo: tests/test_dist.py
(test_bitwise_update_is_the_same_bits_on_any_world, test_fixed_point_sum_ignores_grouping_and_order)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenrl.config import load_config
from evenrl.core.canonical import canonical_schedule, prompt_batches, rollout_batches, unit_batches
from evenrl.core.schedule import make_schedule, rollout_shares
from evenrl.errors import UsageError
from evenrl.planner.layout import make_layout
from evenrl.planner.plan import make_plan


def micro_batches(schedule) -> list[list[tuple[int, ...]]]:
    """Per mini-batch, its non-empty micro-batches' rows, in a fixed order."""
    return [sorted(m.rows for micros in mb.per_rank for m in micros if m.rows) for mb in schedule.minibatches]


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=0, max_size=40), minibatches=st.integers(1, 4),
       cap=st.integers(20, 200), world=st.integers(2, 7), group=st.integers(1, 4), min_rows=st.integers(1, 2),
       data=st.data())
def test_canonical_micro_batches_do_not_depend_on_the_world(lengths, minibatches, cap, world, group, min_rows, data):
    n = len(lengths)
    inert = data.draw(st.lists(st.booleans(), min_size=n, max_size=n)) if min_rows == 1 else None
    kw = dict(minibatches=minibatches, token_cap=cap, groups=[i // group for i in range(n)], min_rows=min_rows,
              inert=inert)
    try:
        one = canonical_schedule(lengths, world=1, **kw)
    except UsageError:  # a mini-batch with fewer than min_rows rows: refused on every layout alike
        with pytest.raises(UsageError):
            canonical_schedule(lengths, world=world, **kw)
        return
    many = canonical_schedule(lengths, world=world, **kw)
    assert micro_batches(many) == micro_batches(one) == micro_batches(make_schedule(lengths, world=1, **kw))
    for mb in many.minibatches:
        assert len({len(micros) for micros in mb.per_rank}) == 1  # every rank as many micro-steps (fillers)
        ran = sorted(r for micros in mb.per_rank for m in micros for r in m.rows)
        assert ran == [r for r in mb.rows if not (inert and inert[r])]
    assert [mb.rows for mb in many.minibatches] == [mb.rows for mb in one.minibatches]


def test_whole_micro_batches_balance_worse_than_rows_and_say_so():
    """The price of whole micro-batches: 6 rows of 10 tokens under a cap of 30 over 3 ranks: the rounding schedule
    gives each rank 2 rows, bitwise cuts 2 micro-batches of 3 rows and one rank waits."""
    lengths = [10] * 6
    rounding = make_schedule(lengths, world=3, token_cap=30)
    bitwise = canonical_schedule(lengths, world=3, token_cap=30)
    assert rounding.rank_loads() == [20, 20, 20] and sorted(bitwise.rank_loads()) == [0, 30, 30]


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.integers(1, 300), min_size=1, max_size=12), n=st.integers(1, 5), units=st.integers(1, 7),
       per_batch=st.integers(1, 4))
def test_rollout_batches_hold_whole_prompts_the_same_on_any_layout(costs, n, units, per_batch):
    got = rollout_batches(costs, n, units, per_batch)
    assert len(got) == units
    batches = sorted(tuple(b) for unit in got for b in unit)
    one = sorted(tuple(b) for b in rollout_batches(costs, n, 1, per_batch)[0])
    assert batches == one == sorted(tuple((p, 0, n) for p in b) for b in prompt_batches(len(costs), per_batch))


def test_unit_batches_choose_by_the_mode():
    """The one choice the trainers, the reserved rollout ranks and partial rollouts share: bitwise deals canonical
    batches, rounding one call of each unit's rollout_shares (a prompt's samples may be split)."""
    costs, weights = [5.0, 40.0, 7.0], [1.0, 2.0]
    cfg = load_config(None, ["rollout.samples_per_prompt=3", "rollout.batch_prompts=2"])
    assert unit_batches(cfg, costs, 2, weights) == [[s] for s in rollout_shares(costs, 3, 2, weights)]
    cfg = load_config(None, ["rollout.samples_per_prompt=3", "rollout.batch_prompts=2",
                             "train.reproducibility=bitwise"])
    assert unit_batches(cfg, costs, 2, weights) == rollout_batches(costs, 3, 2, 2, weights)


def _plan(overrides=(), resumed=None):
    cfg = load_config(None, ["data.prompts_per_step=8", "rollout.samples_per_prompt=4", *overrides])
    return make_plan(cfg, make_layout(1, 4, device="cuda", device_memory_gib=80), resumed=resumed)


def test_a_resume_that_changes_what_bitwise_records_is_a_plan_warning():
    from evenrl.planner.reproducibility import recorded

    cfg = load_config(None, ["train.reproducibility=bitwise"])
    same = _plan(["train.reproducibility=bitwise"], resumed=recorded(cfg))
    assert "bitwise-resume" not in {f.rule for f in same.findings}
    was = {**recorded(cfg), "train.reproducibility": "rounding"}
    found = {f.rule: f for f in _plan(["train.reproducibility=bitwise"], resumed=was).findings}["bitwise-resume"]
    assert found.level == "warning" and "train.reproducibility=rounding" in found.message
    assert "bitwise-resume" not in {f.rule for f in _plan(resumed=was).findings}  # rounding promises nothing here


def test_bitwise_keys_lora_dropout_so_the_plan_does_not_warn_of_it():
    lora = ["model.lora.rank=8", "model.lora.dropout=0.05"]
    assert "lora-dropout" in {f.rule for f in _plan(lora).findings}
    assert "lora-dropout" not in {f.rule for f in _plan([*lora, "train.reproducibility=bitwise"]).findings}


def test_bitwise_idle_ranks_are_fixed_by_a_smaller_token_cap():
    """Whole micro-batches: a cap that holds the mini-batch in one leaves 3 of 4 ranks idle; the fix it names
    gives every rank one."""
    big = _plan(["train.reproducibility=bitwise", "train.token_cap_per_micro_batch=1000000"])
    found = {f.rule: f for f in big.findings}["idle-ranks"]
    assert "whole micro-batches" in found.message and found.fix.startswith("train.token_cap_per_micro_batch=")
    fixed = _plan(["train.reproducibility=bitwise", found.fix])
    assert "idle-ranks" not in {f.rule for f in fixed.findings} and not fixed.idle


def test_bitwise_memory_fixes_offer_no_model_parallel_degree():
    """A 32B model over 8 x 80 GB: rounding's first fix is tensor parallelism, which bitwise refuses; bitwise's
    plan offers what it can run (CPU offload) and --fit takes it."""
    from pathlib import Path

    from evenrl.planner.fit import fit

    path = Path(__file__).resolve().parents[1] / "examples" / "tp_32b.yaml"
    layout = make_layout(1, 8, device="cuda", device_memory_gib=80)
    fixes = {m: {f.rule: f for f in make_plan(load_config(path, [f"train.reproducibility={m}"]), layout).findings}
             ["memory-over"].fix for m in ("rounding", "bitwise")}
    assert "parallel.tensor_parallel_size=4" in fixes["rounding"]
    assert "parallel_size" not in fixes["bitwise"] and "parallel.cpu_offload=full" in fixes["bitwise"]
    fitted, _ = fit(make_plan(load_config(path, ["train.reproducibility=bitwise"]), layout))
    assert fitted.parallel.tensor_parallel_size == 1 and fitted.parallel.cpu_offload == "full"


def test_bitwise_on_cpu_refuses_another_thread_count(monkeypatch):
    from evenrl.train.determinism import settle

    cfg = load_config(None, ["train.reproducibility=bitwise"])
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with pytest.raises(UsageError, match="OMP_NUM_THREADS") as e:
        settle(cfg, torch.device("cpu"))
    assert "\n" not in str(e.value)
    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        settle(cfg, torch.device("cpu"))
        assert torch.get_num_threads() == 1
        settle(load_config(None, []), torch.device("cpu"))  # rounding: nothing checked, nothing set
    finally:
        torch.set_num_threads(threads)


def test_weights_hash_sees_every_bit_and_every_place():
    from evenrl.distributed.exact import weights_hash

    torch.manual_seed(0)
    a, b = torch.randn(5, 3), torch.randn(4)
    h = weights_hash([a, b])
    assert len(h) == 16 and weights_hash([a.clone(), b.clone()]) == h
    flipped = a.clone()
    flipped.view(torch.int32)[2, 1] ^= 1  # the last bit of one element
    assert weights_hash([flipped, b]) != h
    swapped = a.clone()
    swapped[0, 0], swapped[0, 1] = a[0, 1], a[0, 0]
    assert weights_hash([swapped, b]) != h and weights_hash([b, a]) != weights_hash([a, b])


def _metrics(path, hashes):
    path.mkdir()
    rows = [{"step": s, "reward/mean": 0.1 * s, **({"weights/hash": h} if h else {})} for s, h in enumerate(hashes)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_names_the_first_step_two_runs_differ(tmp_path, capsys):
    from e2e import evenrl_here

    _metrics(tmp_path / "a", [None, "aa", "bb", "cc", "dd"])
    _metrics(tmp_path / "b", [None, "aa", "bb", "xx", "yy"])
    _metrics(tmp_path / "c", [None, "aa", "bb", "cc"])
    _metrics(tmp_path / "d", [None, None])
    code, out, _ = evenrl_here(capsys, "report", tmp_path / "a", tmp_path / "b")
    assert code == 0 and "weights first differ at step 3 (4 steps compared)" in out
    assert (tmp_path / "a" / "plots" / "compare.png").exists()
    code, out, _ = evenrl_here(capsys, "report", tmp_path / "a", tmp_path / "c")
    assert code == 0 and "weights identical at all 3 steps both runs logged" in out
    code, _, err = evenrl_here(capsys, "report", tmp_path / "a", tmp_path / "d")
    assert code == 2 and "no step logged weights/hash in both" in err and len(err.strip().splitlines()) == 1


def test_elementwise_adamw_is_torchs_adamw_and_the_same_bits_on_any_shard():
    """bitwise's optimizer (FSDP2 shards a tensor differently on each world): torch's AdamW in value, and an
    element's new value the same whether its tensor is stepped whole or cut into shards of any size. torch's fused
    AdamW on these numbers (this machine, torch 2.13) moved 1 element of the 22/22/20 shards and 5 of 13 shards of
    5 by one ulp against the whole tensor (its vector body and scalar tail round differently); not asserted here,
    as it depends on the CPU's vector width."""
    from evenrl.distributed.exact import ElementwiseAdamW

    torch.manual_seed(1)
    start, grads = torch.randn(64) * 0.02, [torch.randn(64) * 10.0 ** -(k % 6) for k in range(8)]
    kw = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)

    def run(pieces: list[int], kind) -> torch.Tensor:
        params = [torch.nn.Parameter(x.clone()) for x in start.split(pieces)]
        opt = kind(params, **kw)
        for g in grads:
            for p, x in zip(params, g.split(pieces)):
                p.grad = x.clone()
            opt.step()
        assert set(opt.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}  # torch's state: its checkpoints
        return torch.cat([p.detach() for p in params])

    whole = run([64], ElementwiseAdamW)
    assert (whole - start).abs().max() > 4e-3  # it moved (8 steps of lr 1e-3)
    assert torch.allclose(whole, run([64], torch.optim.AdamW), rtol=0, atol=1e-7)
    for pieces in ([22, 22, 20], [32, 32], [1, 63], [21, 21, 22], [5] * 12 + [4]):
        assert torch.equal(run(pieces, ElementwiseAdamW), whole), pieces
