"""The planner's side of sequence parallelism (parallel.sequence_parallel_size) and of the vLLM engine's tensor
parallelism (rollout.tensor_parallel_size): the memory per rank, the balance over SP groups, each rule's finding
and fix, and --fit. Torch-free and fast (plans only)."""

import json
import math
from pathlib import Path

import pytest

from evenrl.config import load_config, with_settings
from evenrl.planner.dims import dims_from_config
from evenrl.planner.fit import fit
from evenrl.planner.layout import make_layout
from evenrl.planner.memory import GIB, estimate_memory, worst_case_shape
from evenrl.planner.memory_fixes import sequence_settings
from evenrl.planner.plan import make_plan, render

ROOT = Path(__file__).resolve().parents[1]
QWEN7B = json.loads((ROOT / "tests" / "fixtures" / "qwen2.5-7b" / "config.json").read_text())
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 4096}
VL = {"model_type": "qwen2_5_vl", "text_config": TINY,
      "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64}}
# one 32 K-token response per sample, a 7B model in bf16 under FSDP: a sample does not fit one rank's activations
LONG = ["model.dtype=bfloat16", "parallel.sharding=fsdp", "rollout.engine=vllm", "data.prompts_per_step=16",
        "rollout.samples_per_prompt=8", "data.max_prompt_tokens=1024", "rollout.max_new_tokens=32768",
        "train.token_cap_per_micro_batch=33792"]
SHORT = ["data.prompts_per_step=8", "rollout.samples_per_prompt=4", "data.max_prompt_tokens=64",
         "rollout.max_new_tokens=64", "train.token_cap_per_micro_batch=1024"]


def plan(overrides=(), model_config=None, base=SHORT, **layout):
    layout = {"nproc_per_node": 8, "device": "cuda", "device_memory_gib": 80, **layout}
    return make_plan(load_config(None, list(base) + list(overrides)), make_layout(**layout),
                     model_config=model_config)


def rules(p):
    return {f.rule: f for f in p.findings}


def test_sp_divides_a_ranks_sequence_memory_and_keeps_the_state():
    """Activations, logits' chunk and layer activations are a rank's 1/SP slice of the sample; parameters,
    optimizer state and gradients stay sharded over all 8 ranks; the all-to-all buffers are 4 t h c (log-probs)
    and twice that (update)."""
    d, lay = dims_from_config(QWEN7B), make_layout(1, 8, device="cuda", device_memory_gib=80)
    one = load_config(None, LONG)
    four = with_settings(one, sequence_settings(one, d, 4))
    assert four.train.token_cap_per_micro_batch == 33792 // 4  # one sample's slice per rank
    a, b = estimate_memory(one, lay, d), estimate_memory(four, lay, d)
    assert a.micro_tokens == 33792 and b.micro_tokens == 8448
    for key in ("parameters", "optimizer", "gradients", "fsdp units", "rollout reserve"):
        assert b.breakdown[key] == a.breakdown[key], key
    assert b.breakdown["activations"] == pytest.approx(a.breakdown["activations"] / 4)
    assert b.breakdown["layer activations"] == pytest.approx(a.breakdown["layer activations"] / 4)
    assert a.breakdown["all-to-all"] == a.breakdown["log-prob all-to-all"] == 0
    assert b.breakdown["log-prob all-to-all"] * GIB == 4 * 8448 * 3584 * 2
    assert b.breakdown["all-to-all"] == 2 * b.breakdown["log-prob all-to-all"]
    assert a.fits is False and b.fits is True


def test_the_token_cap_is_per_rank_so_short_samples_gain_nothing():
    """A group's micro-batch holds SP x the per-rank cap (verl's ppo_max_token_len_per_gpu): with samples that fit
    the cap, SP=2 leaves a rank the same tokens as SP=1, ceil-divided and padded to a multiple of SP."""
    lay = make_layout(1, 4, device="cuda", device_memory_gib=80)
    cfg = load_config(None, SHORT)
    assert worst_case_shape(cfg, lay)[0] == worst_case_shape(
        with_settings(cfg, {"parallel.sequence_parallel_size": 2}), lay)[0] == 1024
    odd = load_config(None, SHORT + ["rollout.max_new_tokens=1001", "train.token_cap_per_micro_batch=100"])
    t, _ = worst_case_shape(with_settings(odd, {"parallel.sequence_parallel_size": 4}), lay)
    assert t == math.ceil(1065 / 4)  # one oversize sample, split 4 ways


def test_balance_counts_sp_groups():
    p = plan(["parallel.sequence_parallel_size=4"])
    assert p.sequence_parallel == 4 and p.dp_size == 2 and len(p.ranks) == 2
    assert sum(r.samples for r in p.ranks) == 32 and {r.samples for r in p.ranks} == {16}
    d = p.to_dict()["ranks"]
    assert d["sequence_parallel"] == 4 and d["dp_groups"] == 2 and len(d["per_rank"]) == 2
    text = " ".join(render(p).split())  # unwrapped
    assert "2 data-parallel groups of 4 ranks (0-3, 4-7)" in text and "no idle SP groups" in text
    assert "token cap 1,024 per rank, 4,096 per SP group of 4 (32 samples)" in text
    idle = plan(["parallel.sequence_parallel_size=2", "data.prompts_per_step=1", "rollout.samples_per_prompt=2"])
    f = rules(idle)["idle-ranks"]
    assert "on 4 SP groups leaves 2 groups idle" in f.message and "data.prompts_per_step=2" in f.fix


@pytest.mark.parametrize("overrides, layout, model, rule, level, texts", [
    (["parallel.sequence_parallel_size=3"], {}, TINY, "sequence-parallel-ranks", "error",
     ["does not divide the 8 training ranks", "parallel.sequence_parallel_size=2", "parallel.sequence_parallel_size=4"]),
    (["parallel.sequence_parallel_size=3"], {"nproc_per_node": 6}, TINY, "sequence-parallel-heads", "error",
     ["does not divide the model's 8 query heads", "parallel.sequence_parallel_size=2"]),
    (["parallel.sequence_parallel_size=4"], {}, TINY, "sequence-parallel-kv-heads", "note",
     ["2 KV heads", "repeats each 2 times (4 KV heads, 1 per rank)", "parallel.sequence_parallel_size=2"]),
    (["parallel.sequence_parallel_size=2"], {}, VL, "sequence-parallel-vision", "error",
     ["not supported yet", "parallel.sequence_parallel_size=1"]),
    (["parallel.sequence_parallel_size=8"], {"nnodes": 2, "nproc_per_node": 4}, TINY, "sequence-parallel-nodes",
     "warning", ["spans 2 nodes", "parallel.sequence_parallel_size=4"]),
    (["rollout.tensor_parallel_size=2"], {}, None, "tensor-parallel-engine", "error",
     ["with rollout.engine=hf: the hf engine's tensor parallelism is the trainer's", "split over "
      "parallel.tensor_parallel_size ranks", "rollout.tensor_parallel_size=1 (the hf engine then samples from the "
      "trainer's split); or rollout.engine=vllm"]),
    (["rollout.tensor_parallel_size=4", "parallel.tensor_parallel_size=2"], {}, None, "tensor-parallel-engine",
     "error", ["rollout.tensor_parallel_size=4 with rollout.engine=hf", "rollout.tensor_parallel_size=1"]),
    (["rollout.tensor_parallel_size=2", "parallel.tensor_parallel_size=2"], {"rollout_devices": 2}, None,
     "tensor-parallel-engine", "error", ["a reserved rollout rank samples from a whole copy of its own"]),
    (["rollout.tensor_parallel_size=2", "rollout.engine=vllm", "rollout.agent=toy_agents:two_tools"], {}, None,
     "tensor-parallel-agents", "error", ["call their engine in lockstep", "--rollout-devices R",
                                         "rollout.tensor_parallel_size=1"]),
    (["parallel.tensor_parallel_size=2", "rollout.agent=toy_agents:two_tools"], {}, None, "tensor-parallel-agents",
     "error", ["rollout.agent with parallel.tensor_parallel_size=2", "parallel.tensor_parallel_size=1"]),
    (["rollout.tensor_parallel_size=2", "rollout.engine=vllm"], {}, VL, "tensor-parallel-vision", "error",
     ["has not run one anywhere", "rollout.tensor_parallel_size=1"]),
    (["rollout.tensor_parallel_size=3", "rollout.engine=vllm"], {"rollout_devices": 4}, None,
     "tensor-parallel-devices", "error", ["does not divide the 4 reserved rollout devices",
                                          "rollout.tensor_parallel_size=2", "--rollout-devices a multiple of 3"]),
    (["rollout.tensor_parallel_size=8", "rollout.engine=vllm"], {"nnodes": 2, "nproc_per_node": 4}, None,
     "tensor-parallel-node", "error", ["with 4 processes per node: some engine's 8 devices would span two nodes",
                                       "rollout.tensor_parallel_size=4"]),
    (["rollout.tensor_parallel_size=2", "rollout.engine=vllm"], {"nnodes": 2, "nproc_per_node": 3,
                                                                 "rollout_devices": 4}, None,
     "tensor-parallel-node", "error", ["would span two nodes", "rollout.tensor_parallel_size=1"]),
    (["rollout.tensor_parallel_size=4", "rollout.engine=vllm"], {}, {**TINY, "num_attention_heads": 6},
     "tensor-parallel-heads", "error", ["does not divide the model's 6 attention heads", "vLLM gives each worker",
                                        "rollout.tensor_parallel_size=2"]),
])
def test_rule(overrides, layout, model, rule, level, texts):
    p = plan(overrides, model, **layout)
    f = rules(p).get(rule)
    assert f is not None, render(p)
    assert f.level == level
    for text in texts:
        assert text in f.message + " | " + f.fix, (text, f)
    assert f"{level.upper():<7} {rule}:" in render(p)
    json.dumps(p.to_dict())


def flat(p):
    return " ".join(render(p).split())


def test_allowed_settings_have_no_finding():
    """SP dividing ranks and heads, with rollout.env; a vLLM engine over devices of one node dividing them and the
    model's heads, colocated or reserved, on GPUs or CPU processes; the hf engine's TP given as the trainer's; agents
    on reserved rollout devices beside a tensor-parallel trainer."""
    p = plan(["parallel.sequence_parallel_size=2", "rollout.env=calculator", "rollout.engine=vllm",
              "rollout.tensor_parallel_size=4"], TINY)
    assert not {r for r in rules(p) if r.startswith(("sequence-", "tensor-", "sample-"))}, render(p)
    assert "vLLM tensor parallel 4: 2 engines of 4 devices on 8 devices (colocated), 2 per node" in flat(p)
    reserved = plan(["rollout.engine=vllm", "rollout.tensor_parallel_size=2"], TINY, rollout_devices=4)
    assert "2 engines of 2 devices on 4 reserved rollout devices" in flat(reserved)
    for more, layout in ((["rollout.engine=vllm", "rollout.tensor_parallel_size=2"], {"device": "cpu",
                                                                                      "nproc_per_node": 2}),
                         (["parallel.tensor_parallel_size=2", "rollout.tensor_parallel_size=2"], {}),
                         (["parallel.tensor_parallel_size=2", "rollout.agent=toy_agents:two_tools"],
                          {"rollout_devices": 2})):
        found = {r for r in rules(plan(more, TINY, **layout)) if r.startswith("tensor-")}
        assert not found, (more, found)


def test_a_sample_that_does_not_fit_names_the_smallest_sp_and_fit_applies_it():
    """Qwen2.5-7B (28 query heads: SP 1, 2, 4 on 8 ranks), 33,792-token samples on 8 x 80 GiB: SP=2 leaves too
    much, SP=4 fits (est.); --fit applies it with the per-rank cap of one sample's slice."""
    p = plan(base=LONG, model_config=QWEN7B)
    f = rules(p)["sample-too-long"]
    assert "the smallest parallel.sequence_parallel_size that fits is 4" in f.message
    assert f.fix == "parallel.sequence_parallel_size=4 train.token_cap_per_micro_batch=8448"
    assert "parallel.sequence_parallel_size=4 train.token_cap_per_micro_batch=8448" in rules(p)["memory-over"].fix
    two = plan(["parallel.sequence_parallel_size=2", "train.token_cap_per_micro_batch=16896"], QWEN7B, LONG)
    assert two.memory.fits is False
    new, changes = fit(p)
    assert new.parallel.sequence_parallel_size == 4 and new.train.token_cap_per_micro_batch == 8448
    assert not new.model.gradient_checkpointing  # SP is preferred: no recomputation
    after = make_plan(new, p.layout, model_config=QWEN7B)
    assert after.memory.fits and "sample-too-long" not in rules(after) and after.dp_size == 2
    # nothing else (no data.path here): the fitted copy keeps which fields were given (no lora-off)
    assert [f.rule for f in after.findings] == ["data-path"], render(after)


def test_sample_too_long_falls_back_to_checkpointing_then_says_none_fits():
    p = plan(base=LONG, model_config=QWEN7B, device_memory_gib=40)
    f = rules(p)["sample-too-long"]
    assert "with model.gradient_checkpointing=true is" in f.message and "model.gradient_checkpointing=true" in f.fix
    tiny = plan(base=LONG, model_config=QWEN7B, device_memory_gib=16)
    assert "does not fit either" in rules(tiny)["sample-too-long"].message
    short = plan(base=SHORT, model_config=QWEN7B, device_memory_gib=16)
    assert "sample-too-long" not in rules(short)  # several samples per micro-batch: the token cap first


def test_fit_mends_sizes_the_layout_refuses():
    p = plan(["parallel.sequence_parallel_size=3", "rollout.tensor_parallel_size=3", "rollout.engine=vllm"], TINY)
    new, _ = fit(p)
    assert new.parallel.sequence_parallel_size == 2 and new.rollout.tensor_parallel_size == 2
    assert make_plan(new, p.layout, model_config=TINY).runnable
    hf = plan(["rollout.tensor_parallel_size=2", "parallel.sequence_parallel_size=2"], VL)
    new, _ = fit(hf)
    assert new.rollout.tensor_parallel_size == 1 and new.parallel.sequence_parallel_size == 1


def test_a_tight_long_sample_names_the_sp_that_leaves_room():
    """130 K tokens with checkpointing fit 80 GiB at SP=1 but above 90%: the note names SP=2."""
    p = plan(["model.gradient_checkpointing=true", "rollout.max_new_tokens=129024",
              "train.token_cap_per_micro_batch=131072"], QWEN7B, LONG)
    f = rules(p)["sample-too-long"]
    assert p.runnable and "over 90% of 80.0 GiB" in f.message and "that leaves room is 2" in f.message


def test_sp_groups_move_at_their_slowest_rank():
    """An SP group's weight is its weakest rank's (as the trainer's schedule takes it): ranks weighted 1,3 | 1,1 |
    2,2 | 2,2 give groups 1, 1, 2, 2."""
    p = plan(["parallel.sequence_parallel_size=2"], TINY, capacity_weights=[1, 3, 1, 1, 2, 2, 2, 2])
    s = [r.samples for r in p.ranks]
    assert len(s) == 4 and s[0] == s[1] < s[2] == s[3] and sum(s) == 32, s


def test_attention_the_packed_path_does_not_implement_is_refused():
    """Logit softcapping: the packed attention of SP > 1, of checkpointing and of a mixture of experts (always packed)
    refuses it at the first forward, so the plan does first. Sliding windows it implements (Mistral whenever set,
    Qwen2 with use_sliding_window; tests/test_moe.py compares them with the model's own forward): no finding."""
    soft = {**TINY, "attn_logit_softcapping": 50.0}
    f = rules(plan(["parallel.sequence_parallel_size=2"], soft))["packed-attention"]
    assert f.level == "error" and "attn_logit_softcapping=50.0" in f.message and "sequence parallelism" in f.message
    assert "activation checkpointing" in rules(plan(["model.gradient_checkpointing=true"], soft))[
        "packed-attention"].message
    assert "a mixture of experts" in rules(plan([], {**soft, "num_experts": 8, "num_experts_per_tok": 2}))[
        "packed-attention"].message
    assert "packed-attention" not in rules(plan([], soft))
    mistral = {**TINY, "model_type": "mistral", "sliding_window": 4096}
    qwen = {**TINY, "model_type": "qwen2", "sliding_window": 4096, "max_window_layers": 1, "use_sliding_window": True}
    for windowed in (mistral, qwen):
        assert "packed-attention" not in rules(plan(["parallel.sequence_parallel_size=2"], windowed))
    assert "packed-attention" not in rules(plan(["parallel.sequence_parallel_size=2"], QWEN7B))
