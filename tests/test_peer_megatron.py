"""Megatron and MoE settings in peers' big-model scripts as the layout evenrl would really run (issue 52,
peers/megatron.py): recompute -> activation checkpointing, Megatron offload -> FSDP2's CPU offload, TP on a
mixture of experts -> TP 1 with EP on the experts (never expert_parallel_size=1), pipeline -> FSDP2 over those
ranks, context parallelism -> Ulysses, expert-parallel generation noted; and the memory the plan counts is that
layout's. Each from a small verl script written here (a config.json-only model where the plan needs dimensions)."""

import pytest

from evenrl.config import with_settings
from evenrl.planner.plan import make_plan
from test_foreign import config_only_model
from test_peer_versions import plan

MEGATRON = ("python3 -m verl.trainer.main_ppo --config-name ppo_megatron_trainer data.train_batch_size=64 "
            "data.max_prompt_length=1024 data.max_response_length=7168 actor_rollout_ref.rollout.n=8 "
            "actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 "
            "trainer.nnodes=1 trainer.n_gpus_per_node=8 ")
M = "actor_rollout_ref.actor.megatron."
O = M + "override_transformer_config."
# Qwen3-30B-A3B's shape (config.json only: the planner counts what the weights would be)
A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
       "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
       "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
       "max_position_embeddings": 40960}
DENSE = {"model_type": "qwen2", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False,
         "max_position_embeddings": 32768}


def megatron(tmp_path, extra: str, model: dict | None = None, **layout):
    tmp_path.mkdir(exist_ok=True)
    path = config_only_model(tmp_path / "model", model) if model else None
    more = f" actor_rollout_ref.model.path={path}" if path else ""
    return plan(tmp_path, "verl", MEGATRON + extra + more + "\n", **layout)


@pytest.mark.parametrize("granularity, method, checkpointing, note", [
    ("full", "uniform", True, None),
    ("full", "block", True, "recomputes the first 4 layers of each stage"),
    ("selective", "null", False, "recomputes parts of each layer"),
    ("null", "null", False, None),  # Megatron's default: no recompute (verl's FSDP key does not apply)
])
def test_recompute_is_activation_checkpointing(tmp_path, granularity, method, checkpointing, note):
    t, cfg = megatron(tmp_path, f"+{O}recompute_granularity={granularity} +{O}recompute_method={method} "
                                f"+{O}recompute_num_layers=4 actor_rollout_ref.model.enable_gradient_checkpointing=True")
    assert cfg.model.gradient_checkpointing is checkpointing
    assert (note is None) == (not any(note and note in n for n in t.notes))
    rows = {r["key"]: r for r in t.keys}
    assert rows["actor_rollout_ref.model.enable_gradient_checkpointing"]["status"] == "not_applicable"


def test_recompute_is_the_memory_the_plan_counts(tmp_path):
    """A 30B-A3B-shaped run with recompute_granularity=full: the plan counts checkpointed activations (a fraction of
    what the same run holds without it), not the 80+ GiB of a run without checkpointing."""
    t, cfg = megatron(tmp_path, f"{M}expert_model_parallel_size=8 +{O}recompute_granularity=full", A3B,
                      device_memory_gib=80)
    with_ckpt = make_plan(cfg, t.layout).memory.breakdown["activations"]
    without = make_plan(with_settings(cfg, {"model.gradient_checkpointing": False}), t.layout)
    without = without.memory.breakdown["activations"]
    assert with_ckpt < without / 4, (with_ckpt, without)


def test_tensor_parallel_on_a_mixture_of_experts_is_tp_with_ep(tmp_path):
    """Megatron TP 4 on Qwen3-30B-A3B (EP 1: its experts split by TP, ETP defaulting to TP): evenrl runs TP 4 on the
    attention with EP 4 on the experts and FSDP2 sharding the rest, says so, and plans it runnable; with EP 8 the
    file's EP; where TP divides no expert count and EP is unset, TP 1 (evenrl's TP needs EP beside it)."""
    t, cfg = megatron(tmp_path, f"{M}tensor_model_parallel_size=4", A3B)
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.expert_parallel_size, cfg.parallel.sharding) == \
        (4, 4, "fsdp")
    note = next(n for n in t.notes if n.startswith(M + "tensor_model_parallel_size=4 on a mixture of experts"))
    assert "parallel.tensor_parallel_size=4" in note and "parallel.expert_parallel_size=4" in note
    p = make_plan(cfg, t.layout)
    assert not [f for f in p.findings if f.rule.startswith(("expert-parallel", "tensor-parallel")) and
                f.level == "error"], [f.rule for f in p.findings]
    t, cfg = megatron(tmp_path / "ep", f"{M}tensor_model_parallel_size=2 {M}expert_model_parallel_size=8")
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.expert_parallel_size) == (2, 8)  # EP 8: an MoE
    t, cfg = megatron(tmp_path / "odd", f"{M}tensor_model_parallel_size=3", {**A3B, "num_experts": 128})
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.expert_parallel_size) == (1, 1)
    assert any("whose 128 experts it does not divide" in n for n in t.notes)
    t, cfg = megatron(tmp_path / "dense", f"{M}tensor_model_parallel_size=2", DENSE)
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.expert_parallel_size) == (2, 1)


def test_pipeline_and_context_parallelism_become_fsdp_and_ulysses(tmp_path):
    t, cfg = megatron(tmp_path, f"{M}pipeline_model_parallel_size=4 {M}context_parallel_size=2", DENSE)
    assert (cfg.parallel.sharding, cfg.parallel.sequence_parallel_size) == ("fsdp", 2)
    assert any(n.startswith(M + "pipeline_model_parallel_size=4: evenrl has no pipeline parallelism") for n in t.notes)
    assert any(n.startswith(M + "context_parallel_size=2") and "Ulysses" in n for n in t.notes)
    # verl's own batch check still divides by its data-parallel size, world / (TP x PP x CP) = 1
    assert not t.checks or all("real_train_batch_size" not in c.message for c in t.checks)


def test_megatron_offload_is_fsdp2_offload_except_with_expert_parallelism(tmp_path):
    offload = f"{M}param_offload=True {M}grad_offload=True {M}optimizer_offload=True"
    t, cfg = megatron(tmp_path, offload, DENSE)
    assert (cfg.parallel.sharding, cfg.parallel.cpu_offload) == ("fsdp", "full")
    assert any("Megatron moves the offloaded state to the host between phases" in n for n in t.notes)
    _, cfg = megatron(tmp_path / "host", "actor_rollout_ref.actor.optim.override_optimizer_config."
                                         "optimizer_cpu_offload=True", DENSE)  # Megatron's optimizer on the host
    assert cfg.parallel.cpu_offload == "full"
    t, cfg = megatron(tmp_path / "ep", f"{offload} {M}expert_model_parallel_size=4", A3B)
    assert (cfg.parallel.cpu_offload, cfg.parallel.expert_parallel_size) == ("none", 4)
    assert any("does not run with tensor or expert parallelism" in n for n in t.notes)
    assert not [f for f in make_plan(cfg, t.layout).findings if f.rule == "expert-parallel-offload"]


def test_expert_parallel_generation_is_noted(tmp_path):
    t, _ = megatron(tmp_path, "actor_rollout_ref.rollout.expert_parallel_size=8 "
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=8")
    row = {r["key"]: r for r in t.keys}["actor_rollout_ref.rollout.expert_parallel_size"]
    assert row["status"] == "no_equivalent" and "enable_expert_parallel" in row["why"]


# ----------------------------------------------------------------------------------------------- slime

SLIME = """#!/bin/bash
pkill -9 sglang
ray stop --force
MODEL_ARGS=(--num-layers 48 --hidden-size 2048 --num-experts 128 --moe-router-topk 8 --moe-aux-loss-coeff 0)
PERF_ARGS=(
   --tensor-model-parallel-size 4
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --expert-model-parallel-size 8
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 20480
)
ROLLOUT_ARGS=(--rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 8192
              --rollout-max-prompt-len 1024 --global-batch-size 64 --num-rollout 3000)
ray job submit --address="http://127.0.0.1:8265" -- python3 train.py \\
   --actor-num-nodes 2 --actor-num-gpus-per-node 8 --colocate \\
   ${MODEL_ARGS[@]} ${PERF_ARGS[@]} ${ROLLOUT_ARGS[@]} \\
   --advantage-estimator gspo --eps-clip 3e-4 --eps-clip-high 4e-4 --lr 1e-6 --adam-beta2 0.98 \\
   --use-rollout-routing-replay --use-tis --tis-clip 2 \\
   --rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 --sglang-ep-size 8 \\
   --optimizer-cpu-offload --calculate-per-token-loss
"""


def test_slime_script(tmp_path):
    """slime's Megatron/SGLang flags read by the same table reader as the other peers: the layout (2 x 8, engines
    of 8 GPUs), batches (32 prompts x 8 samples in optimizer steps of 64 samples: 4 mini-batches), TP 4 on the
    mixture of experts as TP 4 with its EP 8, recompute, GSPO, routing replay (R3), TIS, the learning rate."""
    t, cfg = plan(tmp_path, "slime", SLIME, device_memory_gib=80)
    assert (t.layout.nnodes, t.layout.nproc_per_node, t.layout.rollout_devices) == (2, 8, 0)
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.algo.minibatches_per_step) == (32, 8, 4)
    assert (cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens, cfg.train.token_cap_per_micro_batch) == \
        (1024, 8192, 20480)
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.expert_parallel_size, cfg.parallel.sharding) == \
        (4, 8, "fsdp")
    assert (cfg.model.gradient_checkpointing, cfg.model.dtype) == (True, "bfloat16")
    assert (cfg.algo.advantage, cfg.algo.policy_loss, cfg.algo.clip_low, cfg.algo.clip_high) == \
        ("grpo", "gspo", 3e-4, 4e-4)
    assert (cfg.algo.loss_aggregation, cfg.rollout.router_replay, cfg.algo.importance_cap) == \
        ("token-mean", "engine", 2.0)
    assert (cfg.train.lr, tuple(cfg.train.betas), cfg.train.steps) == (1e-6, (0.9, 0.98), 3000)
    assert (cfg.rollout.engine, cfg.rollout.tensor_parallel_size, cfg.rollout.memory_fraction) == ("vllm", 8, 0.7)
    assert cfg.parallel.cpu_offload == "none"  # not with expert parallelism: said in a note
    rows = {r["key"]: r for r in t.keys}
    assert not [k for k, r in rows.items() if r["status"] == "unknown"], rows
    assert "all-to-all" in rows["sglang_ep_size"]["why"] and rows["num_layers"]["status"] == "not_applicable"
    assert not t.checks


def test_slime_checks_are_slimes_and_megatrons(tmp_path):
    script = ("python3 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 6 --tensor-model-parallel-size 4 "
              "--rollout-batch-size 8 --use-dynamic-batch-size --kl-coef 0.1 --kl-loss-coef 0.01\n")
    t, _ = plan(tmp_path, "slime", script)
    assert [c.message for c in t.checks] == [
        "world size (6) is not divisible by total_model_size (total_model_size=4)",
        "Only one of kl_coef and kl_loss_coef can be set",
        "max_tokens_per_gpu must be set when use_dynamic_batch_size is set",
        "num_epoch is not set, but num_rollout is not set, please set --num-rollout or --num-epoch"]
