"""The peers' current versions, read as their own code reads them (issue 52): verl 0.8's nested LoRA keys, version
detection that tells a current verl script from Logic-RL's fork, verl's bypass mode as its apply_bypass_mode does
it, k2/k3 rejection thresholds as verl takes them, OpenRLHF's version-dependent defaults, TRL's multi-node
accelerate launch with a `trl vllm-serve` node, and a layout the command line overrides. Each from a small file
written here."""

import argparse

import pytest

from evenrl.planner.peers import read_foreign, translate

VERL = "python3 -m verl.trainer.main_ppo"


def ns(**kw):
    base = dict(nnodes=None, nproc_per_node=None, rollout_devices=None, device=None, device_memory_gib=None,
                capacity_weights=None, json=False, fit=False, peer_version=None, nodes=None)
    return argparse.Namespace(**{**base, **kw})


def plan(tmp_path, framework: str, text: str, name: str = "run.sh", **layout):
    f = tmp_path / name
    f.write_text(text)
    return translate(framework, read_foreign(framework, str(f), []), ns(**layout))


def keys(t) -> dict:
    return {row["key"]: row for row in t.keys}


BATCH = ("data.train_batch_size=16 actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.rollout.n=4 "
         "trainer.nnodes=1 trainer.n_gpus_per_node=8 ")


# ----------------------------------------------------------------------------------------------- verl


def test_verl_nested_lora_keys_are_megatrons_lora(tmp_path):
    """verl 0.8's actor_rollout_ref.model.lora.* (what the 235B and 30B LoRA runs set) is LoRA, read first as verl
    reads it (model.lora.rank, else lora_rank), with Megatron-Bridge's defaults (alpha 32) and layer names."""
    m = "actor_rollout_ref.model."
    t, cfg = plan(tmp_path, "verl", f"{VERL} {BATCH} actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 "
                                    f"{m}lora.rank=32 {m}lora.merge=True {m}lora_rank=8\n")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (32, 32.0, [])
    rows = keys(t)
    assert rows[m + "lora.rank"]["status"] == "mapped" and rows[m + "lora.merge"]["status"] == "not_applicable"
    assert rows[m + "lora_rank"]["status"] != "mapped"  # verl ignores it when lora.rank > 0
    _, cfg = plan(tmp_path, "verl", f"{VERL} {BATCH} {m}lora.rank=16 {m}lora.alpha=64 "
                                    f"'{m}lora.target_modules=[linear_qkv,linear_fc2]'\n")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.target_modules) == \
        (16, 64.0, ["q_proj", "k_proj", "v_proj", "down_proj"])
    _, cfg = plan(tmp_path, "verl", f"{VERL} {BATCH} {m}lora_rank=8 {m}lora_alpha=16\n")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (8, 16.0)  # the legacy FSDP keys still map


def test_a_current_verl_script_with_the_older_spelling_is_not_logic_rl(tmp_path):
    """ppo_micro_batch_size and log_prob_micro_batch_size are keys verl 0.8 still reads: they choose Logic-RL's fork
    only in a file all of whose keys the fork knows; a key only the fork has (grad_offload) chooses it outright."""
    a = "actor_rollout_ref.actor."
    current = (f"{VERL} {BATCH} {a}ppo_micro_batch_size=8 actor_rollout_ref.rollout.log_prob_micro_batch_size=8 "
               f"{a}use_kl_loss=True {a}clip_ratio_c=10.0 actor_rollout_ref.rollout.name=vllm\n")
    t, cfg = plan(tmp_path, "verl", current)
    assert t.version == "0.8"
    assert cfg.algo.clip_ratio_c == 10.0 and not [r for r in t.keys if r["status"] == "unknown"]
    t, _ = plan(tmp_path, "verl", f"{VERL} {BATCH} {a}ppo_micro_batch_size=8 data.val_batch_size=8\n")
    assert t.version == "logic-rl"
    t, _ = plan(tmp_path, "verl", f"{VERL} {BATCH} {a}ppo_micro_batch_size_per_gpu=1 "
                                  f"{a}fsdp_config.grad_offload=True\n")
    assert t.version == "logic-rl"


def verl_bypass_rule(loss_mode: str, loss_type: str, clip_c: float, agg: str) -> tuple:
    """verl's own rule (volcengine/verl@b178a3c): rollout_corr_helper.apply_bypass_mode sets
    policy_loss.loss_mode = "bypass_mode" whatever it was; core_algos.compute_policy_loss_bypass_mode runs
    compute_policy_loss_vanilla (dual clip with clip_ratio_c) for loss_type=ppo_clip and
    compute_policy_loss_reinforce for reinforce, each aggregated by loss_agg_mode."""
    return ("ppo", clip_c, agg) if loss_type == "ppo_clip" else ("gpg", agg)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "sapo", "cispo", "geo_mean", "gpg"])
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_replaces_the_loss_mode_as_verl_does(tmp_path, loss_mode, loss_type):
    a, c = "actor_rollout_ref.actor.", "algorithm.rollout_correction."
    t, cfg = plan(tmp_path, "verl", f"{VERL} {BATCH} {a}ppo_micro_batch_size_per_gpu=1 "
                                    f"{a}policy_loss.loss_mode={loss_mode} {a}loss_agg_mode=token-mean "
                                    f"{c}bypass_mode=True {c}loss_type={loss_type}\n")
    got = (cfg.algo.policy_loss, cfg.algo.clip_ratio_c, cfg.algo.loss_aggregation) if loss_type == "ppo_clip" \
        else (cfg.algo.policy_loss, cfg.algo.loss_aggregation)
    assert got == verl_bypass_rule(loss_mode, loss_type, 3.0, "token-mean")
    assert cfg.algo.old_policy == "engine"
    if loss_mode != "vanilla":
        assert any(f"replaces {loss_mode} with its bypass loss" in n for n in t.notes)


@pytest.mark.parametrize("threshold", [0.5, 2e6, 1e12])
def test_k2_k3_thresholds_as_verl_takes_them(tmp_path, threshold):
    """verl's _parse_rollout_rs_thresholds takes any positive upper bound for k2/k3 criteria (1e12: reject
    nothing in practice); the plan took at most 1e6."""
    c = "algorithm.rollout_correction."
    _, cfg = plan(tmp_path, "verl", f"{VERL} {BATCH} {c}rollout_rs=seq_sum_k3,token_k2 "
                                    f"{c}rollout_rs_threshold={threshold}\n")
    assert [(r.criterion, r.high) for r in cfg.algo.rejection] == [("seq_sum_k3", threshold),
                                                                    ("token_k2", threshold)]


def test_layout_keys_the_command_line_overrides_say_so(tmp_path):
    t, _ = plan(tmp_path, "verl", f"{VERL} {BATCH}\n", nnodes=2, nproc_per_node=4)
    rows = keys(t)
    for key in ("trainer.nnodes", "trainer.n_gpus_per_node"):
        assert rows[key]["status"] == "not_applicable"
        assert rows[key]["why"] == "overridden by the command line's layout (--nnodes 2, --nproc-per-node 4)"
    assert t.layout.world == 8


# ----------------------------------------------------------------------------------------------- OpenRLHF


def openrlhf(extra: str = "") -> str:
    return ("ray job submit --address=http://127.0.0.1:8265 -- python3 -m openrlhf.cli.train_ppo_ray "
            "--actor_num_nodes 1 --actor_num_gpus_per_node 8 --vllm_num_engines 4 --vllm_tensor_parallel_size 2 "
            "--micro_train_batch_size 1 --train_batch_size 128 --rollout_batch_size 1024 --zero_stage 3 --bf16 "
            f"--pretrain meta-llama/Meta-Llama-3-70B-Instruct {extra}\n")


@pytest.mark.parametrize("version", [None, "0.7", "0.11"])
def test_openrlhf_vllm_memory_share_is_the_versions_default(tmp_path, version):
    """train_ppo_ray.py's --vllm_gpu_memory_utilization defaults to 0.95 (since 0.6.4; 0.9 before), where evenrl's
    own share would refuse the 70B engines OpenRLHF runs."""
    t, cfg = plan(tmp_path, "openrlhf", openrlhf(), peer_version=version)
    assert cfg.rollout.memory_fraction == 0.95
    assert any("gpu_memory_utilization is not set: 0.95" in n for n in t.notes)
    _, cfg = plan(tmp_path, "openrlhf", openrlhf("--vllm_gpu_memory_utilization 0.6"), peer_version=version)
    assert cfg.rollout.memory_fraction == 0.6


def test_openrlhf_flash_attn_is_a_flag_of_its_version(tmp_path):
    """--flash_attn is OpenRLHF 0.5-0.8.9's flag (0.8.10 replaced it by --attn_implementation): a kernel choice,
    not a typo."""
    t, _ = plan(tmp_path, "openrlhf", openrlhf("--flash_attn"))
    row = keys(t)["flash_attn"]
    assert row["status"] == "not_applicable" and "kernel choice" in row["why"]


# ----------------------------------------------------------------------------------------------- TRL

TRL_MULTI_NODE = """#!/bin/bash
#SBATCH --nodes=5
#SBATCH --gres=gpu:8
NODELIST=($(scontrol show hostnames $SLURM_JOB_NODELIST))
VLLM_NODE="${NODELIST[4]}"
srun --nodes=4 --ntasks=4 --nodelist="${NODELIST[@]:0:4}" accelerate launch \\
     --config_file examples/accelerate_configs/deepspeed_zero3.yaml \\
     --num_processes 32 \\
     --num_machines 4 \\
     --main_process_ip ${NODELIST[0]} \\
     --machine_rank $SLURM_PROCID \\
     --rdzv_backend c10d \\
     train_grpo.py \\
     --server_ip $VLLM_NODE &
srun --nodes=1 --ntasks=1 --nodelist="${NODELIST[4]}" trl vllm-serve --model Qwen/Qwen2.5-72B --tensor_parallel_size 8 &
wait
"""


def test_trl_multi_node_accelerate_launch_with_a_vllm_serve_node(tmp_path):
    """TRL's documented 70B example: accelerate's --num_processes 32 over --num_machines 4 is 4 nodes of 8, ZeRO-3
    (TRL's bundled deepspeed_zero3.yaml: sharded), and `trl vllm-serve --tensor_parallel_size 8` a fifth node of
    8 devices that generate: not one node of 32 unsharded processes."""
    t, cfg = plan(tmp_path, "trl", TRL_MULTI_NODE)
    lay = t.layout
    assert (lay.nnodes, lay.nproc_per_node, lay.training_ranks, lay.rollout_devices) == (5, 8, 32, 8)
    assert cfg.parallel.sharding == "fsdp" and cfg.parallel.rollout_devices == 8
    assert (cfg.rollout.engine, cfg.rollout.tensor_parallel_size) == ("vllm", 8)
    assert t.paths["model.path"] == "Qwen/Qwen2.5-72B"
    assert any("(bundled)" in n and "deepspeed_zero3.yaml" in n for n in t.notes)


def test_trl_accelerate_config_on_this_machine_is_read(tmp_path):
    (tmp_path / "fsdp_offload.yaml").write_text(
        "distributed_type: FSDP\nfsdp_config: {fsdp_offload_params: true, fsdp_version: 2}\nnum_machines: 2\n"
        "num_processes: 16\n")
    script = "accelerate launch --config_file fsdp_offload.yaml grpo.py --use_vllm true --vllm_mode colocate\n"
    t, cfg = plan(tmp_path, "trl", script)
    assert (t.layout.nnodes, t.layout.nproc_per_node) == (2, 8)
    assert (cfg.parallel.sharding, cfg.parallel.cpu_offload) == ("fsdp", "full")
