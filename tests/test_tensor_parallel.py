"""Tensor parallelism (parallel.tensor_parallel_size, evenrl.distributed.tensor_parallel) and the one mesh it lives
on (evenrl.distributed.mesh_shape): the shape's arithmetic without processes; on gloo, a model split over 2 ranks
against the unsplit one (forward bit for bit, gradients within rounding), with LoRA and a Qwen3 (per-head q/k
norms); what ranks that sample together cannot do, refused by the run as the plan does (config.compatibility), and a
mixture of experts; and the exactness matrix of `evenrl train` against the shared config's 1-process run: TP = 2
resuming a 1-process checkpoint (DCP reshards it), TP = 2 beside a reserved rollout rank whose checkpoint a 1-process
run resumes (TP 2 -> 1), and (large_world, a Qwen3) DP 2 x TP 2 replicated and sharded, SP 2 x TP 2. Greedy
evaluation runs on the split model in all of them. vLLM engines over several devices: tests/test_engines.py;
multi-turn: tests/test_multiturn_runs.py.

Final weights under TP: the forward is bit for bit, but the backward of a column-wise projection sums its input's
gradient over the ranks (another order than one matmul: ~3e-7 of a gradient's size), and Adam divides each
gradient entry by its own magnitude, so an entry whose gradient is near zero moves by up to a few 1e-5 while every
other stays within rounding: e2e.close_weights' bound, the one every layout test states (measured on the 4-step
shared config: 1-2 entries of 80,704 above 5e-6, max 1.1e-5-1.8e-5; DP on 2 ranks there: 4.1e-6)."""

import os

import pytest
import torch

from e2e import free_port, spawn
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
    torch.save({"outputs": outputs.detach(), "logits": logits, "grads": grads}, f"{out}.{rank}")
    dist.shutdown()
    os._exit(0)  # past the interpreter's teardown, where gloo's threads once aborted a rank (SIGABRT)


@pytest.mark.slow
@pytest.mark.parametrize("arch, lora", [("qwen2", False), ("qwen2", True), ("qwen3", False)])
def test_a_model_split_over_two_ranks_computes_the_unsplit_model(tmp_path, arch, lora):
    """The stable plan sums no partial products across ranks in the forward, and the split output layer's
    log-sum-exp adds the same exps in float64: logits, log-probs and entropies equal bit for bit. The backward of
    a column-wise projection sums its input's gradient over the ranks (another order than one matmul): each
    gradient within 1e-6 of its largest entry (measured: about 7e-7 at most, 3e-7 typically). Qwen3's per-head
    q_norm / k_norm (whole on every rank, applied to the rank's own heads) are checked on every rank: each one's
    gradient was its own heads' alone before the plan summed it over the group (off by up to the whole gradient)."""
    from evenrl.testing import make_tiny_model

    path = make_tiny_model(str(tmp_path / "model"), arch=arch, hidden=64, heads=4, layers=2)
    got = {}
    for world in (1, 2):
        out = str(tmp_path / f"out{world}.pt")
        spawn(_split_worker, args=(world, free_port(), path, out, lora), nprocs=world)
        got[world] = [torch.load(f"{out}.{rank}") for rank in range(world)]
    (one,), ranks = got[1], got[2]
    assert (arch == "qwen3") == any("q_norm" in n for n in one["grads"])
    for two in ranks:  # a weight whole on every rank has the whole model's gradient on each of them
        assert torch.equal(one["logits"], two["logits"])
        assert torch.equal(one["outputs"], two["outputs"])
        assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) > 0
        for name, g in one["grads"].items():
            assert (g - two["grads"][name]).abs().max() <= 1e-6 * g.abs().max().clamp(min=1e-3), name
    two = ranks[0]
    assert all(torch.equal(g, ranks[1]["grads"][n]) for n, g in two["grads"].items())  # replicas stay one
    assert any(float((g - two["grads"][n]).abs().max()) > 0 for n, g in one["grads"].items())  # really split


def same_run(one, run, steps=None) -> None:
    """`run` took the 1-process run's steps (the last `steps` of them with their statistics): the same rewards and
    greedy evaluation at every step, the same losses and sample counts (counted once per replica, not per rank)."""
    from e2e import metrics

    a, b = metrics(one), metrics(run)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    assert sum(r.get("eval/reward") is not None for r in b) >= 2  # greedy evaluation ran (e2e.shared_args)
    for key in ("reward/mean", "eval/reward", "response/length_mean"):
        assert [r.get(key) for r in b] == [r.get(key) for r in a], (run, key)
    for x, y in zip(a[-(steps or len(a) - 1):], b[-(steps or len(b) - 1):]):
        assert abs(x["policy/loss"] - y["policy/loss"]) <= 1e-6 and x["samples"] == y["samples"], (run, x["step"])


@pytest.mark.slow
def test_tensor_parallel_run_resumes_a_one_process_checkpoint(shared_runs, assets, tmp_path):
    """The shared config's 1-process run checkpointed at step 2; steps 3-4 on a TP group of 2 (--resume at
    another layout: DCP reads the whole tensors into shards): the same rewards, losses and greedy evaluation, the
    weights within e2e.close_weights' bound, and moved."""
    from e2e import close_weights, copy_checkpoint, evenrl, final_params, max_diff

    run = copy_checkpoint(shared_runs.one, 2, tmp_path / "tp")
    evenrl("train", *shared_runs.args, f"log.run_dir={run}", "--resume", "--nproc-per-node", 2,
           "parallel.tensor_parallel_size=2")
    same_run(shared_runs.one, run, steps=2)
    assert not (far := close_weights(final_params(shared_runs.one), final_params(run))), far
    from safetensors.torch import load_file

    start, b = load_file(os.path.join(assets["model"], "model.safetensors")), final_params(run)
    assert max_diff({k: start[k] for k in b}, b) > 1e-3  # moved: the bound above means something


@pytest.mark.slow
def test_tensor_parallel_beside_a_reserved_rollout_rank_then_resumed_on_one_process(shared_runs, tmp_path):
    """3 processes: a TP group of 2 trainers and a reserved hf rollout rank (a whole copy, the pushes' layout that
    of the unsplit model), the shared config's 4 steps; then its step-2 checkpoint, taken at TP = 2, resumed on one
    process (TP 2 -> 1: DCP gathers the shards). Both are the 1-process run: the same samples, rewards, losses and
    greedy evaluation (on the split model), the weights within e2e.close_weights' bound."""
    from e2e import close_weights, copy_checkpoint, evenrl, final_params

    run = tmp_path / "reserved"
    evenrl("train", *shared_runs.args, f"log.run_dir={run}", "--nproc-per-node", 3, "--rollout-devices", 1,
           "parallel.tensor_parallel_size=2")
    same_run(shared_runs.one, run)
    assert not (far := close_weights(final_params(shared_runs.one), final_params(run))), far
    back = copy_checkpoint(run, 2, tmp_path / "back")
    evenrl("train", *shared_runs.args, f"log.run_dir={back}", "--resume")
    same_run(shared_runs.one, back, steps=2)
    assert not (far := close_weights(final_params(shared_runs.one), final_params(back))), far


@pytest.mark.slow
@pytest.mark.large_world
def test_data_and_sequence_parallel_beside_tensor_parallel_on_four_processes(assets, tmp_path):
    """DP 2 x TP 2 replicated, DP 2 x TP 2 with FSDP2 over the data dimension (2-D: each weight split on tp and
    sharded on data) and SP 2 x TP 2, 4 processes each, against the same config on 1 process (made here), on a tiny
    Qwen3 (its per-head q_norm / k_norm: PER_HEAD, summed over the TP group, under FSDP2 too), 2 steps: the same
    rewards, losses and greedy evaluation, the weights within e2e.close_weights' bound (measured after 4 steps:
    4.1e-6, 4.1e-6 and 3.6e-6; the q/k norms 6e-8; on Qwen2 1.1e-5, 1.2e-5 and 1.8e-5). The sharded one found
    ops.clip_grad_norm counting FSDP2's _StridedShard as whole: weights 4.5e-3 off.

    And train.reproducibility=bitwise beside TP 2: TP 2 on 2 processes (one data group), on 4 (two) and on 4 with
    FSDP2 over the data dimension are one run, the same bits (weights, every step's metrics and weights/hash: the
    gradients summed in fixed point over the data group, FSDP2's reduce-scatter of the tp shards in fixed point, the
    norm's and the hash's integer sums over the tp group too; replicated and FSDP2 agree on this config, measured).
    Negative control: TP 2 on 2 and on 4 processes under rounding differ. Not claimed: TP 2's bits equal TP 1's (each layer's row-parallel sum over the TP group is an
    fp32 sum of 2 partial products; measured 8.6e-6 apart after 3 steps on a tiny Qwen2)."""
    from e2e import BITWISE, assert_same_run, close_weights, evenrl_many, final_params, max_diff, shared_args
    from evenrl.testing import make_tiny_model

    qwen3 = f"model.path={make_tiny_model(str(tmp_path / 'qwen3'), arch='qwen3')}"
    # 2 steps of the shared config, no checkpoint (4 steps and 2 checkpoints cost 142 s of the suite's time)
    args = [*shared_args(assets), qwen3, "train.steps=2", "checkpoint.every_steps=0"]
    tp = ["--nproc-per-node", 4, "parallel.tensor_parallel_size=2"]
    tp_alone = ["--nproc-per-node", 2, "parallel.tensor_parallel_size=2"]
    runs = {"dp_tp": tp, "dp_tp_bitwise": [*tp, BITWISE], "dp_tp_fsdp": [*tp, "parallel.sharding=fsdp"],
            "dp_tp_fsdp_bitwise": [*tp, "parallel.sharding=fsdp", BITWISE],
            "sp_tp": [*tp, "parallel.sequence_parallel_size=2"], "tp_bitwise": [*tp_alone, BITWISE],
            "tp": tp_alone, "one": []}
    evenrl_many({name: ["train", *args, f"log.run_dir={tmp_path / name}", *more] for name, more in runs.items()})
    for name in ("dp_tp", "dp_tp_fsdp", "sp_tp"):
        same_run(tmp_path / "one", tmp_path / name)
        assert not (far := close_weights(final_params(tmp_path / "one"), final_params(tmp_path / name))), (name, far)
    for name in ("dp_tp_bitwise", "dp_tp_fsdp_bitwise"):
        assert_same_run(tmp_path / "tp_bitwise", tmp_path / name)
    assert max_diff(final_params(tmp_path / "tp"), final_params(tmp_path / "dp_tp")) > 0.0


@pytest.mark.parametrize("settings, rule", [
    ({"rollout.tensor_parallel_size": 2}, "tensor-parallel-engine"),
    ({"parallel.tensor_parallel_size": 2, "rollout.agent": "toy_agents:two_tools"}, "tensor-parallel-agents"),
    ({"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2, "rollout.agent": "toy_agents:two_tools"},
     "tensor-parallel-agents"),
    ({"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2, "model.path": "VL"}, "tensor-parallel-vision"),
])
def test_the_run_refuses_what_ranks_sampling_together_cannot_do_as_the_plan_does(assets, tmp_path, settings, rule):
    """config.compatibility is one table: the run's check before anything loads (planner.compatibility.check_run,
    which train.trainer.check_settings calls with the rank's device) reads model.path's config.json as the plan does
    and says what the plan's finding says, in one line."""
    from evenrl.config import load_config, with_settings
    from evenrl.errors import UsageError
    from evenrl.planner.layout import make_layout
    from evenrl.planner.plan import make_plan
    from evenrl.testing import make_tiny_model
    from evenrl.planner.compatibility import check_run

    if settings.get("model.path") == "VL":
        settings = {**settings, "model.path": make_tiny_model(str(tmp_path / "vl"), arch="qwen2_vl")}
    cfg = with_settings(load_config(str(assets["cfg"]), []), settings)
    with pytest.raises(UsageError) as e:
        check_run(cfg, device="cpu", rollout_devices=0)
    found = [f for f in make_plan(cfg, make_layout(nproc_per_node=2)).findings if f.rule == rule]
    assert len(found) == 1 and found[0].level == "error"
    assert str(e.value) == f"{found[0].message}; fix: {found[0].fix}" and "\n" not in str(e.value)


def test_a_mixture_of_experts_is_split_beside_expert_parallelism_only(assets, tmp_path, capsys):
    """TP on a mixture without EP is the plan's tensor-parallel-model (one line, exit 2, before anything loads). The
    run's own check where the model is split (distributed.tensor_parallel.check, which train.parallelize.split_tensors
    runs first) takes a Qwen3-MoE and a Qwen2-MoE (its shared expert split as a dense MLP) and refuses gpt-oss (its
    per-head attention sinks) in one line; a DeepSeek-V3 (latent attention) is no model the plan covers."""
    from e2e import evenrl_here
    from evenrl.distributed.tensor_parallel import _targets, check, supports
    from evenrl.errors import UsageError
    from evenrl.models.loading import load_policy
    from evenrl.testing import make_tiny_model

    path = make_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe")
    code, _, err = evenrl_here(capsys, "train", assets["cfg"], f"model.path={path}", "parallel.tensor_parallel_size=2",
                               "--nproc-per-node", 2, f"log.run_dir={tmp_path / 'run'}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "plan tensor-parallel-model" in err, err
    assert "a mixture of experts (qwen3_moe) without expert parallelism" in err
    assert not (tmp_path / "run").exists()  # nothing written
    check(load_policy(path)[0], 2)
    qwen2_moe, _ = load_policy(make_tiny_model(str(tmp_path / "q2"), arch="qwen2_moe"))
    check(qwen2_moe, 2)
    assert [n for n, _ in _targets(qwen2_moe.model) if ".mlp." in n] == [
        f"layers.{i}.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj") for i in range(2)]
    gpt_oss, _ = load_policy(make_tiny_model(str(tmp_path / "oss"), arch="gpt_oss"))
    with pytest.raises(UsageError, match="whose attention has 'sinks' beside its projections") as e:
        check(gpt_oss, 2)
    assert "\n" not in str(e.value)
    deepseek, _ = load_policy(make_tiny_model(str(tmp_path / "ds"), arch="deepseek_v3"))
    assert not supports(deepseek) and supports(load_policy(make_tiny_model(str(tmp_path / "dense")))[0])


def test_per_head_norms_are_planned_and_a_norm_over_the_split_projection_is_refused():
    """Qwen3's and Gemma 3's q_norm / k_norm (one head wide, after the view into heads) get the plan's PER_HEAD
    style; OLMo 2's normalise the whole q / k projection, which the column-wise split cuts (each rank would
    normalise its slice with the whole weight): refused in one line, not split."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, Olmo2Config, Olmo2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    from evenrl.distributed.tensor_parallel import PER_HEAD, _present, check, supports
    from evenrl.errors import UsageError

    dims = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    for model in (Qwen3ForCausalLM(Qwen3Config(**dims)), Gemma3ForCausalLM(Gemma3TextConfig(**dims))):
        check(model, 2)
        assert [n for n, _ in _present(model.model, PER_HEAD)] == [
            f"layers.{i}.self_attn.{x}_norm" for x in "qk" for i in range(2)]
    olmo = Olmo2ForCausalLM(Olmo2Config(**dims, pad_token_id=0, eos_token_id=1, bos_token_id=None))
    assert supports(olmo)
    with pytest.raises(UsageError, match=r"layers.0.self_attn.q_norm normalises the whole projection \(32 wide, not "
                                         r"one head's 8\)") as e:
        check(olmo, 2)
    assert "\n" not in str(e.value)
