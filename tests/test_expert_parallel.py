"""Expert parallelism (parallel.expert_parallel_size, evenrl.distributed.expert_parallel; docs/moe.md): the mesh's ep
and edata groups and their one-line problems; the planner's --fit; on gloo, every family's model with its experts
split over 2 ranks against the unsplit model (logits bit for bit, gradients to rounding), a rank that receives no
tokens, and generation on the gathered experts; `evenrl train` with EP = 2 on 2 processes against 1 process (the
load-balancing loss on, engine replay, a KL reference split too), checkpoints resumed across EP sizes (2 -> 1, and
1 -> 2 under FSDP2 with trainer replay), and DP = 2 x EP = 2 on 4 processes, replicated and FSDP2, and EP = 2 x
TP = 2 under FSDP2, resumed on 1 process (large_world).
The planner's findings are rows of tests/test_plan.py, --from verl's mapping is in tests/test_foreign.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from e2e import copy_checkpoint, evenrl_many, final_params, free_port, max_diff, metrics, spawn
from evenrl.demo import write_addition_data
from evenrl.distributed.mesh_shape import MeshShape
from evenrl.testing import MOE_ARCHS, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_expert_groups_borrow_training_ranks():
    """ep: the training ranks cut into groups of ep consecutive ranks; edata: the ranks of one ep index (the same
    experts). With sequence or tensor parallelism too (a tp group's ranks dispatch a slice each of the tokens they
    share, so an ep group may hold them: EP 4 x TP 2 on 8 is 2 of 8 experts per rank); reserved rollout ranks are in
    neither."""
    s = MeshShape(world=8, sp=2, ep=4)
    assert s.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]] and s.groups("edata") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert not s.problems() and "experts over ep 4 x edata 2" in s.describe()
    r = MeshShape(world=5, rollout=1, ep=2)
    assert r.groups("ep") == [[0, 1], [2, 3]] and r.groups("edata") == [[0, 2], [1, 3]]
    for dim in ("ep", "edata"):
        assert sorted(x for g in s.groups(dim) for x in g) == list(range(8))
    t = MeshShape(world=8, tp=2, ep=4)
    assert t.groups("ep") == s.groups("ep") and t.groups("tp")[:2] == [[0, 1], [2, 3]] and not t.problems()
    assert "dp 4 x sp 1 x tp 2 = 8 training ranks; experts over ep 4 x edata 2" in t.describe()
    assert t.experts_problem(8) is None and "(allowed: 1, 2, 4, 8)" in MeshShape(world=8, tp=2, ep=3).experts_problem(8)


@pytest.mark.parametrize("shape, experts, says", [
    (MeshShape(world=6, ep=4), 8, "parallel.expert_parallel_size: got 4; it must divide the 6 training ranks"),
    (MeshShape(world=4, ep=4), 6, "does not divide the model's 6 experts; each rank of an ep group holds experts / "
                                  "ep of them (allowed: 1, 2)"),
    (MeshShape(world=4, ep=2), 0, "got 2, but model.path is not a mixture of experts"),
])
def test_expert_parallel_problems_are_one_line(shape, experts, says):
    wrong = shape.problems() or [shape.experts_problem(experts)]
    assert len(wrong) == 1 and says in wrong[0] and "\n" not in wrong[0]


def test_fit_proposes_expert_parallelism_where_the_experts_do_not_fit(monkeypatch):
    """Qwen3-30B-A3B trained whole, replicated, on 8 x 141 GB: 570 GiB per rank; expert parallelism over the 8 ranks
    (16 of 128 experts each) fits, and --fit takes it before FSDP2 (it moves tokens instead of gathering every
    block's experts), beside a vLLM engine over 2 devices, which holds the engine's weights (engines.engine_group).
    On 8 x 80 GB it does not fit alone (the dense weights' AdamW state stays whole); --fit spreads the engine over
    4 devices and shards with FSDP2 (67.7 GiB), without EP."""
    from evenrl.config import load_config
    from evenrl.planner.fit import fit
    from evenrl.planner.layout import make_layout
    from evenrl.planner.plan import make_plan

    monkeypatch.chdir(ROOT)  # the example's paths are the repository's
    whole = ["model.lora.rank=0", "rollout.memory_fraction=0"]  # vLLM's own share (0.3)
    cfg = load_config("examples/moe_30b_a3b.yaml", whole + ["parallel.sharding=replicated",
                                                            "parallel.expert_parallel_size=1"])
    big = make_plan(cfg, make_layout(nproc_per_node=8, device="cuda", device_memory_gib=141))
    assert big.memory.total_gib > 500
    fixed, changes = fit(big)
    assert dict((k, new) for k, _, new in changes) == {"parallel.expert_parallel_size": 8,
                                                       "rollout.tensor_parallel_size": 2}
    replanned = make_plan(fixed, big.layout)
    assert replanned.memory.total_gib < 141 and not [f for f in replanned.findings if f.level == "error"]
    small = make_plan(cfg, make_layout(nproc_per_node=8, device="cuda", device_memory_gib=80))
    ep8 = next(f for f in small.memory_fixes if f.settings == {"parallel.expert_parallel_size": 8})
    assert not ep8.fits and 80 < ep8.total_gib < 200
    assert dict((k, new) for k, _, new in fit(small)[1]) == {"rollout.tensor_parallel_size": 4,
                                                             "parallel.sharding": "fsdp"}
    with_ep = make_plan(load_config("examples/moe_30b_a3b.yaml", whole), small.layout)
    assert not any("cpu_offload" in str(f.settings) for f in with_ep.memory_fixes)  # refused beside EP


# ------------------------------------------------------------------------------------------ gloo, 2 ranks

def _split_worker(rank: int, world: int, port: int, paths: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from evenrl.distributed import collectives as dist
    from evenrl.distributed.expert_parallel import expert_parallel, gathered_experts
    from evenrl.distributed.weights import full_weights
    from evenrl.engines.payload import merged_weights
    from evenrl.models.loading import load_policy

    info = dist.init(expert_parallel=world)
    got = {}
    for name, path in paths.items():
        model, _ = load_policy(path)
        _maybe_adapters(model, name)
        if name.endswith("starved"):  # every token to experts 0-3, rank 0's: rank 1 receives none
            for m in model.modules():
                if type(m).__name__.endswith(("TopKRouter", "TopkRouter")):
                    m.register_forward_hook(lambda mod, args, out: (out[0], out[1], out[2] % 4))
        expert_parallel(model, dist.expert_mesh(info.device))
        ids = _rows()[rank]
        logits = model(input_ids=ids).logits
        (logits.float().pow(2).mean() / world).backward()  # each rank its row: the 2-row mean's share
        dist.all_reduce_grads(list(model.parameters()))
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in model.named_parameters() if p.grad is not None}
        every = [torch.zeros_like(logits) for _ in range(world)]
        torch.distributed.all_gather(every, logits.detach().contiguous())
        with torch.no_grad(), gathered_experts(model):  # generation: each rank alone, every expert here
            alone = model(input_ids=_rows()[0]).logits
        got[name] = {"logits": torch.cat(every), "grads": grads, "alone": alone,
                     # what engines and the final save get: every tensor whole (collectives, on every rank)
                     "pushed": dict(kv for b in full_weights(model) for kv in b),
                     "merged": dict(kv for b in merged_weights(model, dtype=torch.float32) for kv in b)}
    if rank == 0:
        torch.save(got, out)
    dist.shutdown()
    os._exit(0)  # past the interpreter's teardown, where gloo's threads once aborted a rank (SIGABRT)


def _maybe_adapters(model, name: str) -> None:
    """`*-lora` models: LoRA rank 2 on the attention and on every expert (model.lora.experts), B drawn non-zero
    (seeded: the same on every rank and in the unsplit model), so the adapters change the output."""
    if name.endswith("lora"):
        from evenrl.config import RunConfig
        from evenrl.models.lora import add_adapters

        torch.manual_seed(5)
        add_adapters(model, RunConfig().model.lora.model_copy(update={"rank": 2, "experts": True}))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.3)


def _rows() -> list[torch.Tensor]:
    return [torch.randint(4, 60, (1, 12), generator=torch.Generator().manual_seed(r)) for r in range(2)]


def _unsplit(path: str, name: str, starved: bool) -> dict:
    from evenrl.engines.payload import merged_weights
    from evenrl.models.loading import load_policy

    model, _ = load_policy(path)
    _maybe_adapters(model, name)
    if starved:
        for m in model.modules():
            if type(m).__name__.endswith(("TopKRouter", "TopkRouter")):
                m.register_forward_hook(lambda mod, args, out: (out[0], out[1], out[2] % 4))
    logits = model(input_ids=torch.cat(_rows())).logits
    logits.float().pow(2).mean().backward()
    with torch.no_grad():
        alone = model(input_ids=_rows()[0]).logits
    return {"logits": logits.detach(), "alone": alone, "state": model.state_dict(),
            "merged": dict(kv for b in merged_weights(model, dtype=torch.float32) for kv in b),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # as the workers compute: a matmul's sums depend on its threads
def test_a_model_with_experts_split_over_two_ranks_computes_the_unsplit_model(tmp_path):
    """Every family (gpt-oss's expert biases split too): the same logits bit for bit (each token meets its experts'
    weights whole, and its k outputs are weighted and summed as transformers' grouped_mm backend sums them) and
    every gradient within 1e-8 (measured <= 4e-9: an expert's gradient is complete on its rank; the dense ones are
    the reduction's sum of two rows). With every token routed to rank 0's experts, rank 1 receives none and still
    takes part in the backward's exchange (no deadlock, its experts' gradients exactly 0). Generation on the
    gathered experts (each rank alone) is the unsplit model bit for bit, and so are the whole tensors a weight push
    or the final save gets (full_weights; merged_weights, a LoRA policy's merged push). With LoRA on the experts
    (model.lora.experts: Qwen3-MoE, and gpt-oss's transposed [E, in, out] experts) the adapters are split with the
    experts and all of the above holds too, the merged push included."""
    paths = {arch: make_tiny_model(str(tmp_path / arch), arch=arch, seed=3) for arch in MOE_ARCHS}
    paths["qwen3_moe-starved"] = paths["qwen3_moe"]
    paths["qwen3_moe-lora"], paths["gpt_oss-lora"] = paths["qwen3_moe"], paths["gpt_oss"]  # gpt-oss: [E, in, out]
    out = str(tmp_path / "split.pt")
    spawn(_split_worker, args=(2, free_port(), paths, out), nprocs=2)
    split = torch.load(out)
    for name, path in paths.items():
        one, two = _unsplit(path, name, name.endswith("starved")), split[name]
        assert torch.equal(one["logits"], two["logits"]), name
        assert torch.equal(one["alone"], two["alone"]), name
        for push, want in (("pushed", one["state"]), ("merged", one["merged"])):
            assert two[push].keys() == want.keys(), (name, push)
            assert all(torch.equal(want[k], t) for k, t in two[push].items()), (name, push)
        assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) > 10, name
        for n, g in one["grads"].items():
            assert float((g - two["grads"][n]).abs().max()) <= 1e-8, (name, n)
        experts = [n for n in one["grads"] if ".experts." in n]
        assert experts and all(float(one["grads"][n].abs().max()) > 0 for n in experts)
    for arch in ("qwen3_moe", "gpt_oss"):  # the experts' adapters change the model, and train
        assert float((split[f"{arch}-lora"]["logits"] - split[arch]["logits"]).abs().max()) > 1e-2
        assert sum(".adapters.lora_" in n for n in split[f"{arch}-lora"]["grads"]) == 8
    starved = split["qwen3_moe-starved"]["grads"]
    assert all(float(g[4:].abs().max()) == 0 and float(g[:4].abs().max()) > 0
               for n, g in starved.items() if n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n)


def _rows4() -> list[torch.Tensor]:
    return [torch.randint(4, 60, (1, 5 + 3 * r), generator=torch.Generator().manual_seed(r)) for r in range(4)]


def _pairing_worker(rank: int, world: int, port: int, paths: dict, out: str) -> None:
    """Per family: 4 micro-batches (one row each) through EP = 2 on 2 ranks, two waves, in two pairings: (0, 1) then
    (2, 3), and (0, 2) then (1, 3); each wave's backward deposited into fixed-point bins (distributed.exact), as
    train.reduction's ExactBins does. Per pairing and per-source setting: the summed gradients."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from evenrl.distributed import collectives as dist
    from evenrl.distributed import exact
    from evenrl.distributed.expert_parallel import expert_parallel, take_terms
    from evenrl.models.loading import load_policy

    info = dist.init(expert_parallel=world)
    rows = _rows4()
    got = {}
    for arch, path in paths.items():
        for per_source in (True, False):
            model, _ = load_policy(path)
            expert_parallel(model, dist.expert_mesh(info.device), exact=per_source)
            params = [p for p in model.parameters() if p.requires_grad]
            for pairing in ((0, 1, 2, 3), (0, 2, 1, 3)):
                bins = exact.ExactGrads(params)
                for wave in range(2):
                    model(input_ids=rows[pairing[2 * wave + rank]]).logits.float().pow(2).mean().backward()
                    bins.deposit(more=take_terms())
                bins.reduce()
                got[arch, per_source, pairing] = {
                    n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                    for n, p in model.named_parameters() if p.grad is not None}
                model.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save(got, out)
    dist.shutdown()
    os._exit(0)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_under_bitwise_experts_sum_each_source_ranks_gradient_apart(tmp_path):
    """Why expert parallelism under train.reproducibility=bitwise runs each source rank's tokens as GEMMs of their
    own (distributed.expert_parallel.take_terms): which micro-batches meet in an expert's GEMM is the layout's (the
    waves of its ep group's ranks), and one GEMM over two micro-batches' tokens adds both to the weight gradient in
    one float sum. With a GEMM per source and expert, every micro-batch's gradient is a term of the fixed-point sum:
    the same 4 micro-batches paired (0, 1), (2, 3) or (0, 2), (1, 3) give the same bits in every gradient, and the
    bits one process gives them (the unsplit model under bitwise: canonical_experts), for a Qwen3-MoE and for gpt-oss
    (experts stored [E, in, out] with biases, whose backward GEMM gave other bits for weights at another memory
    alignment until canonical_experts reallocated them: 3.7e-9). Without it (the float path's one GEMM) the pairings
    differ (the negative control)."""
    from evenrl.distributed import exact
    from evenrl.distributed.expert_parallel import canonical_experts
    from evenrl.models.loading import load_policy

    paths = {arch: make_tiny_model(str(tmp_path / arch), arch=arch, seed=3) for arch in ("qwen3_moe", "gpt_oss")}
    out = str(tmp_path / "pairs.pt")
    spawn(_pairing_worker, (2, free_port(), paths, out), 2)
    got = torch.load(out)
    for arch, path in paths.items():
        model, _ = load_policy(path)
        canonical_experts(model)
        bins = exact.ExactGrads([p for p in model.parameters() if p.requires_grad])
        for row in _rows4():
            model(input_ids=row).logits.float().pow(2).mean().backward()
            bins.deposit()
        bins.reduce()
        one = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        a, b = got[arch, True, (0, 1, 2, 3)], got[arch, True, (0, 2, 1, 3)]
        assert a.keys() == b.keys() == one.keys() and any(".experts." in n for n in a), arch
        assert all(torch.equal(a[n], b[n]) and torch.equal(a[n], one[n]) for n in a), arch
        c, d = got[arch, False, (0, 1, 2, 3)], got[arch, False, (0, 2, 1, 3)]
        assert max(float((c[n] - d[n]).abs().max()) for n in c if ".experts." in n) > 0.0, arch


# ------------------------------------------------------------------------------------------ real runs

def _config(root: Path, model: str) -> Path:
    data = root / "addition.jsonl"
    write_addition_data(data)
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {model}}}
data: {{path: {data}, prompts_per_step: 4, max_prompt_tokens: 16}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4, router_replay: engine}}
rewards: {{functions: [{{name: exact_match}}, {{name: 'toy_rewards:digit_fraction', weight: 0.5}}]}}
algo: {{advantage: grpo, minibatches_per_step: 2, router_aux_loss_coef: 0.01, kl_coef: 0.01}}
train: {{steps: 2, lr: 1.0e-3, token_cap_per_micro_batch: 24}}
checkpoint: {{every_steps: 1}}
log: {{progress: false, tensorboard: false}}
""")
    return cfg


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """The 1-process run every layout is compared with: a tiny Qwen3-MoE, the load-balancing loss at 0.01, a KL
    reference (its experts split too under EP), engine replay, 2 mini-batches, a checkpoint after each step."""
    root = tmp_path_factory.mktemp("ep")
    cfg = _config(root, make_tiny_model(str(root / "model"), arch="qwen3_moe", seed=3))
    evenrl_many({"one": ["train", cfg, f"log.run_dir={root / 'one'}"]})
    return root, cfg


@pytest.fixture(scope="module")
def ep_runs(one_run):
    """EP = 2 on 2 processes; then each checkpoint of step 1 resumed at the other EP size (2 -> 1; 1 -> 2 under
    FSDP2, with trainer replay: fp32 engine routes are the trainer's own choice, so both replay modes are one
    model)."""
    root, cfg = one_run
    ep2 = ["--nproc-per-node", 2, "parallel.expert_parallel_size=2"]
    evenrl_many({"ep2": ["train", cfg, f"log.run_dir={root / 'ep2'}", *ep2]})
    to_one = copy_checkpoint(root / "ep2", 1, root / "to_one")
    to_ep2 = copy_checkpoint(root / "one", 1, root / "to_ep2")
    evenrl_many({"to_one": ["train", cfg, f"log.run_dir={to_one}", "--resume"],
                 "to_ep2": ["train", cfg, f"log.run_dir={to_ep2}", "--resume", *ep2, "parallel.sharding=fsdp",
                            "rollout.router_replay=trainer"]})
    return root


def _same_as_one(root: Path, name: str, steps: int = 2) -> float:
    """The run's final weights' largest difference from the 1-process run's; its last `steps` steps' rewards,
    load-balancing loss and expert load are the 1-process run's."""
    got, want = metrics(root / name)[-steps:], metrics(root / "one")[-steps:]
    assert [m["step"] for m in got] == [m["step"] for m in want], name
    assert [m["reward/mean"] for m in got] == [m["reward/mean"] for m in want], name
    assert all(abs(a["moe/aux_loss"] - b["moe/aux_loss"]) < 1e-5 for a, b in zip(got, want)), name
    assert [a["moe/load_max_over_mean"] for a in got] == [b["moe/load_max_over_mean"] for b in want], name
    return max_diff(final_params(root / name), final_params(root / "one"))


@pytest.mark.slow
def test_expert_parallel_runs_are_the_one_process_run(ep_runs):
    """EP = 2 on 2 processes, replicated: each rank holds 4 of the 8 experts, tokens go out and come back by
    all-to-all, the experts' gradients are reduced over the ranks holding the same experts only (none here), the
    dense ones over both. After 2 steps the final weights are the 1-process run's within 1e-5 (measured 3.5e-6,
    what DP = 2 leaves without EP: the dense reduction adds two ranks' sums), identical rewards, load-balancing
    loss and expert load, and the weights moved; the engine's fp32 routes are the trainer's own choice."""
    from safetensors.torch import load_file

    assert _same_as_one(ep_runs, "ep2") < 1e-5
    start = load_file(str(ep_runs / "model" / "model.safetensors"))
    assert max_diff(final_params(ep_runs / "one"), start) > 1e-3
    for m in metrics(ep_runs / "ep2"):
        assert m["moe/routes_differ_any_layer"] == 0.0 and m["moe/logprob_mismatch_without_replay"] < 1e-5


@pytest.mark.slow
def test_checkpoints_resume_across_expert_parallel_sizes(ep_runs):
    """DCP saves the experts by their global shape: EP = 2's step-1 checkpoint resumed on 1 process, and the
    1-process checkpoint resumed at EP = 2 under FSDP2 (experts split on ep, sharded on edata), each finishing
    step 2 as the uninterrupted 1-process run does (weights within 1e-5, the same rewards; measured 3.5e-6, the
    difference EP = 2's first step left, and 6e-8)."""
    assert _same_as_one(ep_runs, "to_one", steps=1) < 1e-5
    assert _same_as_one(ep_runs, "to_ep2", steps=1) < 1e-5
    assert (ep_runs / "to_ep2" / "checkpoints" / "step-000002").is_dir()


@pytest.mark.slow
@pytest.mark.large_world
def test_bitwise_expert_parallelism_is_the_one_process_run(ep_runs):
    """train.reproducibility=bitwise on 1 process, with EP = 2 on 2 processes and on 4 (DP = 2 x EP = 2,
    replicated): one run, bit for bit: final weights, every step's metrics and weights/hash (each source rank's
    tokens GEMMs of their own, one per expert, their expert gradients fixed-point terms summed over edata, the dense
    ones over data; the clip norm's and the hash's integer sums over ep; the 1-process model's experts computed in
    the same order: canonical_experts). Measured also: EP 4 on 4 and DP 3 the same bits. Negative control: under
    rounding EP 2 on 2 is not the 1-process run, and DP 2 x EP 2 on 4 stays within 1e-5 of it (measured 4.3e-6)."""
    from safetensors.torch import load_file

    from e2e import BITWISE, assert_same_run

    root = ep_runs
    cfg = root / "cfg.yaml"
    no_save = ["checkpoint.every_steps=0"]
    ep = ["parallel.expert_parallel_size=2", *no_save]
    evenrl_many({name: ["train", cfg, f"log.run_dir={root / name}", "--nproc-per-node", n, *more]
                 for name, n, more in (("one_bitwise", 1, [*no_save, BITWISE]), ("ep2_bitwise", 2, [*ep, BITWISE]),
                                       ("ep4_bitwise", 4, [*ep, BITWISE]), ("ep4", 4, ep))})
    assert_same_run(root / "one_bitwise", root / "ep2_bitwise")
    assert_same_run(root / "one_bitwise", root / "ep4_bitwise")
    start = load_file(str(root / "model" / "model.safetensors"))  # the same bits after training, not after none
    assert max_diff(final_params(root / "one_bitwise"), start) > 1e-3
    assert _same_as_one(root, "ep4") < 1e-5
    assert max_diff(final_params(root / "one"), final_params(root / "ep2")) > 0.0


@pytest.mark.slow
@pytest.mark.large_world
@pytest.mark.parametrize("sharding, tp", [("fsdp", 1), ("fsdp", 2)])
def test_data_parallel_times_expert_parallel_on_four(one_run, sharding, tp):
    """DP = 2 x EP = 2 on 4 processes: each rank holds 4 experts, the two ranks holding the same ones (edata) FSDP2
    shards them (replicated: the test above); the final weights the 1-process run's within 1e-5 (measured 4.4e-6),
    identical rewards. EP = 2 x TP = 2 (dp 2) under FSDP2: attention and the output
    layer split over each tp pair (0-1, 2-3), the experts over the ep pairs (0-1, 2-3 too; edata 0-2, 1-3): both
    ranks of a tp pair route the same tokens and each dispatches its half of them, the pair gathering the outputs
    (distributed.expert_parallel); the KL reference and the hf sampler split the same way; measured 1.3e-6 (2 of
    130,688 entries over 1e-6), the same rewards, load-balancing loss and expert load; its step-1 checkpoint resumed
    on 1 process finishes as the 1-process run does."""
    root, cfg = one_run
    name = f"dp2ep2tp{tp}_{sharding}"
    evenrl_many({name: ["train", cfg, f"log.run_dir={root / name}", "--nproc-per-node", 4,
                        "parallel.expert_parallel_size=2", f"parallel.sharding={sharding}",
                        f"parallel.tensor_parallel_size={tp}"]})
    assert _same_as_one(root, name) < 1e-5
    if tp > 1:
        back = copy_checkpoint(root / name, 1, root / f"{name}_to_one")
        evenrl_many({back.name: ["train", cfg, f"log.run_dir={back}", "--resume"]})
        assert _same_as_one(root, back.name, steps=1) < 1e-5
