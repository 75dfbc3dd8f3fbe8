"""`evenrl plan --fit` keeps the experiment: on a 30B-A3B-shaped and a 671B-shaped (DeepSeek-V3) mixture of experts it
never changes what is trained, its precision, the algorithm, prompts or samples per step, or the engine; it fits
the 30B-A3B with activation checkpointing and a smaller engine share, names the smallest cluster or what evenrl lacks
where nothing fits, and --write-config writes the fitted config. Pure planner tests: config.json files written here,
no weights, no torch."""

from __future__ import annotations

import json

import pytest
import yaml

from evenrl.cli import main as cli_main
from evenrl.config import flatten, load_config
from evenrl.planner.fit import FIT_KEYS, fit, fit_verdict, keeps_the_experiment
from evenrl.planner.layout import make_layout
from evenrl.planner.plan import make_plan, render

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
                 "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "max_position_embeddings": 40960, "tie_word_embeddings": False}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "vocab_size": 129280, "n_routed_experts": 256, "num_experts_per_tok": 8,
               "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "max_position_embeddings": 163840, "tie_word_embeddings": False}
# a 30B-A3B full fine-tuning run as a Megatron script sets it up, with its recompute lost: no checkpointing, a
# 0.7 vLLM share, engines of 4 devices, experts split 8 ways
MOE_30B = ["model.dtype=bfloat16", "data.prompts_per_step=32", "data.max_prompt_tokens=1024",
           "rollout.samples_per_prompt=8", "rollout.max_new_tokens=8192", "rollout.engine=vllm",
           "rollout.memory_fraction=0.7", "rollout.tensor_parallel_size=4", "algo.minibatches_per_step=4",
           "parallel.sharding=fsdp", "parallel.expert_parallel_size=8", "train.token_cap_per_micro_batch=18432"]
# DeepSeek-V3 on 32 nodes of 8 x 80 GB: 512 prompts x 16 samples, vLLM engines over a node each
DEEPSEEK = ["model.dtype=bfloat16", "model.gradient_checkpointing=true", "data.prompts_per_step=512",
            "data.max_prompt_tokens=2048", "rollout.samples_per_prompt=16", "rollout.max_new_tokens=8192",
            "rollout.engine=vllm", "rollout.memory_fraction=0.7", "rollout.tensor_parallel_size=8",
            "algo.minibatches_per_step=16", "parallel.sharding=fsdp", "parallel.expert_parallel_size=32",
            "train.token_cap_per_micro_batch=10240"]


def model_dir(tmp_path, config: dict):
    d = tmp_path / config["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def experiment(cfg) -> dict:
    """Every field --fit must leave as it is."""
    return {k: v for k, v in flatten(cfg.model_dump(mode="json")).items() if not keeps_the_experiment(k)}


def test_what_fit_may_change_is_the_layout_and_what_a_rank_holds():
    assert all(k.startswith(("parallel.", "model.gradient_checkpointing", "train.token_cap", "rollout.memory_fraction",
                             "rollout.tensor_parallel_size")) for k in FIT_KEYS)
    for key in ("model.lora.rank", "model.dtype", "model.weights_dtype", "data.prompts_per_step",
                "rollout.samples_per_prompt", "rollout.engine", "rollout.temperature", "algo.kl_coef",
                "algo.minibatches_per_step", "rollout.max_staleness", "train.lr"):
        assert not keeps_the_experiment(key), key


def test_fit_keeps_30b_a3b_full_fine_tuning_with_checkpointing_and_a_smaller_engine_share(tmp_path):
    cfg = load_config(None, MOE_30B + [f"model.path={model_dir(tmp_path, QWEN3_30B_A3B)}"])
    lay = make_layout(1, 8, device="cuda", device_memory_gib=95)
    plan = make_plan(cfg, lay)
    assert plan.memory.fits is False and plan.memory.total_gib > 150  # the activations of 2 samples, no recompute
    over = {f.rule: f for f in plan.findings}["memory-over"]
    assert "model.lora.rank=16" in over.fix or "model.weights_dtype=bfloat16" in over.fix  # suggested, not fitted
    new, changes = fit(plan)
    assert dict((k, b) for k, _, b in changes).keys() == {"model.gradient_checkpointing", "rollout.memory_fraction"}
    assert new.model.gradient_checkpointing and new.rollout.memory_fraction < 0.7
    assert experiment(new) == experiment(cfg)  # full fine-tuning, fp32 state, vLLM, 32 x 8 samples: as written
    after = make_plan(new, lay)
    assert after.memory.fits and after.memory.total_gib <= 0.9 * 95, render(after)  # under memory-tight's line
    assert fit_verdict(after) is None


@pytest.mark.parametrize("engine, lacks", [
    ([], "an engine across nodes (vLLM's pipeline parallelism) is what evenrl lacks"),
    (["rollout.engine=hf", "rollout.memory_fraction=0", "rollout.tensor_parallel_size=1"],
     "the hf sampler gathers the whole model to generate"),
])
def test_fit_never_changes_what_671b_trains_and_names_what_evenrl_lacks(tmp_path, engine, lacks):
    """DeepSeek-V3 on 256 x 80 GB: --fit keeps 512 prompts x 16 samples, full fine-tuning and the engine (the old
    --fit proposed 1 prompt and the hf engine and ended at 1,294 GiB); nothing that keeps them fits, and one finding
    says why: a vLLM engine's weights over one node's devices, or the hf sampler's gathered model."""
    cfg = load_config(None, DEEPSEEK + engine + [f"model.path={model_dir(tmp_path, DEEPSEEK_V3)}"])
    lay = make_layout(32, 8, device="cuda", device_memory_gib=80)
    plan = make_plan(cfg, lay)
    assert not plan.runnable
    new, changes = fit(plan)
    assert experiment(new) == experiment(cfg) and all(keeps_the_experiment(k) for k, _, _ in changes)
    after = make_plan(new, lay)
    verdict = fit_verdict(after)
    assert verdict.rule == "fit-none" and verdict.level == "error" and "\n" not in verdict.message
    assert "nothing that keeps the experiment fits 256 training ranks of 80 GiB" in verdict.message
    assert lacks in verdict.message, verdict.message


def test_fit_names_the_smallest_cluster_that_fits(tmp_path):
    """30B-A3B on one node of 2 x 60 GB: nothing that keeps the experiment fits there; 8 such nodes do, and the
    finding says so with the flag."""
    cfg = load_config(None, MOE_30B + ["rollout.tensor_parallel_size=2", "parallel.expert_parallel_size=2",
                                       f"model.path={model_dir(tmp_path, QWEN3_30B_A3B)}"])
    lay = make_layout(1, 2, device="cuda", device_memory_gib=60)
    new, _ = fit(make_plan(cfg, lay))
    verdict = fit_verdict(make_plan(new, lay))
    assert verdict.rule == "fit-none" and "16 of them (8 nodes) are the smallest" in verdict.message
    assert verdict.fix.startswith("--nnodes 8")
    assert make_plan(new, make_layout(8, 2, device="cuda", device_memory_gib=60)).memory.total_gib < \
        make_plan(new, lay).memory.total_gib


def test_write_config_with_fit_writes_the_fitted_config(tmp_path, capsys):
    model = model_dir(tmp_path, QWEN3_30B_A3B)
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))  # the files evenrl train checks: a shape
    (model / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")
    src = tmp_path / "run.yaml"
    src.write_text(yaml.safe_dump({}))
    out = tmp_path / "fitted.yaml"
    args = ["plan", str(src), *MOE_30B, f"model.path={model}", "--nproc-per-node", "8", "--device", "cuda",
            "--device-memory-gib", "95"]
    assert cli_main([*args, "--write-config", str(out)]) == 2  # without --fit or --from: refused in one line
    assert "--write-config: only with --from verl|easyr1|trl|openrlhf|slime or --fit" in capsys.readouterr().err
    assert not out.exists()
    assert cli_main([*args, "--fit", "--write-config", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    written = load_config(str(out))
    assert written.model.gradient_checkpointing and written.rollout.memory_fraction < 0.7
    assert written.model.lora.rank == 0 and written.data.prompts_per_step == 32 and written.rollout.engine == "vllm"
    assert make_plan(written, make_layout(1, 8, device="cuda", device_memory_gib=95)).runnable
    small = tmp_path / "small.yaml"  # nothing keeps it and fits: nothing written, one line
    assert cli_main([*args[:-1], "24", "--fit", "--write-config", str(small)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the fitted config has an error finding" in err[0] and not small.exists()
