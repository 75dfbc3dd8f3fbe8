"""Tensor parallelism (parallel.tensor_parallel_size, evenrl.distributed.tensor_parallel) and the one mesh it lives
on (evenrl.distributed.mesh_shape): the shape's arithmetic without processes; on gloo, a model split over 2 ranks
against the unsplit one (forward bit for bit, gradients within rounding), with LoRA; and `evenrl train` at TP = 2
resuming a 1-process checkpoint (DCP reshards it) against the uninterrupted 1-process run."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from evenrl.distributed.mesh_shape import Coords, MeshShape


def test_mesh_shape_lays_tp_fastest_then_sp_then_dp():
    s = MeshShape(world=8, sp=2, tp=2)
    assert (s.trainers, s.replica, s.dp) == (8, 4, 2)
    assert s.coords(5) == Coords(dp=1, sp=0, tp=1) and all(s.rank_of(s.coords(r)) == r for r in range(8))
    assert s.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert s.groups("sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert s.groups("data") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradient reduction: one group per tp index
    assert s.groups("replica") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the ranks that train the same samples
    for dim in ("tp", "sp", "data", "replica"):  # every training rank in exactly one group of each dimension
        assert sorted(r for g in s.groups(dim) for r in g) == list(range(8))


def test_mesh_shape_with_reserved_rollout_ranks_and_engines():
    s = MeshShape(world=6, rollout=2, tp=2, engine_tp=2)
    assert s.trainers == 4 and s.coords(4) is None and s.coords(3) == Coords(1, 0, 1)
    assert s.groups("engine") == [[4, 5]]  # reserved: an engine spans rollout devices
    assert MeshShape(world=4, engine_tp=2).groups("engine") == [[0, 1], [2, 3]]  # colocated: training ranks
    assert "(+ 2 rollout)" in s.describe()


@pytest.mark.parametrize("shape, says", [
    (MeshShape(world=6, tp=4), "parallel.tensor_parallel_size 4 = 4 ranks per replica must divide the 6 training"),
    (MeshShape(world=8, sp=2, tp=3), "parallel.sequence_parallel_size 2 x parallel.tensor_parallel_size 3 = 6"),
    (MeshShape(world=4, rollout=4), "parallel.rollout_devices: got 4"),
    (MeshShape(world=5, rollout=2, engine_tp=3), "rollout.tensor_parallel_size: got 3; each engine spans that many of "
                                                 "the 2 rollout devices"),
])
def test_mesh_shape_problems_are_one_line_each(shape, says):
    wrong = shape.problems()
    assert len(wrong) == 1 and says in wrong[0] and "\n" not in wrong[0]


def _split_worker(rank: int, world: int, port: int, path: str, out: str, lora: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from e2e import with_random_adapters
    from evenrl.core.batch import Batch, Ragged
    from evenrl.distributed import collectives as dist
    from evenrl.distributed.sequence import sequence_parallel
    from evenrl.distributed.tensor_parallel import tensor_parallel
    from evenrl.models.forward import response_logits, response_logprobs
    from evenrl.models.loading import load_policy

    torch.manual_seed(0)
    info = dist.init(tensor_parallel=world)
    model, tok = load_policy(path)
    if lora:
        model = with_random_adapters(model)
    model.train()
    if world > 1:
        tensor_parallel(model, dist.device_mesh(info.device)["tp"])
    sequence_parallel(model, dist.sequence_group())  # the packed forward a split model trains with
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 40, (n,), generator=g) for n in (9, 14, 6)]
    batch = Batch({"tokens": Ragged.of(rows, torch.long), "response_len": torch.tensor([4, 7, 3])})
    outputs, _, mask = response_logprobs(model, batch, tok.pad_token_id, entropy=True, entropy_grad=True)
    ((outputs[..., 0] * mask).sum() + 0.1 * (outputs[..., 1] * mask).sum()).backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        logits, _, _ = response_logits(model, batch, tok.pad_token_id)
    if rank == 0:
        torch.save({"outputs": outputs.detach(), "logits": logits, "grads": grads}, out)
    dist.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_a_model_split_over_two_ranks_computes_the_unsplit_model(tmp_path, lora):
    """The stable plan sums no partial products across ranks in the forward, and the split output layer's
    log-sum-exp adds the same exps in float64: logits, log-probs and entropies equal bit for bit. The backward of
    a column-wise projection sums its input's gradient over the ranks (another order than one matmul): each
    gradient within 1e-6 of its largest entry (measured: about 7e-7 at most, 3e-7 typically)."""
    from evenrl.testing import make_tiny_model

    path = make_tiny_model(str(tmp_path / "model"), hidden=64, heads=4, layers=2)
    got = {}
    for world, port in ((1, 29581), (2, 29582)):
        out = str(tmp_path / f"out{world}.pt")
        mp.spawn(_split_worker, args=(world, port, path, out, lora), nprocs=world, join=True)
        got[world] = torch.load(out)
    one, two = got[1], got[2]
    assert torch.equal(one["logits"], two["logits"])
    assert torch.equal(one["outputs"], two["outputs"])
    assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) > 0
    for name, g in one["grads"].items():
        assert (g - two["grads"][name]).abs().max() <= 1e-6 * g.abs().max().clamp(min=1e-3), name
    assert any(float((g - two["grads"][n]).abs().max()) > 0 for n, g in one["grads"].items())  # really split


@pytest.mark.slow
def test_tensor_parallel_run_resumes_a_one_process_checkpoint(shared_runs, assets, tmp_path):
    """The shared config's 1-process run checkpointed at step 2; steps 3-4 on a TP group of 2 (--resume at
    another layout: DCP reads the whole tensors into shards): the same rewards, losses and greedy evaluation.
    The weights: TP's gradients differ from one device's by rounding (~3e-7 of their size, the test above), and
    Adam divides each gradient entry by its own magnitude, so an entry whose gradient is near zero moves by up to
    a few 1e-5 (measured: 1 entry of 80,704 above 5e-6 on the 2-step assets config, 1.8e-5; DP on 2 ranks there:
    4.1e-6); every other entry within 5e-6."""
    from e2e import copy_checkpoint, evenrl, final_params, metrics

    run = copy_checkpoint(shared_runs.one, 2, tmp_path / "tp")
    evenrl("train", *shared_runs.args, f"log.run_dir={run}", "--resume", "--nproc-per-node", 2,
           "parallel.tensor_parallel_size=2")
    one, split = metrics(shared_runs.one), metrics(run)
    assert [r["step"] for r in split] == [r["step"] for r in one]
    assert [r.get("reward/mean") for r in split] == [r.get("reward/mean") for r in one]
    assert [r.get("eval/reward") for r in split] == [r.get("eval/reward") for r in one]
    for x, y in zip(one[-2:], split[-2:]):  # the statistics are counted once per replica, not once per rank
        assert abs(x["policy/loss"] - y["policy/loss"]) <= 1e-6 and x["samples"] == y["samples"]
    a, b = final_params(shared_runs.one), final_params(run)
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert diffs.max() <= 5e-5 and int((diffs > 5e-6).sum()) <= 3, (float(diffs.max()), int((diffs > 5e-6).sum()))
    from safetensors.torch import load_file

    start = load_file(os.path.join(assets["model"], "model.safetensors"))
    assert max(float((b[k] - start[k]).abs().max()) for k in b if k in start) > 100 * float(diffs.max())  # moved
