"""The planner: one table-driven test per rule, the plan's numbers, --fit, the JSON schema and the CLI
(exit codes 0/1/2, one-line errors, no torch import). Subprocess calls are batched: each costs ~0.3 s."""

import ast
import graphlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from evenrl.cli import main as cli_main
from evenrl.config import RunConfig, flatten, load_config
from evenrl.errors import UsageError
from evenrl.planner.fit import fit, minimal_yaml
from evenrl.planner.layout import Layout, detect_local, make_layout
from evenrl.planner.plan import make_plan, render

QWEN7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
          "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
          "max_position_embeddings": 32768}
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 128}
MOE = {**TINY, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "plan_512x8.yaml")
BASE = ["data.prompts_per_step=8", "rollout.samples_per_prompt=4", "data.max_prompt_tokens=64",
        "rollout.max_new_tokens=64", "train.token_cap_per_micro_batch=1024"]


def make(overrides=(), model_config=None, **layout):
    layout = {"nproc_per_node": 4, "device": "cuda", "device_memory_gib": 80, **layout}
    return make_plan(load_config(None, BASE + list(overrides)), make_layout(**layout), model_config=model_config)


def rules(p):
    return {f.rule: f for f in p.findings}


CASES = [
    # (rule, level, overrides, layout, model config, text that must appear in message or fix)
    ("idle-ranks", "warning", ["data.prompts_per_step=2", "rollout.samples_per_prompt=1"], {}, None,
     ["2 prompts × 1 sample on 4 training ranks leaves 2 ranks idle", "data.prompts_per_step=4",
      "rollout.samples_per_prompt>=2"]),
    ("idle-ranks", "warning", ["data.prompts_per_step=4", "rollout.samples_per_prompt=2",
                               "algo.minibatches_per_step=2"], {"nproc_per_node": 8}, None,
     ["in 2 mini-batches", "leaves", "data.prompts_per_step=8"]),
    ("single-sample-group", "error", ["rollout.samples_per_prompt=1"], {}, None,
     ["samples_per_prompt=1", "rollout.samples_per_prompt>=2"]),
    ("single-sample-group", "error", ["rollout.samples_per_prompt=1", "algo.advantage=rloo"], {}, None, ["rloo"]),
    ("greedy-group", "error", ["rollout.temperature=0"], {}, None, ["rollout.temperature=1.0"]),
    ("small-group", "note", ["rollout.samples_per_prompt=2"], {}, None, ["+-0.71", "algo.std_scale=batch"]),
    ("empty-minibatches", "error", ["data.prompts_per_step=1", "rollout.samples_per_prompt=2",
                                    "algo.minibatches_per_step=4"], {}, None,
     ["minibatches_per_step=4", "algo.minibatches_per_step="]),
    ("empty-minibatches", "error", ["data.prompts_per_step=2", "algo.minibatches_per_step=4"], {}, None,
     ["prompt groups", "make only 2", "algo.minibatches_per_step=2"]),
    ("uneven-minibatches", "note", ["data.prompts_per_step=3", "rollout.samples_per_prompt=8",
                                    "algo.minibatches_per_step=2"], {}, None, ["8..16", "data.prompts_per_step=4"]),
    ("min-rows", "error", ["data.prompts_per_step=4", "rollout.samples_per_prompt=2", "algo.minibatches_per_step=4",
                           "train.min_rows_per_micro_batch=3"], {}, None, ["min_rows=3", "BatchNorm"]),
    ("min-rows-token-cap", "warning", ["train.min_rows_per_micro_batch=2", "train.token_cap_per_micro_batch=200"],
     {}, None, ["256 tokens", "train.token_cap_per_micro_batch=256"]),
    ("token-cap-oversize", "warning", ["train.token_cap_per_micro_batch=100"], {}, None,
     ["128", "run alone", "train.token_cap_per_micro_batch=128", "rollout.max_new_tokens=36"]),
    ("no-training-ranks", "error", [], {"rollout_devices": 4}, None, ["no rank is left", "--rollout-devices 3"]),
    ("capacity-weights", "error", [], {"capacity_weights": [1, 2]}, None, ["2 weights for 4", "1,1,1,1"]),
    ("imbalance", "note", ["data.prompts_per_step=5", "rollout.samples_per_prompt=2"], {}, None,
     ["20% more", "data.prompts_per_step=6"]),
    ("data-path", "warning", [], {}, None, ["data.path is empty"]),
    ("data-path", "error", ["data.path=/no/such/file.jsonl"], {}, None, ["does not exist"]),
    ("model-path", "error", ["model.path=/no/such/model"], {}, None, ["not a local directory"]),
    ("memory-over", "error", ["model.dtype=bfloat16", "train.token_cap_per_micro_batch=16384"], {}, QWEN7B,
     ["> 80.0 GiB", "best first", "GiB (fits)"]),
    ("memory-tight", "warning", ["model.dtype=bfloat16", "parallel.sharding=fsdp", "parallel.cpu_offload=full"],
     {"device_memory_gib": 18}, QWEN7B, ["> 90%"]),
    ("memory-unknown", "note", [], {"device_memory_gib": 0}, TINY, ["device memory unknown", "--device-memory-gib"]),
    ("memory-skipped", "note", [], {}, None, ["model.path is empty"]),
    ("router-replay-engine", "error", ["rollout.router_replay=engine", "rollout.engine=vllm"], {"device": "cpu"}, MOE,
     ["vLLM's CPU build records none", "Model Runner V2", "rollout.engine=hf"]),
    ("router-replay-vllm", "note", ["rollout.router_replay=engine", "rollout.engine=vllm"], {}, MOE,
     ["enable_return_routed_experts", "no GPU run has shown it", "rollout.router_replay=trainer"]),
    ("router-replay-dense", "error", ["rollout.router_replay=trainer"], {}, QWEN7B, ["not a mixture of experts"]),
    ("router-aux-dense", "error", ["algo.router_aux_loss_coef=0.01"], {}, QWEN7B, ["algo.router_aux_loss_coef=0"]),
    ("router-aux-free", "error", ["algo.router_aux_loss_coef=0.01"], {},
     {**MOE, "model_type": "deepseek_v3", "n_group": 1}, ["aux-loss-free", "correction biases"]),
    ("router-unknown", "error", ["rollout.router_replay=trainer"], {}, {**MOE, "model_type": "jamba"},
     ["does not record or replay", "qwen3_moe"]),
    ("router-replay-off", "note", [], {}, MOE, ["8 experts, top 2", "rollout.router_replay=engine"]),
    ("expert-parallel", "error", ["parallel.expert_parallel_size=3"], {}, MOE,
     ["must divide the 4 training ranks", "parallel.expert_parallel_size=2; parallel.expert_parallel_size=4"]),
    ("expert-parallel", "error", ["parallel.expert_parallel_size=4"], {}, {**MOE, "num_experts": 6},
     ["does not divide the model's 6 experts", "parallel.expert_parallel_size=2"]),
    ("expert-parallel", "error", ["parallel.expert_parallel_size=2"], {}, TINY, ["not a mixture of experts"]),
    # EP x TP (Megatron's layout with expert TP 1): counted, not refused; EP divides the data ranks TP leaves
    ("expert-parallel", "note", ["parallel.expert_parallel_size=4", "parallel.tensor_parallel_size=2"], {}, MOE,
     ["each rank holds 2 of the 8 experts", "the only rank holding them", "beside parallel.tensor_parallel_size=2, "
      "the ranks of a tp group route the same tokens and each sends its 1/tp of them"]),
    ("expert-parallel-offload", "error", ["parallel.expert_parallel_size=2", "parallel.sharding=fsdp",
                                          "parallel.cpu_offload=full"], {}, MOE, ["parallel.cpu_offload=none"]),
    ("expert-parallel-nodes", "warning", ["parallel.expert_parallel_size=4"], {"nnodes": 2, "nproc_per_node": 2},
     MOE, ["spans 2 nodes", "parallel.expert_parallel_size=2"]),
    ("expert-parallel", "note", ["parallel.expert_parallel_size=2", "parallel.sharding=fsdp"], {}, MOE,
     ["4 of the 8 experts of each of 2 MoE layers", "sharded by FSDP2 over the 2 ranks holding the same ones",
      "FSDP2 alone would gather", "the hf sampler gathers every expert"]),
    ("max-positions", "warning", ["rollout.max_new_tokens=100"], {}, TINY, ["164", "128",
                                                                             "rollout.max_new_tokens=64"]),
    ("offload-replicated", "error", ["parallel.cpu_offload=full"], {}, None,
     ["no shards", "parallel.sharding=fsdp", "parallel.cpu_offload=none"]),
    ("offload-cpu", "error", ["parallel.sharding=fsdp", "parallel.cpu_offload=full"], {"device": "cpu"}, None,
     ["needs an accelerator", "first forward", "parallel.cpu_offload=none"]),
    ("fsdp-one-rank", "note", ["parallel.sharding=fsdp"], {"nproc_per_node": 1}, None, ["shards nothing"]),
    ("rollout-reserved", "note", [], {"rollout_devices": 1}, None, ["3 training ranks wait", "G/1 + U/3",
                                                                     "--rollout-devices 0"]),
    ("rollout-reserve-unused", "warning", ["rollout.memory_fraction=0.3"], {}, None, ["rollout.memory_fraction=0"]),
    ("warmup-longer-than-run", "warning", ["train.steps=10", "train.warmup_steps=50"], {}, None,
     ["10 optimizer steps", "train.warmup_steps=1"]),
    ("lora-dropout", "warning", ["model.lora.rank=8", "model.lora.dropout=0.05"], {}, None,
     ["dropout=0.05", "differs from one layout", "model.lora.dropout=0"]),
    ("lora-experts", "error", ["model.lora.rank=8", "model.lora.experts=true"], {}, TINY,
     ["model.lora.experts: true, but llama has no routed experts", "model.lora.experts=false"]),
    ("save-merged-without-lora", "warning", ["log.save_merged=true"], {}, None,
     ["model.lora.rank is 0", "log.save_merged=false"]),
    ("bitwise", "note", ["train.reproducibility=bitwise"], {}, None, ["rollout.batch_prompts=1", "weights/hash"]),
    ("bitwise-vllm-cpu", "error", ["train.reproducibility=bitwise", "rollout.engine=vllm"], {"device": "cpu"}, None,
     ["no batch-invariant mode", "rollout.engine=hf", "train.reproducibility=rounding"]),
    ("bitwise-model-parallel", "error", ["train.reproducibility=bitwise", "parallel.expert_parallel_size=2",
                                         "parallel.sharding=fsdp"], {},
     MOE, ["expert_parallel_size=2 with", "parallel.sharding=fsdp", "parallel.sharding=replicated with"]),
    ("bitwise-engine-parallel", "error", ["train.reproducibility=bitwise", "rollout.engine=vllm",
                                          "rollout.tensor_parallel_size=2"], {}, TINY,
     ["rollout.tensor_parallel_size=2: an engine over several devices", "rollout.tensor_parallel_size=1"]),
    ("bitwise-idle-generation", "warning", ["train.reproducibility=bitwise", "rollout.batch_prompts=4"], {}, None,
     ["8 prompts into 2 generation batches for 4", "rollout.batch_prompts=2"]),
    ("partial-tensor-parallel", "error", ["rollout.partial=true", "parallel.tensor_parallel_size=2"], {}, TINY,
     ["tensor_parallel_size=2", "parallel.tensor_parallel_size=1"]),
    ("partial-tensor-parallel", "error", ["rollout.partial=true", "rollout.engine=vllm",
                                          "rollout.tensor_parallel_size=2"], {}, TINY,
     ["an engine over several devices serves its group's ranks together", "rollout.tensor_parallel_size=1"]),
    ("partial-bitwise", "error", ["rollout.partial=true", "train.reproducibility=bitwise",
                                  "rollout.agent=toy_agents:mixed"], {}, None,
     ["canonical batches", "train.reproducibility=rounding"]),
    ("partial-router-replay", "error", ["rollout.partial=true", "rollout.router_replay=engine"], {}, MOE,
     ["rollout.router_replay=trainer", "rollout.partial=false"]),
    ("partial-rounds", "error", ["rollout.partial=true", "algo.filter_groups=true"], {}, None,
     ["algo.max_generation_rounds=4", "algo.max_generation_rounds=1"]),
    ("partial-no-carry", "warning", ["rollout.partial=true", "rollout.tokens_per_round=64"], {}, None,
     ["change nothing", "rollout.tokens_per_round=16"]),
    ("partial-drops", "warning", ["rollout.partial=true", "rollout.tokens_per_round=10", "rollout.at_max_carry=drop"],
     {}, None, ["reach 40 of max_new_tokens=64", "rollout.tokens_per_round=16", "rollout.max_carry_steps=6",
                "rollout.at_max_carry=wait"]),
    ("partial-waits", "warning", ["rollout.partial=true", "rollout.tokens_per_round=10",
                                  "rollout.response_lengths.median=30"], {}, None, ["reach 40", "decodes ~",
                                                                                   "rollout.max_carry_steps=6"]),
    ("partial-estimate", "note", ["rollout.partial=true"], {}, TINY,
     ["lognormal(median 16, sigma 1) cut at 64, assumed", "in flight", "host memory", "generation est."]),
]


@pytest.mark.parametrize("rule, level, overrides, layout, model_config, texts", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule(rule, level, overrides, layout, model_config, texts):
    p = make(overrides, model_config, **layout)
    found = rules(p)
    assert rule in found, render(p)
    f = found[rule]
    assert f.level == level
    for text in texts:
        assert text in f.message + " | " + f.fix, (text, f)
    assert p.runnable == (not any(x.level == "error" for x in p.findings))
    assert f"{level.upper():<7} {rule}:" in render(p)  # every plan renders, and shows its findings
    json.dumps(p.to_dict())


def test_non_positive_capacity_weights():
    """The config refuses them when it is loaded (one line naming the field); a Layout built in code that
    carries them still gets the capacity-weights error rather than a crash."""
    with pytest.raises(UsageError, match=r"^config: parallel\.capacity_weights: got \[1, 1, -1, 1\]; item 2 is -1; "):
        load_config(None, BASE + ["parallel.capacity_weights=[1,1,-1,1]"])
    with pytest.raises(UsageError, match=r"parallel.capacity_weights: got \[1, inf\]; item 1 is inf"):
        load_config(None, ["parallel.capacity_weights=[1,.inf]"])
    lay = Layout(1, 4, "cuda", 80.0, (1.0, 1.0, -1.0, 1.0))
    f = rules(make_plan(load_config(None, BASE), lay))["capacity-weights"]
    assert f.level == "error" and "<= 0" in f.message


def test_every_rule_is_reported_at_once():
    p = make(["data.prompts_per_step=2", "rollout.samples_per_prompt=1", "train.token_cap_per_micro_batch=100",
              "parallel.cpu_offload=full"], capacity_weights=[1, 1])
    assert {"idle-ranks", "single-sample-group", "token-cap-oversize", "offload-replicated", "capacity-weights",
            "data-path"} <= set(rules(p))
    levels = [f.level for f in p.findings]
    assert levels == sorted(levels, key=["error", "warning", "note"].index)  # errors first


def test_clean_config_is_runnable(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": str(i), "answer": "1"}) + "\n" for i in range(80)) + "\n")
    p = make([f"data.path={data}", "train.steps=30"])
    assert p.findings == [] or all(f.level == "note" for f in p.findings), render(p)
    assert p.runnable and p.dataset_rows == 80 and p.steps_per_epoch == 10
    assert "dataset 80 rows = 10.0 RL steps" in render(p)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    assert rules(make([f"data.path={empty}"]))["data-path"].level == "error"
    assert rules(make([f"data.path={data}", "data.prompts_per_step=100"]))["prompts-exceed-dataset"]
    missing_eval = rules(make([f"data.path={data}", "eval.path=/no/such/eval.jsonl"]))["eval-path"]
    assert missing_eval.level == "error" and "/no/such/eval.jsonl" in missing_eval.message
    assert "eval-path" not in rules(make([f"data.path={data}", f"eval.path={data}"]))


def test_model_dir_without_config_json(tmp_path):
    f = rules(make([f"model.path={tmp_path}"]))["model-path"]
    assert f.level == "error" and "no config.json" in f.message
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert "model-path" not in rules(make([f"model.path={tmp_path}"]))


def test_model_and_data_files_are_checked_as_the_trainer_checks_them(tmp_path):
    """What evenrl train would refuse in the model directory or the dataset is an error finding (tests/
    test_bad_input.py runs every such case through both commands)."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    found = rules(make([f"model.path={model}"]))
    assert found["model-tokenizer"].level == found["model-weights"].level == "error" and "model-config" not in found
    assert "no tokenizer files" in found["model-tokenizer"].message and "no weights" in found["model-weights"].message
    (model / "config.json").write_text(json.dumps({**TINY, "model_type": "t5"}))
    assert "'t5' is not a causal LM" in rules(make([f"model.path={model}"]))["model-config"].message
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    f = rules(make([f"data.path={data}"]))["data-file"]
    assert f.level == "error" and f"{data} line 2: no field 'prompt'" in f.message and "data.prompt_field" in f.fix
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    e = rules(make([f"data.path={good}", f"eval.path={data}"]))["eval-file"]
    assert e.level == "error" and "line 2" in e.message and "eval.path=''" in e.fix


def test_qwen3_vl_moe_from_its_config_json_alone(tmp_path):
    """A Qwen3-VL-30B-A3B config.json (EasyR1's Qwen3-VL example), no weights or tokenizer yet: the family is
    planned (tests/test_qwen3_vl.py trains it); without its preprocessor_config.json the plan names that file in one
    line, and the trainer reads config.json through the same check before loading anything."""
    from evenrl.errors import UsageError
    from evenrl.models.files import read_model_config

    fixture = Path(__file__).parent / "fixtures" / "qwen3-vl-30b-a3b"
    (tmp_path / "config.json").write_text((fixture / "config.json").read_text())
    f = rules(make([f"model.path={tmp_path}", "model.dtype=bfloat16"], nproc_per_node=8))["model-config"]
    assert f.level == "error" and "\n" not in f.message and "no preprocessor_config.json" in f.message
    with pytest.raises(UsageError, match="a qwen3_vl_moe model needs its image processor"):
        read_model_config(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text((fixture / "preprocessor_config.json").read_text())
    assert "model-config" not in rules(make([f"model.path={tmp_path}", "model.dtype=bfloat16"], nproc_per_node=8))
    assert read_model_config(str(tmp_path))["model_type"] == "qwen3_vl_moe"


def test_numbers_512x8_on_64_ranks():
    cfg = load_config(EXAMPLE)
    lay = make_layout(8, 8, device="cuda", device_memory_gib=80)
    t0 = time.perf_counter()
    p = make_plan(cfg, lay)
    dt = time.perf_counter() - t0
    print(f"\nplan 512 prompts x 8 samples on 64 ranks: {dt * 1000:.1f} ms")
    assert p.simulated and p.minibatch_sizes == [1024] * 4
    assert {r.samples for r in p.ranks} == {64} and p.idle == []
    assert p.optimizer_steps_per_step == 4 and p.to_dict()["optimizer_steps"]["total"] == 4 * cfg.train.steps
    assert len({r.micro_steps for r in p.ranks}) == 1  # every rank runs the same number of micro-steps
    assert dt < 1.0


def test_uneven_and_weighted_split():
    p = make(["data.prompts_per_step=5", "rollout.samples_per_prompt=2"], nproc_per_node=3)
    assert sorted(r.samples for r in p.ranks) == [3, 3, 4] and sum(r.samples for r in p.ranks) == 10
    w = make(["data.prompts_per_step=6", "rollout.samples_per_prompt=2"], capacity_weights=[1, 1, 2, 2])
    assert [r.samples for r in w.ranks] == [2, 2, 4, 4]


def test_huge_step_is_computed_not_simulated():
    p = make(["data.prompts_per_step=100000", "rollout.samples_per_prompt=8", "algo.minibatches_per_step=3"],
             nnodes=4, nproc_per_node=8)
    assert not p.simulated and sum(r.samples for r in p.ranks) == 800_000 and len(p.minibatch_sizes) == 3
    assert "computed" in render(p)


FIT_CASES = [
    ["data.prompts_per_step=2", "rollout.samples_per_prompt=1"],
    ["rollout.temperature=0", "algo.minibatches_per_step=64"],
    ["data.prompts_per_step=4", "rollout.samples_per_prompt=2", "train.min_rows_per_micro_batch=2"],
    ["train.token_cap_per_micro_batch=100", "parallel.cpu_offload=full", "rollout.memory_fraction=0.5"],
    ["model.dtype=bfloat16", "train.token_cap_per_micro_batch=16384", "algo.kl_coef=0.01"],
    ["parallel.capacity_weights=[1,2]"],
]


@pytest.mark.parametrize("overrides", FIT_CASES)
def test_fit_mends_what_the_layout_refuses_and_keeps_the_experiment(overrides):
    """--fit changes only FIT_KEYS (the layout, what each rank holds at once): every other field is as the user
    wrote it; it adds no error, leaves no memory or token-cap error, and an error only the experiment could mend
    (one sample per prompt under GRPO, greedy sampling, more mini-batches than samples) stays with its own fix."""
    from evenrl.planner.fit import keeps_the_experiment

    p = make(overrides, QWEN7B)
    before = p.config.model_dump()
    new, changes = fit(p)
    assert p.config.model_dump() == before  # the original config is never changed
    assert all(keeps_the_experiment(k) and a != b for k, a, b in changes), changes
    kept = {k: v for k, v in flatten(new.model_dump(mode="json")).items() if not keeps_the_experiment(k)}
    assert kept == {k: v for k, v in flatten(p.config.model_dump(mode="json")).items() if not keeps_the_experiment(k)}
    q = make_plan(new, p.layout, model_config=QWEN7B)
    errors = lambda plan: {f.rule for f in plan.findings if f.level == "error"}  # noqa: E731
    assert errors(q) <= errors(p) and not {"token-cap-oversize", "memory-over"} & set(rules(q)), render(q)
    assert errors(q) <= {"single-sample-group", "empty-minibatches", "greedy-group"}, errors(q)
    assert load_config_text(minimal_yaml(new)) == new  # the printed YAML is the fitted config


def test_fit_only_proposes_offload_that_runs():
    """Offload needs fsdp and an accelerator: on a CPU layout --fit turns it off and never proposes it; on GPUs
    it adds fsdp (even on one rank) rather than dropping the offload."""
    big = ["model.dtype=bfloat16", "train.token_cap_per_micro_batch=16384"]
    cpu = make(big + ["parallel.sharding=fsdp", "parallel.cpu_offload=full"], QWEN7B, device="cpu",
               device_memory_gib=64)
    assert "offload-cpu" in rules(cpu) and not cpu.runnable
    new, changes = fit(cpu)
    assert new.parallel.cpu_offload == "none" and ("parallel.cpu_offload", "full", "none") in changes
    assert not {"offload-cpu", "offload-replicated"} & set(rules(make_plan(new, cpu.layout, model_config=QWEN7B)))
    assert not any("parallel.cpu_offload" in f.settings for f in cpu.memory_fixes)
    for n in (1, 4):
        gpu = make(big + ["parallel.cpu_offload=full"], QWEN7B, nproc_per_node=n)
        new, _ = fit(gpu)
        assert (new.parallel.sharding, new.parallel.cpu_offload) == ("fsdp", "full")
        assert make_plan(new, gpu.layout, model_config=QWEN7B).runnable


def test_fsdp_and_offload_plans_name_no_refusal():
    """The trainer runs fsdp and offload: a GPU plan with both has no error and says nothing of it being
    unsupported."""
    p = make(["parallel.sharding=fsdp", "parallel.cpu_offload=full", "model.dtype=bfloat16"], QWEN7B)
    text = render(p).lower()
    assert p.runnable and p.memory.host_gib > 0, render(p)
    assert not any(w in text for w in ("planned", "not supported", "refuse", "not yet"))


def load_config_text(text):
    return RunConfig.model_validate(yaml.safe_load(text))


def test_json_schema():
    d = make(["data.prompts_per_step=2"], TINY).to_dict()
    assert d["schema"] == "evenrl.plan/1" and isinstance(d["runnable"], bool)
    assert set(d) == {"schema", "runnable", "counts", "layout", "step", "ranks", "optimizer_steps", "memory",
                      "overlap", "findings"}
    assert d["overlap"] is None  # no rollout device reserved (tests/test_plan_overlap.py has the section)
    assert set(d["counts"]) == {"error", "warning", "note"}
    assert {"world", "training_ranks", "device", "device_memory_gib"} <= set(d["layout"])
    assert {"prompts_per_step", "samples_per_prompt", "samples_per_step", "minibatch_sizes", "sample_tokens",
            "token_cap", "min_rows", "simulated"} <= set(d["step"])
    assert set(d["ranks"]["per_rank"][0]) == {"rank", "samples", "tokens", "micro_steps", "idle_minibatches"}
    assert {"min", "mean", "max"} == set(d["ranks"]["samples"])
    assert set(d["optimizer_steps"]) == {"per_step", "total", "dataset_rows", "steps_per_epoch", "per_epoch"}
    assert {"breakdown_gib", "phases_gib", "total_gib", "capacity_gib", "fits", "fixes",
            "assumptions"} <= set(d["memory"])
    assert set(d["memory"]["phases_gib"]) == {"rollout", "log-probs", "update"}
    assert d["memory"]["total_gib"] == max(d["memory"]["phases_gib"].values())
    assert all(set(f) == {"level", "rule", "message", "fix"} for f in d["findings"])
    json.dumps(d)


# ------------------------------------------------------------------------------------------ CLI

BAD_INPUTS = [
    (["plan"], "the following arguments are required"),
    (["plan", EXAMPLE, "--nnodes", "0"], "--nnodes"),
    (["plan", EXAMPLE, "--nproc-per-node", "two"], "--nproc-per-node"),
    (["plan", EXAMPLE, "--capacity-weights", "1,x"], "--capacity-weights"),
    (["plan", EXAMPLE, "--device", "tpu"], "--device"),
    (["plan", EXAMPLE, "--bogus"], "unrecognized arguments"),
    (["plan", EXAMPLE, "data.prompts_per_step=1000000000000"], "less than or equal"),
    (["plan", EXAMPLE, "data.prompts_per_step=-4"], "greater than or equal to 1"),
    (["plan", EXAMPLE, "rollout.samples_per_prompt=lots"], "valid integer"),
    (["plan", EXAMPLE, "data.nope=1"], "unknown key"),
    (["plan", EXAMPLE, "data.prompts_per_step"], "expected key=value"),
    (["plan", EXAMPLE, "=3"], "empty key segment"),
    (["plan", str(ROOT / "examples")], "is a directory"),
    (["plan", "no/such.yaml"], "no such file"),
    (["plan", EXAMPLE, "--nnodes", "1000", "--nproc-per-node", "1000"], "ranks"),
]


@pytest.mark.parametrize("argv, text", BAD_INPUTS)
def test_bad_input_is_one_line_exit_2(argv, text, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err and "Traceback" not in err


@pytest.mark.parametrize("content, text", [("", "file is empty"), ("- a\n- b\n", "top level is a list"),
                                           ("data: [\n", "invalid YAML"), ("data:\n  prompts_per_step: [1]\n",
                                                                          "valid integer")])
def test_bad_files(tmp_path, capsys, content, text):
    f = tmp_path / "c.yaml"
    f.write_text(content)
    assert cli_main(["plan", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err


def test_cli_exit_codes_json_and_fit(capsys):
    assert cli_main(["plan", EXAMPLE, "--nproc-per-node", "4", "--device", "cuda", "--device-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "layout     1 node x 4 cuda" in out and "findings" in out
    args = ["plan", EXAMPLE, "rollout.samples_per_prompt=1", "--nproc-per-node", "4"]
    assert cli_main(args) == 1
    assert "ERROR   single-sample-group" in capsys.readouterr().out
    assert cli_main(args + ["--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["runnable"] is False and d["counts"]["error"] >= 1
    assert cli_main(args + ["--fit", "--json"]) == 1  # samples per prompt are the experiment's: --fit keeps them
    d = json.loads(capsys.readouterr().out)
    assert not d["fit"]["plan"]["runnable"] and d["fit"]["changes"] == []
    assert cli_main(args + ["--fit"]) == 1
    out = capsys.readouterr().out
    assert "--fit: no change that keeps the experiment mends this plan" in out and "plan of the fitted config" in out
    assert "rollout.samples_per_prompt>=2" in out
    big = ["plan", EXAMPLE, "data.prompts_per_step=16", "model.path=" + str(ROOT / "tests" / "fixtures" / "qwen2.5-7b"),
           "--nproc-per-node", "4", "--device", "cuda", "--device-memory-gib", "40", "--fit"]
    assert cli_main(big) == 0
    assert "--fit: model.gradient_checkpointing False -> True" in capsys.readouterr().out


def test_shape_flags_on_a_cpu_machine(capsys, monkeypatch):
    """`--nproc-per-node 4` alone plans this machine's device kind and memory, not 'cuda, memory unknown'."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no visible GPU, whatever the machine has
    demo = [str(ROOT / "examples" / "demo.yaml"), "data.path=''", "model.path=''"]  # the demo's files may not exist yet
    assert cli_main(["plan", *demo, "--nproc-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "layout     1 node x 4 cpu, " in out and "memory unknown" not in out and "no GPU on this machine" in out
    assert cli_main(["plan", *demo, "--nproc-per-node", "4", "--json"]) == 0
    lay = json.loads(capsys.readouterr().out)["layout"]
    host = detect_local({"CUDA_VISIBLE_DEVICES": ""})
    assert lay["device"] == "cpu" and lay["device_memory_gib"] == pytest.approx(host.device_memory_gib / 4)


@pytest.mark.parametrize("overrides, layout, texts", [
    (["data.prompts_per_step=1", "rollout.samples_per_prompt=2"], {"nproc_per_node": 1, "device_memory_gib": 1},
     ["= 1 training rank  [", "1 prompt × 2 samples = 2 samples; 1 mini-batch of 2; 1 epoch over", "\n           0 ",
      "1 step per RL step"]),
    ([], {"rollout_devices": 1}, ["4 ranks: 3 training, 1 reserved for rollout", "wait while 1 rollout device generates",
                                  "(then 4 ranks train and generate)"]),
    (["parallel.capacity_weights=[1]"], {}, ["has 1 weight for 4 training ranks"]),
    (["algo.minibatches_per_step=9"], {}, ["1 mini-batch would be empty"]),
], ids=["one-rank", "rollout-device", "one-weight", "one-empty-minibatch"])
def test_render_singular_and_plural(overrides, layout, texts):
    p = make(overrides, TINY, **layout)
    text = "\n".join([render(p)] + [f"{f.message} | {f.fix}" for f in p.findings])  # unwrapped findings too
    for t in texts:
        assert t in text, (t, text)
    for wrong in (" 1 ranks", " 1 samples", " 1 prompts", " 1 mini-batches", " 1 epochs", " 1 steps", " 1 weights",
                  " 1 devices", "(s)", "0.00 B params"):
        assert wrong not in text, (wrong, text)
    assert "86.8 K params" in text


def test_render_groups_ranks_and_stays_compact():
    many = render(make_plan(load_config(EXAMPLE), make_layout(8, 8, device="cuda", device_memory_gib=80),
                            model_config=QWEN7B))
    assert "\n           0-63         64        98,304\n" in many and "7.62 B params" in many
    head = many[:many.index("\nfindings")].splitlines()  # everything above the findings
    assert len(head) <= 16 and max(map(len, many.splitlines())) <= 120, many
    six = render(make_plan(load_config(EXAMPLE), make_layout(1, 6, device="cuda", device_memory_gib=80)))
    assert "0-3         684     1,050,624" in six and "4-5         680     1,044,480" in six
    assert "72 micro-steps on every rank (18 per mini-batch)" in six
    weights = [1, 2] + [1] * 30 + [3, 1] * 16
    odd = render(make_plan(load_config(EXAMPLE), make_layout(1, 64, capacity_weights=weights)))
    assert "kinds of rank (--json lists each)" in odd and "samples " in odd  # too many kinds of rank: min/mean/max


def test_subprocess_no_torch_no_traceback(tmp_path):
    """The real entry points in fresh interpreters: exit codes, one-line stderr, and torch never imported by any
    planner module (walked with pkgutil, so a new module is covered without editing this test) nor by a run."""
    trl = tmp_path / "grpo.yaml"
    trl.write_text(yaml.safe_dump({"num_processes": 2, "per_device_train_batch_size": 4, "num_generations": 4}))
    code = (
        "import importlib, pkgutil, sys\n"
        "import evenrl.planner\n"
        "names = ['evenrl.config', 'evenrl.data.readers', 'evenrl.core.schedule', 'evenrl.core.partition']\n"
        "names += [m.name for m in pkgutil.walk_packages(evenrl.planner.__path__, 'evenrl.planner.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "from evenrl.cli import main\n"
        "codes = [main(['plan', '" + EXAMPLE + "', '--nnodes', '8', '--nproc-per-node', '8', '--json']),\n"
        "         main(['plan', '" + EXAMPLE + "', 'rollout.samples_per_prompt=1', '--fit']),\n"
        "         main(['plan', '--from', 'trl', '" + str(trl) + "', '--fit'])]\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('MODULES', sorted(names))\n"
        "print('CODES', codes)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "CODES [0, 1, 0]" in r.stdout  # the second: --fit keeps its one sample per prompt (the experiment's)
    for name in ("plan", "fit", "cli", "rules", "render", "memory", "layout", "peers", "peers.reader", "peers.verl",
                 "peers.easyr1", "peers.trl", "peers.openrlhf"):
        assert f"'evenrl.planner.{name}'" in r.stdout, name  # the walk found them all
    bad = subprocess.run([sys.executable, "-m", "evenrl.cli", "plan", EXAMPLE,
                          "data.prompts_per_step=1000000000000"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    err = subprocess.run([sys.executable, "-m", "evenrl.cli", "plan", EXAMPLE,
                          "rollout.samples_per_prompt=1"], capture_output=True, text=True, timeout=60)
    assert err.returncode == 1 and "single-sample-group" in err.stdout


def planner_imports() -> dict[str, set[str]]:
    """module -> the evenrl.planner modules it imports, read from the source with ast. Imports inside functions
    count (a lazy import is still a dependency); those under `if TYPE_CHECKING:` do not (annotations only, never
    run). `from a import b` names a.b when that is a module, else a; a package is not counted as imported by
    its own submodules (Python imports parents first, whichever way the modules depend)."""
    src = ROOT / "src"
    files = {".".join(f.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): f
             for f in (src / "evenrl" / "planner").rglob("*.py")}
    graph = {}
    for name, f in files.items():
        tree = ast.parse(f.read_text(), str(f))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def test_planner_has_no_import_cycles():
    graph = planner_imports()
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle in evenrl.planner: {' -> '.join(e.args[1])}")
    assert {"evenrl.planner.plan", "evenrl.planner.fit", "evenrl.planner.peers"} <= graph["evenrl.planner.cli"]

    def below(name):  # everything `name` imports, directly or not
        seen, todo = set(), [name]
        while todo:
            for d in graph[todo.pop()] - seen:
                seen.add(d)
                todo.append(d)
        return seen

    top = {"evenrl.planner.cli", "evenrl.planner.fit"} | {m for m in graph if m.startswith("evenrl.planner.peers")}
    assert not below("evenrl.planner.plan") & top  # the plan knows nothing of its callers
    assert not below("evenrl.planner.fit") & top
    assert not any(m.startswith("evenrl.planner.peers") and "evenrl.planner.cli" in below(m) for m in graph)



@pytest.mark.parametrize("name, ok", [("exact_match", True), ("math", True), ("toy_rewards:digit_fraction", True),
                                      ("no_such_package_xyz:fn", False), ("digits", False)])
def test_reward_names_are_checked_as_the_trainer_resolves_them(name, ok):
    cfg = RunConfig.model_validate({"rewards": {"functions": [{"name": name}]}})
    found = [f for f in make_plan(cfg, make_layout(1, 1)).findings if f.rule == "reward-name"]
    assert not found if ok else (len(found) == 1 and found[0].level == "error" and name in found[0].message)


def test_a_bad_data_path_does_not_hide_a_bad_eval_path(tmp_path):
    cfg = RunConfig.model_validate({"data": {"path": str(tmp_path / "missing.jsonl")},
                                    "eval": {"path": str(tmp_path / "also-missing.jsonl")}})
    found = {f.rule for f in make_plan(cfg, make_layout(1, 1)).findings if f.level == "error"}
    assert {"data-path", "eval-path"} <= found


def test_fit_stays_inside_the_config_bounds():
    cfg = RunConfig.model_validate({"data": {"max_prompt_tokens": 6_000_000},
                                    "rollout": {"max_new_tokens": 6_000_000}})
    new, _ = fit(make_plan(cfg, make_layout(1, 1)))
    assert new.train.token_cap_per_micro_batch <= 10_000_000


def test_lean_and_static_decoders_need_a_model_they_run(tmp_path):
    """rollout.decoder=lean/static on a model LeanDecoder does not run is the plan's error (evenrl train would stop
    at its first rollout); auto picks the model's own forward there."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY, "architectures": ["MistralForCausalLM"]}))
    f = rules(make([f"model.path={model}", "rollout.decoder=static"]))["rollout-decoder"]
    assert f.level == "error" and "MistralForCausalLM" in f.message and f.fix == "rollout.decoder=auto"
    assert "rollout-decoder" not in rules(make([f"model.path={model}"]))
    assert "rollout-decoder" not in rules(make([f"model.path={model}", "rollout.decoder=static",
                                                "rollout.engine=vllm"]))
    (model / "config.json").write_text(json.dumps({**TINY, "architectures": ["Qwen2ForCausalLM"]}))
    assert "rollout-decoder" not in rules(make([f"model.path={model}", "rollout.decoder=lean"]))
