"""parallel.sharding=fsdp (FSDP2) stays on the exact path: the same model as the replicated run on any number of
ranks, checkpoints that resume on another number of ranks and in the other sharding mode, and bf16 mixed precision
that keeps fp32 master weights.

Every comparison is against shared_runs.one, the uninterrupted replicated 1-process run of the shared config
(7 prompts x 3 samples, 2 mini-batches, 4 steps, a checkpoint every 2 steps, greedy eval): a difference can only
come from sharding, the layout or the resume under test. Tolerance 1e-5 (fp32): FSDP's reduce-scatter sums in
another order than the replicated all-reduce, and a sharded model runs the model's own forward where the replicated
one runs the packed one; measured differences are ~3e-7.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from e2e import copy_checkpoint, evenrl, evenrl_many, final_params, max_diff, metrics

FSDP = "parallel.sharding=fsdp"
TOL = 1e-5


SHARDED = {"w3": ["--nproc-per-node", "3"], "w2_ckpt": ["--nproc-per-node", "2", "model.gradient_checkpointing=true"],
           "w1": []}


@pytest.fixture(scope="module")
def sharded_runs(shared_runs, tmp_path_factory):
    """The shared config (4 steps, a checkpoint every 2) under FSDP on 3, 2 (activation checkpointing) and 1 ranks,
    two at a time. w3's step-2 checkpoint also starts test_resume_on_other_rank_counts_and_sharding_modes."""
    root = tmp_path_factory.mktemp("sharded")
    evenrl_many({name: ["train", *shared_runs.args, FSDP, f"log.run_dir={root / name}", *more]
                 for name, more in SHARDED.items()})
    return root


@pytest.mark.slow
def test_fsdp_gives_the_replicated_model_on_1_2_and_3_ranks(shared_runs, sharded_runs):
    """FSDP on 1, 2 (with activation checkpointing per block) and 3 ranks (7 prompts x 3 samples split unevenly)
    ends where the replicated run does; the step metrics agree too."""
    want = final_params(shared_runs.one)
    for name in SHARDED:
        diff = max_diff(want, final_params(sharded_runs / name))
        assert diff <= TOL, (name, diff)
        got = metrics(sharded_runs / name)
        assert [r.get("eval/reward") for r in got] == [r.get("eval/reward") for r in metrics(shared_runs.one)]
        assert [r["samples"] for r in got if r["step"] > 0] == [21] * 4
    assert "sharding: fsdp" in (sharded_runs / "w3" / "config.yaml").read_text()


@pytest.mark.slow
def test_a_rank_without_samples_still_meets_fsdp_collectives(assets, tmp_path):
    """1 prompt x 2 samples on 3 ranks: one rank generates nothing and trains nothing, yet runs FSDP's gathers and
    reduce-scatters (zero-weight filler passes), with a KL reference (sharded too) in the loss; same model as one
    replicated process."""
    args = [assets["cfg"], "data.prompts_per_step=1", "rollout.samples_per_prompt=2", "algo.kl_coef=0.1",
            "algo.minibatches_per_step=1", "train.steps=3", "train.skip_zero_gradient_samples=false"]
    evenrl_many({"fsdp3": ["train", *args, FSDP, f"log.run_dir={tmp_path / 'fsdp3'}", "--nproc-per-node", "3"],
                 "one": ["train", *args, f"log.run_dir={tmp_path / 'one'}"]})
    rows = [r for r in metrics(tmp_path / "fsdp3") if r["step"] > 0]
    assert all(0 in r["load/rank_tokens"] for r in rows), "every rank had work: weak test"
    diff = max_diff(final_params(tmp_path / "one"), final_params(tmp_path / "fsdp3"))
    assert 0 < max_diff(final_params(tmp_path / "one"), _start(assets)) and diff <= TOL, diff


def _start(assets) -> dict:
    from pathlib import Path

    return load_file(str(Path(assets["model"]) / "model.safetensors"))


def _chain(args, run_dir, hops, resumed: bool = False):
    """Run the shared config (`args`: e2e.shared_args) in hops: [(steps, processes, extra args)], each hop resuming
    the previous one (the first too when `resumed`: run_dir already holds a checkpoint)."""
    for i, (steps, procs, extra) in enumerate(hops):
        evenrl("train", *args, f"log.run_dir={run_dir}", f"train.steps={steps}",
               "--nproc-per-node", procs, *extra, *(["--resume"] if i or resumed else []))


@pytest.mark.slow
def test_resume_on_other_rank_counts_and_sharding_modes(shared_runs, sharded_runs, tmp_path):
    """Saved sharded on 3 ranks (sharded_runs' w3 at step 2), resumed replicated on 2, then sharded on 1: the same
    model as the uninterrupted run (the checkpoint holds optimizer moments too: a resume that lost them would move
    the weights differently)."""
    run = tmp_path / "run"
    copy_checkpoint(sharded_runs / "w3", 2, run)
    _chain(shared_runs.args, run, [(3, 2, []), (4, 1, [FSDP])], resumed=True)
    diff = max_diff(final_params(shared_runs.one), final_params(run))
    assert diff <= TOL, diff
    assert [r["step"] for r in metrics(run)] == [0, 1, 2, 3, 4]
    ckpt = run / "checkpoints" / "step-000004"
    assert json.loads((ckpt / "meta.json").read_text())["world"] == 1
    assert (ckpt / "state" / ".metadata").is_file()


@pytest.mark.slow
@pytest.mark.large_world
def test_resume_sharded_3_then_2_then_4_ranks(shared_runs, tmp_path):
    """Sharded on 3, 2, then 4 ranks: the shared config's one-process model (shared_runs.one: `make test` runs the
    large_world tests in the default suite's session, which has made it)."""
    run = tmp_path / "run"
    _chain(shared_runs.args, run, [(2, 3, [FSDP]), (3, 2, [FSDP]), (4, 4, [FSDP])])
    diff = max_diff(final_params(shared_runs.one), final_params(run))
    assert diff <= TOL, diff


@pytest.mark.slow
def test_bf16_mixed_precision_tracks_fp32_and_keeps_small_updates(assets, tmp_path):
    """evenrl sft (deterministic data, so the two runs see the same rows) for 10 steps on 2 sharded ranks, fp32 vs
    bf16 compute: the loss curves agree within 2 % per step, and with a learning rate (1e-5) whose AdamW updates are
    below bf16's resolution for these weights (~1e-4 at 0.03), bf16 still changes the parameters where fp32 does:
    the master weights are fp32."""
    args = [assets["cfg"], FSDP, "--nproc-per-node", "2", "sft.steps=10", "sft.rows_per_step=16", "sft.lr=1e-5"]
    evenrl_many({dtype: ["sft", *args, f"model.dtype={dtype}", f"log.run_dir={tmp_path / dtype}"]
                 for dtype in ("float32", "bfloat16")})
    nll = {d: [r["sft/nll"] for r in metrics(tmp_path / d)] for d in ("float32", "bfloat16")}
    assert len(nll["float32"]) == 10
    for a, b in zip(nll["float32"], nll["bfloat16"]):
        assert abs(a - b) <= 0.02 * abs(a), (nll["float32"], nll["bfloat16"])
    start = _start(assets)
    f32, b16 = final_params(tmp_path / "float32"), final_params(tmp_path / "bfloat16")
    assert all(t.dtype == torch.float32 for t in b16.values())
    moved32 = torch.cat([(f32[k] != start[k]).flatten() for k in start])
    moved16 = torch.cat([(b16[k] != start[k]).flatten() for k in start])
    assert moved32.float().mean() > 0.9, "fp32 barely moved: weak test"
    assert (moved16 & moved32).sum() >= 0.99 * moved32.sum(), (int(moved16.sum()), int(moved32.sum()))
    # why lr=1e-5 tells the two apart: for most weights a 1e-5 step is under half a bf16 spacing, so bf16
    # parameters under AdamW would round most single updates away
    weights = torch.cat([v.flatten().abs() for v in start.values()])
    assert ((weights * 2.0**-8) / 2 > 1e-5).float().mean() > 0.5


@pytest.mark.slow
def test_bf16_rl_steps_run_sharded_and_replicated(assets, tmp_path):
    """The RL step in bf16 compute (FSDP's policy on 2 ranks; autocast on 1 replicated rank) with a KL reference
    held in bf16: finite metrics, fp32 weights saved, and both close to each other (bf16 rounding, not exactness:
    sampling in bf16 can pick other tokens, so only the rewards' scale is compared)."""
    args = [assets["cfg"], "model.dtype=bfloat16", "algo.kl_coef=0.05", "train.steps=2"]
    evenrl_many({"fsdp": ["train", *args, FSDP, "--nproc-per-node", "2", f"log.run_dir={tmp_path / 'fsdp'}"],
                 "repl": ["train", *args, f"log.run_dir={tmp_path / 'repl'}"]})
    for name in ("fsdp", "repl"):
        rows = [r for r in metrics(tmp_path / name) if r["step"] > 0]
        assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["policy/loss"])) for r in rows)
        params = final_params(tmp_path / name)
        assert all(t.dtype == torch.float32 for t in params.values())
        assert max_diff(params, _start(assets)) > 0


def test_offload_on_a_cpu_only_machine_is_refused_before_anything_runs(assets, tmp_path, capsys):
    from evenrl.cli import main

    run = tmp_path / "run"
    code = main(["train", str(assets["cfg"]), FSDP, "parallel.cpu_offload=full", f"log.run_dir={run}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cpu_offload" in err[0], err
    assert not run.exists()


def test_gathered_weights_and_buckets_on_one_sharded_rank(assets):
    """full_weights yields every state-dict name once per bucket walk, tied names as one tensor, within the bucket
    bound; gathered() makes the parameters plain tensors and puts the shards back after."""
    import torch.distributed as tdist

    from evenrl.distributed import collectives as dist
    from evenrl.distributed.sharding import shard
    from evenrl.distributed.weights import full_weights, gathered
    from evenrl.models.loading import load_policy

    model, _ = load_policy(assets["model"])
    want = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        shard(model)
        assert all(type(p.data) is not torch.Tensor for p in model.parameters())
        with gathered(model):
            assert all(type(p.data) is torch.Tensor for p in model.parameters())
        assert all(type(p.data) is not torch.Tensor for p in model.parameters())
        largest = max(v.nbytes for v in want.values())
        buckets = list(full_weights(model, bucket_bytes=largest))
        sizes = [sum({id(t): t.nbytes for _, t in b}.values()) for b in buckets]  # a tied tensor counts once
        assert len(buckets) > 1 and all(size <= largest for size in sizes)
        got = dict(kv for b in buckets for kv in b)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        if tdist.is_initialized():
            dist.shutdown()
