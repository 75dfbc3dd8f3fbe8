"""The planner's side of tensor parallelism (parallel.tensor_parallel_size, and a vLLM engine's memory per device):
what a rank holds against hand arithmetic, the mesh the plan balances over, each rule's finding and fix, --fit.
Torch-free and fast (plans only, no processes)."""

import json
import math

import pytest

from evenrl.config import load_config, with_settings
from evenrl.distributed.mesh_shape import MeshShape
from evenrl.planner.dims import dims_from_config
from evenrl.planner.fit import fit, fit_verdict
from evenrl.planner.layout import make_layout
from evenrl.planner.memory import GIB, HEAD_CHUNK, estimate_memory
from evenrl.planner.plan import make_plan, render
from evenrl.planner.rank_work import worst_case_shape
from evenrl.planner.split_model import rank_share, tensor_sizes

from test_sequence_parallel_plan import QWEN7B, ROOT, SHORT, TINY, VL, flat, plan, rules
from test_sequence_parallel_plan import test_rule as check_rule  # the same checks of a finding

QWEN32B = json.loads((ROOT / "tests" / "fixtures" / "qwen2.5-32b" / "config.json").read_text())
MOE = {**TINY, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# the docs' 32B case (docs/parallelism.md): 16 prompts x 8 samples of up to 3,072 tokens, bf16 over FSDP2
BIG = ["model.dtype=bfloat16", "model.gradient_checkpointing=true", "parallel.sharding=fsdp",
       "data.prompts_per_step=16", "rollout.samples_per_prompt=8", "data.max_prompt_tokens=1024",
       "rollout.max_new_tokens=2048", "train.token_cap_per_micro_batch=6144", "algo.minibatches_per_step=4"]


def test_a_rank_holds_its_share_of_the_model_by_hand():
    """TINY (h 64, MLP 128, 2 layers, 8 heads of 8, 2 KV heads, vocabulary 100, untied): 82,752 parameters, of
    which the norms (2 x 64 per block and the final 64: 320) stay whole; TP=2 holds 320 + 82,432 / 2."""
    d = dims_from_config(TINY)
    assert d.params == 100 * 64 * 2 + 2 * (64 * 64 + 2 * 64 * 16 + 64 * 64 + 2 * 64 + 3 * 64 * 128) + 64 == 82_752
    one, two = rank_share(d, 1), rank_share(d, 2)
    assert (one.params, one.act_elems, one.kv_dim, one.vocab, one.gather_elems) == (82_752, d.act_elems, 16, 100, 0)
    assert two.params == 320 + (82_752 - 320) // 2 == 41_536
    assert two.linear == d.linear_params // 2 and two.vocab == 50 and two.kv_dim == 8 and two.heads == 4
    assert two.root == 64 + 100 * 64 * 2 // 2  # the embeddings and the output layer split, the final norm whole
    assert two.block == 128 + (d.layer_params - 128) // 2
    # 4h whole; q, k, v, the attention output and gate, up, SiLU(gate) of the rank's slice; o_proj's gathered
    # input (q = 64) and down_proj's (i = 128) whole: 256 + (128 + 32 + 384) / 2 + 64 + 128
    assert d.act_elems == 4 * 64 + 2 * 64 + 2 * 16 + 4 * 128 == 928
    assert two.act_elems == 256 + 272 + 192 == 720 and two.gather_elems == 128
    for unsplit in (VL, {**MOE, "model_type": "gpt_oss"}):  # what the plan cannot split is estimated whole
        assert rank_share(dims_from_config(unsplit), 2).tp == 1
    # MOE (2 MoE layers of 8 experts of width 32, top 2, Qwen3's q/k norms): the routed experts (3 x 64 x 32 each)
    # and routers (8 x 64) stay whole beside EP, attention and the vocabulary split; the norms 2 x (128 + 16) + 64
    m = dims_from_config(MOE)
    routed, norms, attention = 8 * (3 * 64 * 32 + 64), 352, 2 * 64 * 64 + 2 * 64 * 16 + 128 + 16
    assert m.params == 100 * 64 * 2 + 2 * (attention + routed) + 64 == 132_960
    moe = rank_share(m, 2)
    assert moe.params == norms + 2 * routed + (132_960 - norms - 2 * routed) // 2 == 116_320
    assert moe.block == 144 + routed + (attention - 144) // 2 and moe.linear == 2 * routed + (m.linear_params
                                                                                             - 2 * routed) // 2
    # 4h; q, k, v, the attention output of the rank's heads, o_proj's gathered input (q); each MoE layer's k x
    # (3h + 4e) dispatch buffers for the rank's half of the tokens, the 2E router outputs of all of them:
    # 256 + (128 + 32) / 2 + 64 + 2 x (192 + 128) / 2 + 16
    assert moe.act_elems == 256 + 80 + 64 + 336 == 736 and moe.gather_elems == 64
    assert tensor_sizes(dims_from_config(QWEN7B), 8, 8) == [1, 2, 4]  # 28 heads, 4 KV heads
    assert tensor_sizes(dims_from_config(QWEN32B), 16, 8, nodes=2) == [1, 2, 4, 8]
    assert tensor_sizes(dims_from_config(QWEN32B), 12, 6, nodes=2) == [1, 2]  # 4 would cross nodes of 6


def test_memory_per_rank_at_tp_2_by_hand():
    """Qwen2.5-7B on 8 ranks, bf16, FSDP2, TP=2: the data group is 4 ranks, so state is 16 bytes x the rank's
    share / 4; the FSDP units, logits' chunk and KV width are the split model's; the hf engine's TP group generates
    its 8 samples together, each rank holding its 2 of the 4 KV heads."""
    d = dims_from_config(QWEN7B)
    lay = make_layout(1, 8, device="cuda", device_memory_gib=80)
    cfg = load_config(None, SHORT + ["model.dtype=bfloat16", "parallel.sharding=fsdp"])
    two = with_settings(cfg, {"parallel.tensor_parallel_size": 2})
    a, b = estimate_memory(cfg, lay, d), estimate_memory(two, lay, d)
    norms = 28 * 2 * 3584 + 3584
    held = norms + (d.params - norms) // 2
    assert b.breakdown["parameters"] * GIB == pytest.approx(4 * held / 4)
    assert b.breakdown["optimizer"] * GIB == pytest.approx(8 * held / 4)
    assert b.breakdown["gradients"] * GIB == pytest.approx(4 * held / 4)
    root = 3584 + 152064 * 3584 * 2 // 2
    block = 2 * 3584 + (d.layer_params - 2 * 3584) // 2
    assert b.breakdown["fsdp units"] * GIB == 2 * (root + 2 * block)
    # 32 samples of 128 tokens over 4 replicas: 8 per micro-batch on every rank of one (TP splits no tokens), where
    # 8 ranks of their own hold 4
    t, length = 1024, 128
    assert (a.micro_tokens, b.micro_tokens) == (512, t)
    assert b.breakdown["log-prob logits"] * GIB == min(t * 152064 // 2, HEAD_CHUNK) * (2 + 8)
    q, i = 28 * 128, 18944
    assert b.breakdown["layer activations"] * GIB == t * (4 * 3584 + (2 * q + 2 * 512 + 3 * i) // 2 + q + i) * 2
    assert b.breakdown["log-prob tensor-parallel buffers"] * GIB == t * max(q, i) * 2
    assert b.breakdown["tensor-parallel buffers"] == 2 * b.breakdown["log-prob tensor-parallel buffers"]
    assert a.breakdown["tensor-parallel buffers"] == 0
    assert (a.rollout_samples, b.rollout_samples) == (4, 8)  # 32 samples over 8 ranks, over 4 TP groups
    assert b.breakdown["KV cache"] * GIB == 8 * length * 28 * 2 * (4 // 2) * 128 * 2
    assert b.breakdown["KV cache"] == a.breakdown["KV cache"]  # twice the samples, half the heads
    assert b.breakdown["gathered model"] * GIB == 2 * (held + max(root, block))
    replicated = estimate_memory(with_settings(two, {"parallel.sharding": "replicated"}), lay, d)
    assert replicated.breakdown["gradient buckets"] * GIB == 4 * held  # reduced over the data group of 4
    assert replicated.breakdown["autocast copies"] * GIB == 2 * (d.linear_params // 2)
    vllm = worst_case_shape(with_settings(two, {"rollout.engine": "vllm"}), lay)
    assert vllm[1] == 4  # any other engine samples per rank


def test_the_plan_balances_over_replicas_of_the_mesh():
    """SP 2 x TP 2 on 8 ranks: the plan's mesh is the run's (MeshShape), its rows the 2 replicas of 4 ranks, each
    replica's micro-batch SP x the per-rank cap."""
    p = plan(["parallel.sequence_parallel_size=2", "parallel.tensor_parallel_size=2"], TINY)
    assert p.mesh == MeshShape(8, 0, 2, 2) and p.dp_size == 2 and p.replica == 4 and len(p.ranks) == 2
    assert sum(r.samples for r in p.ranks) == 32 and p.unit == "replica"
    d = p.to_dict()["ranks"]
    assert (d["sequence_parallel"], d["tensor_parallel"], d["dp_groups"]) == (2, 2, 2)
    text = flat(p)
    assert "sequence parallel 2 x tensor parallel 2: 2 data-parallel groups of 4 ranks (0-3, 4-7)" in text
    assert "no idle replicas" in text
    tp = plan(["parallel.tensor_parallel_size=2"], TINY)
    assert tp.unit == "TP group" and tp.dp_size == 4 and "per group TP groups" in flat(tp)
    assert not [f for f in tp.findings if f.rule.startswith(("tensor-", "sequence-", "engine-"))], render(tp)


@pytest.mark.parametrize("overrides, layout, model, rule, level, texts", [
    (["parallel.tensor_parallel_size=3"], {}, TINY, "tensor-parallel-ranks", "error",
     ["parallel.tensor_parallel_size 3 = 3 ranks per replica must divide the 8 training ranks",
      "parallel.tensor_parallel_size=2; or 6 training ranks"]),  # 4 does not divide TINY's 2 KV heads
    (["parallel.tensor_parallel_size=2", "parallel.sequence_parallel_size=3"], {"nproc_per_node": 8}, TINY,
     "tensor-parallel-ranks", "error", ["x parallel.tensor_parallel_size 2 = 6 ranks per replica", "6 training ranks"]),
    (["parallel.tensor_parallel_size=8"], {}, QWEN7B, "tensor-parallel-sizes", "error",
     ["does not divide the model's 28 attention heads, 4 KV heads", "parallel.tensor_parallel_size=4"]),
    (["parallel.tensor_parallel_size=2"], {}, VL, "tensor-parallel-model", "error",
     ["vision-language model", "parallel.tensor_parallel_size=1"]),
    (["parallel.tensor_parallel_size=2"], {}, MOE, "tensor-parallel-model", "error",
     ["a mixture of experts (qwen3_moe) without expert parallelism", "routed experts, which expert parallelism splits",
      "parallel.expert_parallel_size > 1", "or parallel.tensor_parallel_size=1"]),
    (["parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2"], {}, {**MOE, "model_type": "gpt_oss"},
     "tensor-parallel-model", "error", ["attention sinks, one per head (gpt_oss)", "parallel.tensor_parallel_size=1"]),
    (["parallel.tensor_parallel_size=2", "parallel.sharding=fsdp", "parallel.cpu_offload=full"], {}, TINY,
     "tensor-parallel-offload", "error", ["parallel.cpu_offload=none", "parallel.tensor_parallel_size=1"]),
    (["parallel.tensor_parallel_size=4"], {"nnodes": 2, "nproc_per_node": 6}, TINY, "tensor-parallel-nodes",
     "warning", ["6 processes per node", "span nodes", "parallel.tensor_parallel_size=2 (each group inside a node)"]),
    (["parallel.tensor_parallel_size=2", "parallel.sequence_parallel_size=8"], {"nproc_per_node": 16},
     {**TINY, "num_attention_heads": 8}, "sequence-parallel-heads", "error",
     ["does not divide a tensor-parallel rank's (1/2 of the model's) 4 query heads"]),
    (["parallel.tensor_parallel_size=2"], {}, {**TINY, "attn_logit_softcapping": 30.0}, "packed-attention", "error",
     ["tensor parallelism (rows packed back to back)", "parallel.tensor_parallel_size=1"]),
    (["rollout.engine=vllm", "model.dtype=bfloat16"], {}, QWEN32B, "engine-memory", "error",
     ["holds 61.0 GiB of weights", "over vLLM's share of 24.0 GiB",
      "rollout.tensor_parallel_size=4 (the smallest engine that holds it)",
      "rollout.memory_fraction=0.78", "rollout.engine=hf"]),  # (61.0 + 0.03 + 1) / 80, up
])
def test_rule(overrides, layout, model, rule, level, texts):
    check_rule(overrides, layout, model, rule, level, texts)


def test_engine_memory_by_hand():
    """Qwen2.5-32B in bf16 on one device: 2 bytes x 32.76 B parameters; one 192-token sample's KV: 192 x 64 layers
    x 2 x 8 KV heads x 128 x 2 bytes; vLLM's share at memory_fraction 0 is 0.3 x 80 GiB. Four devices hold 1/4 of
    the weights and 2 of the KV heads each: 15.3 + 0.05 + 1 GiB fits 24 GiB."""
    d = dims_from_config(QWEN32B)
    f = rules(plan(["rollout.engine=vllm", "data.max_prompt_tokens=128", "model.dtype=bfloat16"],
                   QWEN32B))["engine-memory"]
    assert f"holds {2 * d.params / GIB:.1f} GiB" in f.message
    assert f"KV cache, {192 * 64 * 2 * 8 * 128 * 2 / GIB:.2f} GiB" in f.message
    assert 2 * d.params / 4 / GIB + 192 * 64 * 2 * 2 * 128 * 2 / GIB + 1 < 0.3 * 80 < 2 * d.params / 2 / GIB
    assert f.fix.startswith("rollout.tensor_parallel_size=4 (the smallest engine that holds it)")
    for ok in (["rollout.engine=vllm", "rollout.memory_fraction=0.9"], ["rollout.engine=hf"]):
        assert "engine-memory" not in rules(plan(ok + ["model.dtype=bfloat16"], QWEN32B))
    assert "engine-memory" not in rules(plan(["rollout.engine=vllm", "model.dtype=bfloat16"], QWEN7B))  # 14 in 24
    fp32 = rules(plan(["rollout.engine=vllm"], QWEN32B))["engine-memory"]  # 4 bytes a parameter: 8 devices
    assert "holds 122.1 GiB of weights (float32)" in fp32.message
    assert fp32.fix.startswith("rollout.tensor_parallel_size=8 (the smallest engine that holds it)")


def test_a_model_too_large_names_the_smallest_tp_and_fit_applies_it():
    """32B with the hf engine on 8 x 80 GiB: generation gathers the whole model in bf16 (61 GiB) beside the FSDP
    state (46 GiB): TP=2 leaves the rank over, TP=4 fits (the smallest), before offload in --fit's order."""
    p = plan(base=BIG, model_config=QWEN32B)
    over = rules(p)["memory-over"]
    assert over.fix.split("; ")[0].startswith("each alone, best first: parallel.tensor_parallel_size=4 (each layer "
                                              "split over 4 ranks, 2 data-parallel groups)")
    assert "(fits)" in over.fix.split("; ")[0]
    two = plan(["parallel.tensor_parallel_size=2"], QWEN32B, BIG)
    assert two.memory.fits is False
    new, changes = fit(p)
    assert changes == [("parallel.tensor_parallel_size", 1, 4)]
    after = make_plan(new, p.layout, model_config=QWEN32B)
    assert after.memory.fits and after.runnable and after.dp_size == 2
    offload = plan(["parallel.cpu_offload=full"], QWEN32B, BIG)  # TP is not proposed beside offload (refused)
    assert not any("tensor_parallel_size" in str(f.settings) for f in offload.memory_fixes)
    lora = plan(["model.lora.rank=16"], QWEN32B, BIG)  # nor is offload beside TP
    assert not any("cpu_offload" in str(f.settings) for f in plan(["parallel.tensor_parallel_size=2"], QWEN32B,
                                                                      BIG).memory_fixes), lora


def test_fit_mends_the_sizes_the_rules_refuse():
    for overrides, model, want in (
            (["parallel.tensor_parallel_size=3"], TINY, 2),
            (["parallel.tensor_parallel_size=8"], QWEN7B, 4),
            (["parallel.tensor_parallel_size=2"], VL, 1),
            (["parallel.tensor_parallel_size=2"], MOE, 2),  # with EP 8: 8 experts over the 8 training ranks
            (["parallel.tensor_parallel_size=2"], {**MOE, "model_type": "gpt_oss"}, 1)):  # sinks: no TP
        p = plan(overrides, model)
        new, _ = fit(p)
        assert new.parallel.tensor_parallel_size == want, overrides
        assert new.parallel.expert_parallel_size == (8 if model["model_type"] == "qwen3_moe" else 1), overrides
        assert not [f for f in make_plan(new, p.layout, model_config=model).findings
                    if f.rule.startswith("tensor-parallel") and f.level == "error"]
    p = plan(["parallel.tensor_parallel_size=2", "parallel.sharding=fsdp", "parallel.cpu_offload=full"], TINY)
    new, _ = fit(p)
    assert (new.parallel.tensor_parallel_size, new.parallel.cpu_offload) == (2, "none")


def test_an_engine_too_small_is_fitted_by_what_runs():
    """--fit gives a vLLM engine whose device share cannot hold its weights the smallest rollout.tensor_parallel_size
    that holds them (an engine group over that many devices); where no engine the layout allows does, the share of
    the device its weights need; where no share of one device holds them, nothing: the engine is the experiment's,
    and --fit's verdict names what evenrl lacks."""
    p = plan(["rollout.engine=vllm"], QWEN32B, BIG)
    assert "rollout.tensor_parallel_size=4 (the smallest engine that holds it)" in rules(p)["engine-memory"].fix
    new, _ = fit(p)
    assert new.rollout.tensor_parallel_size == 4 and new.rollout.memory_fraction == 0
    after = make_plan(new, p.layout, model_config=QWEN32B)
    assert not {r for r in rules(after) if r.startswith(("engine-", "tensor-parallel"))}, render(after)
    assert "vLLM tensor parallel 4: 2 engines of 4 devices" in flat(after)
    odd = {**QWEN32B, "num_attention_heads": 35, "num_key_value_heads": 5}  # no engine of 2-8 devices splits 35 heads
    new, _ = fit(plan(["rollout.engine=vllm"], odd, BIG))
    assert new.rollout.tensor_parallel_size == 1 and new.rollout.memory_fraction == 0.78
    huge = {**QWEN32B, "num_hidden_layers": 160}  # ~80 B: no share of one 80 GiB device holds it, 8 devices' do
    assert fit(plan(["rollout.engine=vllm"], huge, BIG))[0].rollout.tensor_parallel_size == 8
    huge = {**QWEN32B, "num_hidden_layers": 480}  # ~240 B: nor do 8 devices' shares; the engine is the experiment's
    p = plan(["rollout.engine=vllm"], huge, BIG)
    new, _ = fit(p)
    assert new.rollout.engine == "vllm"
    after = make_plan(new, p.layout, model_config=huge)
    verdict = fit_verdict(after)
    assert verdict.rule == "fit-none" and "an engine across nodes (vLLM's pipeline parallelism)" in verdict.message


def test_fit_never_leaves_a_tensor_parallel_error():
    """--fit on a spread of TP settings and layouts: the fitted plan has no tensor-parallel or engine error."""
    for tp in (2, 3, 4, 5, 8):
        for nodes, per in ((1, 8), (2, 4), (2, 6)):
            for model in (TINY, QWEN7B, QWEN32B):
                p = plan([f"parallel.tensor_parallel_size={tp}"], model, BIG, nnodes=nodes, nproc_per_node=per)
                new, _ = fit(p)
                after = make_plan(new, p.layout, model_config=model)
                bad = [f.rule for f in after.findings if f.level == "error"
                       and f.rule.startswith(("tensor-parallel", "engine-", "sequence-"))]
                assert not bad, (tp, nodes, per, model["hidden_size"], bad)
                assert math.prod((after.dp_size, after.replica)) == after.layout.training_ranks


def test_expert_parallel_beside_tensor_parallel_is_counted_by_hand():
    """MOE on 8 ranks under FSDP2, EP 8 x TP 2: the rank holds 1/2 of the attention and vocabulary sharded over its
    data group of 4 (116,320 - 98,304 routed expert parameters / 4, the routers with them) and 1/8 of the routed
    experts (each whole on its rank: EP 8 x FSDP2 over the 1 other, every training rank), in fp32 (4 bytes); each
    rank dispatches its half of its TP group's tokens. The plan runs it:
    no tensor- or expert-parallel error, and the note says how the experts are split."""
    m = dims_from_config(MOE)
    assert m.experts_total == 2 * 8 * 3 * 64 * 32 == 98_304
    lay = make_layout(1, 8, device="cuda", device_memory_gib=80)
    ep = load_config(None, SHORT + ["parallel.sharding=fsdp", "parallel.expert_parallel_size=8"])
    both = with_settings(ep, {"parallel.tensor_parallel_size": 2})
    one, two = estimate_memory(ep, lay, m).breakdown, estimate_memory(both, lay, m).breakdown
    assert two["parameters"] * GIB == pytest.approx(4 * ((116_320 - 98_304) / 4 + 98_304 / 8))
    assert two["optimizer"] == pytest.approx(2 * two["parameters"])
    # 4 x t x k x h x c (/ TP): a rank's 4 samples of 128 tokens at EP 8 alone, a TP group's 8 split in two
    assert one["expert dispatch"] * GIB == 4 * 512 * 2 * 64 * 4
    assert two["expert dispatch"] * GIB == 4 * 1024 * 2 * 64 * 4 / 2
    p = plan(["parallel.sharding=fsdp", "parallel.expert_parallel_size=8", "parallel.tensor_parallel_size=2"], MOE)
    assert not [f for f in p.findings if f.level == "error" and f.rule.startswith(("tensor-", "expert-"))], render(p)
    note = next(f.message for f in p.findings if f.rule == "expert-parallel")
    assert "beside parallel.tensor_parallel_size=2" in note
