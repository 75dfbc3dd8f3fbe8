"""A fix must change something: over many configs, layouts and model shapes, no finding's fix (and no --fit change)
proposes a setting the run already has (a 72B-shaped plan with model.gradient_checkpointing=true once warned
memory-tight with the fix `model.gradient_checkpointing=true`). Pure planner: no torch, ~15 ms a plan."""

import argparse
import re

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from evenrl.config import load_config
from evenrl.errors import UsageError
from evenrl.planner.fit import fit
from evenrl.planner.layout import apply_layout_flags, make_layout
from evenrl.planner.plan import make_plan

QWEN72B = {"model_type": "qwen2", "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
           "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False,
           "max_position_embeddings": 32768}
QWEN7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
          "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
          "max_position_embeddings": 32768}
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 128}

# the knobs the rules and memory fixes read and propose, each with values on both sides of their thresholds
KNOBS = {
    "model.dtype": ["float32", "bfloat16"],
    "model.gradient_checkpointing": [False, True],
    "model.lora.rank": [0, 16],
    "parallel.sharding": ["replicated", "fsdp"],
    "parallel.cpu_offload": ["none", "full"],
    "parallel.sequence_parallel_size": [1, 2, 4],
    "train.token_cap_per_micro_batch": [100, 1024, 4096, 16384, 65536],
    "train.min_rows_per_micro_batch": [1, 2],
    "train.steps": [10, 100],
    "train.warmup_steps": [0, 1, 50],
    "data.prompts_per_step": [1, 2, 3, 5, 8, 64],
    "data.max_prompt_tokens": [64, 512],
    "rollout.samples_per_prompt": [1, 2, 4, 8],
    "rollout.max_new_tokens": [64, 100, 1024, 8192],
    "rollout.temperature": [0.0, 1.0],
    "rollout.memory_fraction": [0.0, 0.3],
    "rollout.max_staleness": [0, 1],
    "algo.minibatches_per_step": [1, 2, 4],
    "algo.kl_coef": [0.0, 0.001],
    "algo.advantage": ["grpo", "dr_grpo", "rloo", "reinforce_pp"],
    "algo.std_scale": ["group", "batch"],
    "algo.filter_groups": [False, True],
    "algo.importance_correction": ["none", "stale"],
    "rollout.engine": ["hf", "vllm"],
    "rollout.decoder": ["auto", "lean", "static"],
    "model.lora.dropout": [0.0, 0.05],
    "log.save_merged": [False, True],
    "rewards.sandbox": ["tools", "all", "none"],
    "rewards.overlong_buffer": [0, 16],
}
LAYOUTS = st.fixed_dictionaries({
    "nnodes": st.sampled_from([1, 2]), "nproc_per_node": st.sampled_from([1, 2, 4, 8]),
    "device": st.sampled_from(["cuda", "cpu"]), "device_memory_gib": st.sampled_from([0, 18, 24, 80]),
    "rollout_devices": st.sampled_from([0, 0, 1, 3])})
NODES = [None, None, "8xH100-80,8xA10-24", "4xH100-80,4xL4-24", "2xA100-40,2xA10-24"]  # device groups: each its
#                                                                                       own memory findings
SETTING = re.compile(r"(?<![\w.-])([a-z_]+(?:\.[a-z_0-9]+)+)=([^\s;,()]+)")
FLAG = re.compile(r"--(rollout-devices|nproc-per-node|nnodes) (\d+)\b")


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return float(text)
    except ValueError:
        return text


def _current(plan, key: str):
    if key == "parallel.rollout_devices":  # a flag's equivalent: the layout's count is the one in force
        return plan.layout.rollout_devices
    obj = plan.config
    for part in key.split("."):
        if not hasattr(obj, part):
            return None  # a placeholder (data.path=FILE.jsonl is not a field's value) or not a field
        obj = getattr(obj, part)
    return obj


def _same(current, proposed) -> bool:
    if isinstance(current, bool) or isinstance(proposed, bool):
        return current is proposed
    if isinstance(current, (int, float)) and isinstance(proposed, float):
        return float(current) == proposed
    return str(current) == str(proposed)


def proposals_already_set(plan) -> list[str]:
    """Every `key=value` and layout flag in the plan's fixes that the plan's own config or layout already has."""
    lay, out = plan.layout, []
    flags = {"rollout-devices": lay.rollout_devices, "nproc-per-node": lay.nproc_per_node, "nnodes": lay.nnodes}
    for f in plan.findings:
        for key, value in SETTING.findall(f.fix):
            if _same(_current(plan, key), _value(value)):
                out.append(f"{f.rule}: {key}={value} in {f.fix!r}")
        for flag, n in FLAG.findall(f.fix):
            if flags[flag] == int(n):
                out.append(f"{f.rule}: --{flag} {n} in {f.fix!r}")
    return out


def test_the_reported_case():
    """memory-tight on a 72B-shaped plan that checkpoints already: the fix names what is left to change."""
    cfg = load_config(None, ["model.dtype=bfloat16", "parallel.sharding=fsdp", "parallel.cpu_offload=full",
                             "model.gradient_checkpointing=true", "data.prompts_per_step=8",
                             "rollout.samples_per_prompt=4", "data.max_prompt_tokens=512",
                             "rollout.max_new_tokens=1024"])
    tight = None
    for gib in range(20, 200):  # the device memory where the estimate sits in (90%, 100%]
        plan = make_plan(cfg, make_layout(4, 8, device="cuda", device_memory_gib=gib), model_config=QWEN72B)
        tight = next((f for f in plan.findings if f.rule == "memory-tight"), None)
        if tight:
            break
    assert tight is not None
    assert "gradient_checkpointing" not in tight.fix and tight.fix, tight
    assert proposals_already_set(plan) == []


@settings(max_examples=500, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({k: st.sampled_from(v) for k, v in KNOBS.items()}), LAYOUTS,
       st.sampled_from(NODES), st.sampled_from([None, TINY, QWEN7B, QWEN72B]))
def test_no_fix_proposes_what_is_already_set(knobs, layout, nodes, model):
    try:
        cfg = load_config(None, [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in knobs.items()])
        lay = make_layout(**layout)
        if nodes:
            lay = apply_layout_flags(lay, argparse.Namespace(nodes=nodes, nnodes=None, nproc_per_node=None,
                                                             device=None, device_memory_gib=None,
                                                             capacity_weights=None,
                                                             rollout_devices=layout["rollout_devices"]))
    except UsageError:
        assume(False)  # a combination the config itself refuses
    plan = make_plan(cfg, lay, model_config=model)
    assert proposals_already_set(plan) == []
    _, changes = fit(plan)
    assert all(a != b for _, a, b in changes), changes
