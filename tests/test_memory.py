"""Memory estimate: parameter count and every component against a hand calculation; the ranked fixes."""

import json

import pytest
from pydantic import ValidationError

from evenrl.config import RunConfig, with_settings
from evenrl.planner.layout import make_layout
from evenrl.planner.dims import dims_from_config, read_model_dims
from evenrl.planner.memory import GIB, estimate_memory, worst_case_shape
from evenrl.planner.memory_fixes import memory_fixes

# A tiny Llama-like model: every number below is computed by hand from these.
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
QWEN7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
          "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
          "max_position_embeddings": 32768}


def cfg(**sections) -> RunConfig:
    base = {"data": {"prompts_per_step": 4, "max_prompt_tokens": 32}, "rollout": {"samples_per_prompt": 2,
            "max_new_tokens": 32}, "train": {"token_cap_per_micro_batch": 256}}
    for sec, vals in sections.items():
        base.setdefault(sec, {}).update(vals)
    return RunConfig.model_validate(base)


QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "vocab_size": 129280, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def test_moe_counts_match_published_sizes():
    """Mixtures of experts by total (held) and active (computed per token) parameters: Qwen3-30B-A3B 30.5 B / 3.3 B,
    DeepSeek-V3 671 B / 37 B (its latent attention counted by its low-rank projections, 3 dense layers first)."""
    q = dims_from_config(QWEN3_30B_A3B)
    assert round(q.params / 1e9, 1) == 30.5 and round(q.active_params / 1e9, 1) == 3.4
    assert (q.experts, q.top_k, q.moe_layers) == (128, 8, 48)
    d = dims_from_config(DEEPSEEK_V3)
    assert round(d.params / 1e9) == 671 and round(d.active_params / 1e9) == 38 and d.moe_layers == 58


def test_expert_parallel_divides_the_experts_state():
    """parallel.expert_parallel_size: replicated, each rank holds 1/EP of the routed experts' weights, gradients,
    moments and gradient buckets; sharded, FSDP already spreads them over every rank, and EP shrinks the gathered
    unit (E/EP experts) instead; an MoE's micro-batch activations count its top-k dispatch buffers."""
    lay = make_layout(nproc_per_node=8, device="cuda", device_memory_gib=80)
    dims = dims_from_config(QWEN3_30B_A3B)
    one, ep8 = (estimate_memory(cfg(parallel={"expert_parallel_size": e}), lay, dims) for e in (1, 8))
    experts_gib = 16 * dims.experts_total / GIB
    assert abs((one.breakdown["parameters"] + one.breakdown["optimizer"] - ep8.breakdown["parameters"]
                - ep8.breakdown["optimizer"]) - 12 * dims.experts_total * (1 - 1 / 8) / GIB) < 1e-6
    assert experts_gib > 400 and one.breakdown["expert dispatch"] == 0 < ep8.breakdown["expert dispatch"]
    assert abs(one.breakdown["gradient buckets"] - ep8.breakdown["gradient buckets"]
               - 4 * dims.experts_total * (1 - 1 / 8) / GIB) < 1e-6
    s1, s8 = (estimate_memory(cfg(parallel={"sharding": "fsdp", "expert_parallel_size": e}), lay, dims)
              for e in (1, 8))
    assert s1.breakdown["parameters"] == s8.breakdown["parameters"]
    gathered = 4 * 2 * (128 - 128 // 8) * dims.expert_params / GIB  # two blocks in fp32: 112 of 128 experts fewer
    assert abs(s1.breakdown["fsdp units"] - s8.breakdown["fsdp units"] - gathered) < 1e-9 and gathered > 3
    assert "30,532.1 M parameters held, 3,353.0 M active" in " ".join(one.assumptions)


def test_route_records_are_counted():
    """rollout.router_replay: each token's M x k expert ids in one byte each (<= 256 experts), and one layer widened
    to int64 by the router's hook."""
    lay = make_layout(nproc_per_node=1, device="cuda", device_memory_gib=80)
    dims = dims_from_config(QWEN3_30B_A3B)
    off = estimate_memory(cfg(), lay, dims)
    on = estimate_memory(cfg(rollout={"router_replay": "engine"}), lay, dims)
    t = on.micro_tokens
    assert off.breakdown["route records"] == 0
    assert on.breakdown["route records"] * GIB == t * 48 * 8 * 1 + t * 8 * 8
    assert any("carry their routes on the host" in a for a in on.assumptions)


def test_param_count_by_hand():
    d = dims_from_config(TINY)
    # per layer: q 64*64 + k,v 2*64*(2*16) + o 64*64 + MLP 3*64*128 + 2 RMSNorms 2*64 = 36,992
    assert d.head_dim == 16 and d.layer_params == 4096 + 4096 + 4096 + 24576 + 128
    # embeddings + untied lm_head 2*100*64, 2 layers, final norm 64
    assert d.params == 12_800 + 2 * 36_992 + 64
    assert dims_from_config({**TINY, "tie_word_embeddings": True}).params == 6_400 + 2 * 36_992 + 64


def test_qwen2_7b_count_matches_published_size():
    d = dims_from_config(QWEN7B)
    assert d.qkv_bias and abs(d.params - 7.6154e9) / 7.6154e9 < 0.001  # Qwen2.5-7B: 7.61 B parameters


def test_every_component_by_hand():
    """float32, replicated, no offload, 1 rank: 16 bytes of state per parameter, P = 86,848.
    Worst case 64-token samples; 8 samples on the rank; cap 256 -> 4 rows -> t = 256 tokens; 8 samples generated.
    activations  t * L * a * c, a = 4h + 2*q_dim + 2*kv_dim + 4i = 256 + 128 + 64 + 512 = 960
    logits       t * V * (2c + 12);  log-prob logits t * V * (c + 8) (t * V is under one output-layer chunk);
    KV cache  g * len * L * 2 * kv_dim * c;
    overhead 0.3 GiB. phases: rollout = resident + KV, log-probs = resident + one layer's activations + logits,
            update = resident + gradients + activations + logits; peak = the largest."""
    d = dims_from_config(TINY)
    P = 86_848
    est = estimate_memory(cfg(), make_layout(1, 1, device="cpu", device_memory_gib=8), d)
    b = {k: v * GIB for k, v in est.breakdown.items()}
    assert (est.micro_tokens, est.rollout_samples) == (256, 8)
    assert b["parameters"] == P * 4 and b["gradients"] == P * 4
    assert b["optimizer"] == P * 8  # two fp32 moments; the parameters are the master weights
    assert b["activations"] == 256 * 2 * 960 * 4
    assert b["logits"] == 256 * 100 * 20 and b["log-prob logits"] == 256 * 100 * 12
    assert b["layer activations"] == 256 * 960 * 4
    assert b["KV cache"] == 8 * 64 * 2 * 2 * 32 * 4
    assert all(b[k] == 0 for k in ("reference model", "fsdp units", "gathered model", "autocast copies",
                                   "gradient buckets", "rollout reserve"))
    resident = P * 4 + P * 8 + 0.3 * GIB
    phases = {k: v * GIB for k, v in est.phases.items()}
    assert phases["rollout"] == pytest.approx(resident + 8 * 64 * 2 * 2 * 32 * 4)
    assert phases["log-probs"] == pytest.approx(resident + 256 * 960 * 4 + 256 * 100 * 12)
    assert phases["update"] == pytest.approx(resident + P * 4 + 256 * 2 * 960 * 4 + 256 * 100 * 20)
    assert est.total_gib == max(est.phases.values()) == est.phases["update"]
    assert est.fits is True and est.host_gib == 0


def test_unit_sizes_by_hand():
    d = dims_from_config(TINY)
    assert d.root_params == 2 * 100 * 64 + 64  # untied embeddings and head, final norm
    assert d.linear_params == 86_848 - 6_400 - (2 * 2 * 64 + 64)  # no input embedding (a lookup), no norms
    tied = dims_from_config({**TINY, "tie_word_embeddings": True})
    assert tied.root_params == 6_400 + 64 and tied.linear_params == tied.params - 320  # the head is the embedding


def test_mixed_precision_fsdp_offload_reference():
    """bf16 keeps 16 bytes of fp32 state per parameter (master weights, gradients, moments): only transients,
    activations and the KV cache shrink. fsdp divides the state by T and adds gathered units; offload moves
    the state to the host; the phases say where each transient lives."""
    d = dims_from_config(TINY)
    P, lay = 86_848, make_layout(1, 4, device="cuda", device_memory_gib=8)
    root, block = 12_864, 36_992
    ck = estimate_memory(cfg(model={"gradient_checkpointing": True}), make_layout(1, 1), d)
    assert ck.breakdown["activations"] * GIB == 256 * (2 * 64 + 960) * 4  # layer inputs + one layer recomputed

    bf = estimate_memory(cfg(model={"dtype": "bfloat16"}), make_layout(1, 1), d)
    b = {k: v * GIB for k, v in bf.breakdown.items()}
    assert (b["parameters"], b["gradients"], b["optimizer"]) == (P * 4, P * 4, P * 8)
    assert b["autocast copies"] == 2 * 80_128  # a bf16 copy of every weight a matmul reads
    assert b["activations"] == 256 * 2 * 960 * 2 and b["KV cache"] == 8 * 64 * 2 * 2 * 32 * 2
    for phase in ("rollout", "log-probs", "update"):  # autocast's cache lives through every forward
        assert bf.phases[phase] * GIB >= 12 * P + b["autocast copies"]

    fs = estimate_memory(cfg(parallel={"sharding": "fsdp"}), lay, d)
    b = {k: v * GIB for k, v in fs.breakdown.items()}
    assert (b["parameters"], b["gradients"], b["optimizer"]) == (P * 4 / 4, P * 4 / 4, P * 8 / 4)
    assert b["fsdp units"] == 4 * (root + 2 * block) and b["gathered model"] == 4 * (P + block)  # + a buffer
    assert b["autocast copies"] == b["gradient buckets"] == 0
    resident = 12 * P / 4 + GIB
    assert fs.phases["rollout"] * GIB == pytest.approx(resident + 4 * (P + block) + b["KV cache"])  # whole model
    assert fs.phases["update"] * GIB == pytest.approx(resident + P + b["fsdp units"] + block * 4 + b["activations"]
                                                      + b["logits"])  # + the largest unit's unsharded gradient
    fs_bf = estimate_memory(cfg(parallel={"sharding": "fsdp"}, model={"dtype": "bfloat16"}), lay, d)
    assert fs_bf.breakdown["fsdp units"] * GIB == 2 * (root + 2 * block)  # gathered in the compute dtype
    assert fs_bf.breakdown["gathered model"] * GIB == 2 * (P + block) and fs_bf.breakdown["parameters"] * GIB == P
    one = estimate_memory(cfg(parallel={"sharding": "fsdp"}), make_layout(1, 1, device="cuda"), d)
    assert one.breakdown["gathered model"] * GIB == 4 * P  # one rank: the shard is the whole, nothing to copy out
    assert fs_bf.breakdown["autocast copies"] == 0  # FSDP's policy casts as it gathers

    repl = estimate_memory(cfg(), lay, d)  # 4 replicated ranks: the gradient all-reduce's buckets
    assert repl.breakdown["gradient buckets"] * GIB == 4 * P

    full = estimate_memory(cfg(parallel={"sharding": "fsdp", "cpu_offload": "full"}), lay, d)
    assert full.breakdown["parameters"] == full.breakdown["gradients"] == full.breakdown["optimizer"] == 0
    assert full.host_gib * GIB == 16 * P / 4 and full.breakdown["fsdp units"] > 0
    assert full.phases["rollout"] * GIB == pytest.approx(GIB + 4 * (P + block) + full.breakdown["KV cache"] * GIB)
    for unrunnable, layout in (({"cpu_offload": "full"}, lay),  # replicated: no shards to offload
                               ({"sharding": "fsdp", "cpu_offload": "full"}, make_layout(1, 4))):  # no accelerator
        est = estimate_memory(cfg(parallel=unrunnable), layout, d)
        assert est.breakdown["parameters"] > 0 and est.host_gib == 0
        assert any("cannot run on this layout" in a for a in est.assumptions)

    ref = estimate_memory(cfg(algo={"kl_coef": 0.01}, model={"dtype": "bfloat16"}), make_layout(1, 1), d)
    assert ref.breakdown["reference model"] * GIB == P * 2  # frozen: compute dtype, no master copy
    ref4 = estimate_memory(cfg(algo={"kl_coef": 0.01}, parallel={"sharding": "fsdp"}), lay, d)
    assert ref4.breakdown["reference model"] * GIB == P * 4 / 4
    res = estimate_memory(cfg(rollout={"memory_fraction": 0.5}), lay, d)
    assert res.breakdown["rollout reserve"] == 4.0


@pytest.mark.parametrize("overrides, layout, shape", [
    ({}, (1, 1), (256, 8)),  # 8 rows fit 4 per micro-batch; 4 prompts x 2 generated
    ({}, (1, 4), (128, 2)),  # 2 rows per rank; one prompt (2 samples) per rank
    ({"train": {"token_cap_per_micro_batch": 10}}, (1, 1), (64, 8)),  # cap below one sample: it runs alone
    ({"train": {"min_rows_per_micro_batch": 2, "token_cap_per_micro_batch": 64}}, (1, 1), (128, 8)),
    ({"algo": {"minibatches_per_step": 4}}, (1, 1), (128, 8)),
])
def test_worst_case_shape(overrides, layout, shape):
    assert worst_case_shape(cfg(**overrides), make_layout(*layout)) == shape


@pytest.mark.parametrize("hf, match", [
    ({"model_type": "t5", "d_model": 512}, "lacks hidden_size"),
    ([1, 2], "not a JSON object"),
    ({**TINY, "hidden_size": "64"}, "lacks hidden_size"),
])
def test_unsupported_configs(hf, match):
    with pytest.raises(ValueError, match=match):
        dims_from_config(hf)


def test_nested_text_config_and_head_dim():
    d = dims_from_config({"model_type": "qwen2_5_vl", "text_config": {**TINY, "head_dim": 32}})
    assert d.head_dim == 32 and d.hidden == 64


def test_read_model_dims(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_model_dims(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable JSON"):
        read_model_dims(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert read_model_dims(str(tmp_path)).params == 86_848


def test_fixes_are_ranked_and_each_lowers_the_peak():
    d = dims_from_config(QWEN7B)
    c = RunConfig.model_validate({"model": {"dtype": "bfloat16"}, "algo": {"kl_coef": 0.001},
                                  "data": {"prompts_per_step": 8, "max_prompt_tokens": 400},
                                  "rollout": {"samples_per_prompt": 8, "max_new_tokens": 4096},
                                  "train": {"token_cap_per_micro_batch": 71936}})
    lay = make_layout(1, 4, device="cuda", device_memory_gib=80)
    base = estimate_memory(c, lay, d).total_gib
    assert base > 80
    fixes = memory_fixes(c, lay, d)
    totals = [f.total_gib for f in fixes]
    assert totals == sorted(totals) and all(t < base for t in totals)
    keys = {k for f in fixes for k in f.settings}
    assert {"model.gradient_checkpointing", "parallel.sharding", "parallel.cpu_offload",
            "train.token_cap_per_micro_batch", "algo.kl_coef", "data.prompts_per_step"} <= keys
    cap = next(f for f in fixes if "train.token_cap_per_micro_batch" in f.settings)
    value = cap.settings["train.token_cap_per_micro_batch"]
    assert value % 4496 == 0 and value < 71936  # whole rows of 400 + 4096 tokens
    for f in fixes:  # the numbers are what re-estimating with the setting gives
        assert estimate_memory(with_settings(c, f.settings), lay, d).total_gib == pytest.approx(f.total_gib)
        assert f.fits == (f.total_gib <= 80)
    if cap.fits:  # the largest cap that fits: one more row does not
        bigger = with_settings(c, {"train.token_cap_per_micro_batch": value + 4496})
        assert estimate_memory(bigger, lay, d).total_gib > 80
    assert "->" in fixes[0].text() and "GiB" in fixes[0].text()
    offload = next(f for f in fixes if f.settings.get("parallel.cpu_offload") == "full")
    assert offload.settings["parallel.sharding"] == "fsdp"  # offload alone would not run on a replicated model
    cpu = memory_fixes(c, make_layout(1, 4, device="cpu", device_memory_gib=80), d)
    assert cpu and not any("parallel.cpu_offload" in f.settings for f in cpu)  # no accelerator: no offload


def test_with_settings_validates_and_copies():
    c = cfg()
    new = with_settings(c, {"data.prompts_per_step": 9})
    assert new.data.prompts_per_step == 9 and c.data.prompts_per_step == 4
    with pytest.raises(ValidationError):
        with_settings(c, {"data.prompts_per_step": -1})


def test_critic_is_resident_like_the_policy_state():
    """algo.advantage=gae: the value model's fp32 weights and AdamW moments (12 bytes per parameter, sized as the
    policy) stay on the device in every phase; sharded and offloaded like the policy."""
    d = dims_from_config(TINY)
    P, lay = 86_848, make_layout(1, 4, device="cuda", device_memory_gib=8)
    base = estimate_memory(cfg(), make_layout(1, 1), d)
    ppo = estimate_memory(cfg(algo={"advantage": "gae"}), make_layout(1, 1), d)
    assert ppo.breakdown["critic"] * GIB == 12 * P and base.breakdown["critic"] == 0
    for phase in ("rollout", "log-probs", "update"):
        assert (ppo.phases[phase] - base.phases[phase]) * GIB == pytest.approx(12 * P)
    fs = estimate_memory(cfg(algo={"advantage": "gae"}, parallel={"sharding": "fsdp"}), lay, d)
    assert fs.breakdown["critic"] * GIB == 12 * P / 4
    off = estimate_memory(cfg(algo={"advantage": "gae"}, parallel={"sharding": "fsdp", "cpu_offload": "full"}), lay, d)
    assert off.breakdown["critic"] == 0 and off.host_gib * GIB == 2 * 16 * P / 4


def test_engine_and_placement_by_hand():
    """Where the rollout's memory goes: vLLM on cuda holds memory_fraction of the device (0.3 when 0) during the
    rollout only (it sleeps through the update); vLLM on cpu holds its own weights and its KV cache throughout;
    with reserved rollout devices the trainers generate nothing and hold no engine."""
    d = dims_from_config(TINY)
    P = 86_848
    gpu = make_layout(1, 2, device="cuda", device_memory_gib=80)
    hf = estimate_memory(cfg(), gpu, d)
    v = estimate_memory(cfg(rollout={"engine": "vllm"}), gpu, d)
    assert v.breakdown["rollout engine"] == pytest.approx(0.3 * 80) and v.breakdown["KV cache"] == 0
    resident = sum(v.breakdown[k] for k in ("parameters", "optimizer", "reference model", "rollout reserve",
                                            "overhead"))
    assert v.phases["rollout"] == pytest.approx(resident + 24)  # the engine's share, no sampler on the trainer
    assert v.phases["update"] == pytest.approx(hf.phases["update"])  # asleep: not in the update's peak
    half = estimate_memory(cfg(rollout={"engine": "vllm", "memory_fraction": 0.5}), gpu, d)
    assert half.breakdown["rollout engine"] == pytest.approx(40) and half.breakdown["rollout reserve"] == 0
    cpu = make_layout(1, 1, device="cpu", device_memory_gib=8)
    vc = estimate_memory(cfg(rollout={"engine": "vllm"}), cpu, d)
    assert vc.breakdown["rollout reserve"] * GIB == pytest.approx(4 * P + GIB)  # weights + 1 GiB of KV cache
    hfc = estimate_memory(cfg(), cpu, d)
    assert vc.phases["update"] * GIB == pytest.approx(hfc.phases["update"] * GIB + 4 * P + GIB)
    res = estimate_memory(cfg(), make_layout(1, 4, device="cuda", device_memory_gib=80, rollout_devices=1), d)
    assert res.breakdown["KV cache"] == 0 and res.phases["rollout"] == pytest.approx(
        sum(res.breakdown[k] for k in ("parameters", "optimizer", "reference model", "rollout reserve", "overhead")))
    assert any("rollout devices holds the hf engine" in n for n in res.assumptions)


def test_output_layer_memory_is_one_chunk_whatever_the_micro_batch():
    """The fused output layer (core.fused_head) holds one chunk of logits, so its term stops growing with the token
    cap: a 7B model's 16 k-token micro-batch plans ~1 GiB for it, not the ~9 GiB x 3 of full logits."""
    from evenrl.core.fused_head import _CHUNK_ELEMENTS
    from evenrl.planner.memory import HEAD_CHUNK

    assert HEAD_CHUNK == _CHUNK_ELEMENTS
    d = dims_from_config(QWEN7B)
    small, large = (estimate_memory(cfg(data={"max_prompt_tokens": 1024}, rollout={"max_new_tokens": 3072},
                                        train={"token_cap_per_micro_batch": cap}),
                                    make_layout(1, 1, device="cuda", device_memory_gib=80), d).breakdown
                    for cap in (4096, 16384))
    assert small["logits"] == large["logits"] == HEAD_CHUNK * (2 * 4 + 12) / GIB
    assert large["activations"] > small["activations"]
