"""`evenrl plan --from`: each issue case shows the peer's failure with its exact message, and the evenrl
equivalent runs. Messages are the peers' own (see evenrl.planner.peers's docstring for where they were checked)."""

import argparse
import json
import struct

import pytest
import yaml

from evenrl.cli import main as cli_main
from evenrl.config import RunConfig, load_config
from evenrl.errors import UsageError
from evenrl.planner.peers import parse_flags, read_foreign, translate
from evenrl.planner.layout import make_layout
from evenrl.planner.fit import fit, minimal_yaml
from evenrl.planner.plan import make_plan, render

QWEN7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
          "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
          "max_position_embeddings": 32768}


def config_only_model(d, config: dict):
    """A model directory for planning: the real config.json, and stand-ins for the files the planner checks
    (a tokenizer.json with a vocabulary, a complete safetensors file of no tensors) without 15 GB of weights."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}))
    header = b"{}"
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return d


EASYR1 = {"data": {"rollout_batch_size": 512, "max_prompt_length": 2048, "max_response_length": 2048},
          "algorithm": {"adv_estimator": "grpo", "use_kl_loss": True, "kl_coef": 0.01, "kl_penalty": "low_var_kl"},
          "worker": {"actor": {"global_batch_size": 128, "micro_batch_size_per_device_for_update": 4,
                               "micro_batch_size_per_device_for_experience": 16},
                     "rollout": {"n": 5}},
          "trainer": {"n_gpus_per_node": 8, "nnodes": 1}}
LOGIC_RL = {"data": {"train_batch_size": 2, "max_prompt_length": 400, "max_response_length": 4096},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 256, "ppo_micro_batch_size_per_gpu": 8,
                                            "use_kl_loss": True, "kl_loss_coef": 0.001},
                                  "rollout": {"n": 8, "gpu_memory_utilization": 0.6}},
            "algorithm": {"adv_estimator": "grpo"}, "trainer": {"n_gpus_per_node": 4, "nnodes": 1}}
OPEN_R1 = {"model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "bf16": True, "use_vllm": True,
           "vllm_mode": "server", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
           "num_generations": 8, "max_prompt_length": 512, "max_completion_length": 1024, "max_steps": 500}
OPENRLHF = """python3 -m openrlhf.cli.train_ppo_ray \\
  --actor_num_nodes 1 --actor_num_gpus_per_node 4 \\
  --vllm_num_engines 3 --vllm_tensor_parallel_size 1 \\
  --micro_train_batch_size 2 --train_batch_size 30 \\
  --micro_rollout_batch_size 4 --rollout_batch_size 6 --n_samples_per_prompt 4 \\
  --advantage_estimator group_norm --prompt_max_len 1024 --generate_max_len 2048 \\
  --zero_stage 3 --bf16 --gradient_checkpointing --use_kl_loss --init_kl_coef 0.001  # a comment
"""


def ns(**kw):
    base = dict(nnodes=None, nproc_per_node=None, rollout_devices=None, device=None, device_memory_gib=None,
                capacity_weights=None, json=False, fit=False)
    return argparse.Namespace(**{**base, **kw})


def run(tmp_path, framework, content, overrides=(), **layout):
    f = tmp_path / "peer.yaml"
    f.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    data = read_foreign(framework, str(f), list(overrides))
    t, cfg = translate(framework, data, ns(**layout))
    return t, cfg, make_plan(cfg, t.layout)


def messages(t):
    return [c.message for c in t.checks]


def test_easyr1_512_prompts_on_6_gpus(tmp_path):
    t, cfg, plan = run(tmp_path, "easyr1", EASYR1, ["trainer.n_gpus_per_node=6"])
    assert t.layout.training_ranks == 6
    assert messages(t) == ["actor global batch size per device must be divisible by the micro batch size.",
                           "only support equal chunk. Got size of DataProto 512 and chunk 6."]
    assert "640 samples // 6 GPUs = 106 per GPU; 106 % micro_batch_size_per_device_for_update 4 = 2" in t.checks[0].why
    assert [c.stage for c in t.checks] == ["worker", "rollout"]
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.algo.minibatches_per_step) == (512, 5, 4)
    assert cfg.algo.kl_coef == 0.01 and cfg.algo.kl_in == "loss" and cfg.algo.kl_estimator == "k3"
    assert plan.runnable and not plan.idle
    assert sorted({r.samples for r in plan.ranks}) == [424, 428] and sum(r.samples for r in plan.ranks) == 2560
    # on 8 GPUs the same config passes EasyR1's checks
    t8, _, _ = run(tmp_path, "easyr1", EASYR1)
    assert t8.checks == []


@pytest.mark.parametrize("overrides, expect", [
    (["data.rollout_batch_size=100"], "Rollout batch size must be divisible by actor global batch size."),
    (["worker.actor.micro_batch_size_per_device_for_experience=7"],
     "Rollout batch size * rollout.n must be divisible by actor micro batch size for experience."),
    (["worker.rollout.n=1"], "GRPO and RLOO algorithm need `config.worker.rollout.n > 1`."),
    (["trainer.n_gpus_per_node=8", "trainer.nnodes=200"],
     "actor global batch size * ulysses size must be larger than num gpus."),
    (["+worker.actor.fsdp.enable_cpu_offload=true"],
     "actor cannot use FSDP's CPU offload when gradient accumulation is enabled."),
])
def test_easyr1_checks(tmp_path, overrides, expect):
    t, _, _ = run(tmp_path, "easyr1", EASYR1, overrides)
    assert expect in messages(t)


def test_logic_rl_verl_2_prompts_on_4_gpus(tmp_path):
    t, cfg, plan = run(tmp_path, "verl", LOGIC_RL, peer_version="logic-rl")
    msgs = messages(t)
    assert "only support equal chunk. Got size of DataProto 2 and chunk 4." in msgs  # Logic-RL issue #13
    assert "train_batch_size (2) must be >= actor.ppo_mini_batch_size (256)" not in msgs  # a check of later verl
    t0, _, _ = run(tmp_path, "verl", LOGIC_RL)  # no key of the older fork: current verl's rules
    assert "train_batch_size (2) must be >= actor.ppo_mini_batch_size (256)" in messages(t0)
    assert not any(m.startswith("only support equal chunk") for m in messages(t0))
    assert not any(m.startswith("real_train_batch_size") for m in msgs)  # 2 x 8 = 16 divides over 4 GPUs
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt) == (2, 8)
    assert plan.runnable and not plan.idle and {r.samples for r in plan.ranks} == {4}
    t1, _, _ = run(tmp_path, "verl", LOGIC_RL, ["actor_rollout_ref.rollout.n=1"])
    assert "real_train_batch_size (2) must be divisible by minimal possible batch size (4)" in messages(t1)
    a = "actor_rollout_ref.actor."
    t2, _, _ = run(tmp_path, "verl", LOGIC_RL, ["data.train_batch_size=8", a + "ppo_mini_batch_size=8",
                                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    assert "normalized ppo_mini_batch_size 16 should be divisible by ppo_micro_batch_size_per_gpu 3" in messages(t2)
    t3, _, _ = run(tmp_path, "verl", LOGIC_RL, ["data.train_batch_size=256", a + "ppo_mini_batch_size=1",
                                               "actor_rollout_ref.rollout.n=1", "trainer.n_gpus_per_node=8"])
    assert "ppo_mini_batch_size 0 should be larger than 0 after normalization" in messages(t3)


def test_logic_rl_oom_follow_up(tmp_path):
    """Raising train_batch_size then runs out of memory: the estimate and the ranked knobs, for a 7B config (with
    gradient checkpointing off: verl 0.8's default is on)."""
    model = config_only_model(tmp_path / "qwen7b", QWEN7B)
    peer = {**LOGIC_RL, "actor_rollout_ref": {**LOGIC_RL["actor_rollout_ref"],
                                              "model": {"path": str(model), "enable_gradient_checkpointing": False}}}
    t, cfg, plan = run(tmp_path, "verl", peer, ["data.train_batch_size=8"], device_memory_gib=80)
    assert cfg.model.path == str(model) and cfg.parallel.sharding == "fsdp"
    over = {f.rule: f for f in plan.findings}["memory-over"]
    assert over.level == "error" and "> 80.0 GiB" in over.message
    assert plan.memory.total_gib > 80 and plan.memory.breakdown["activations"] > plan.memory.breakdown["optimizer"]
    knobs = [k for f in plan.memory_fixes for k in f.settings]
    assert "model.gradient_checkpointing" in knobs and "train.token_cap_per_micro_batch" in knobs
    assert [f.total_gib for f in plan.memory_fixes] == sorted(f.total_gib for f in plan.memory_fixes)
    assert any(f.fits for f in plan.memory_fixes)
    new, changes = fit(plan)
    again = make_plan(new, plan.layout)
    assert again.memory.fits and again.runnable, render(again)


def test_open_r1_trl_4_gpus_one_for_vllm(tmp_path):
    # open-r1 pins TRL 0.18 (vllm_mode=server, no gradient checkpointing by default)
    t, cfg, plan = run(tmp_path, "trl", OPEN_R1, nproc_per_node=4, device_memory_gib=80, peer_version="0.18")
    assert (t.layout.world, t.layout.rollout_devices, t.layout.training_ranks) == (4, 1, 3)
    # TRL >= 0.18 checks the generation batch (the global-batch check of TRL < 0.18 is gone from the versions planned)
    assert messages(t) == ["generation_batch_size (12) must be divisible by num_generations (8)."]
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt) == (2, 8)  # 12 samples = 1.5 prompts -> 2
    assert cfg.train.steps == 500 and cfg.model.gradient_checkpointing is False
    assert cfg.model.tf32 is False  # TRL leaves TF32 off unless asked; evenrl's own default is on (CUDA)
    tf32, tf32_cfg, _ = run(tmp_path, "trl", {**OPEN_R1, "tf32": True}, nproc_per_node=4, peer_version="0.18")
    assert tf32_cfg.model.tf32 is True
    assert plan.runnable and sorted(r.samples for r in plan.ranks) == [5, 5, 6]
    assert "rollout-reserved" in {f.rule for f in plan.findings}  # evenrl train --rollout-devices 1 runs it
    assert (cfg.rollout.engine, cfg.parallel.rollout_devices) == ("vllm", 1)
    colocate, ccfg, _ = run(tmp_path, "trl", {**OPEN_R1, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.4},
                            nproc_per_node=4)
    assert (ccfg.rollout.engine, ccfg.rollout.memory_fraction, ccfg.parallel.rollout_devices) == ("vllm", 0.4, 0)
    assert colocate.layout.rollout_devices == 0
    ok, _, _ = run(tmp_path, "trl", {**OPEN_R1, "per_device_train_batch_size": 8}, nproc_per_node=4)
    assert ok.checks == []  # 8 x 3 x 2 = 48 samples = 6 prompts of 8
    g1, _, _ = run(tmp_path, "trl", {**OPEN_R1, "num_generations": 1}, nproc_per_node=4)
    assert any("GRPO requires at least 2 generations per prompt" in m for m in messages(g1))
    both, _, _ = run(tmp_path, "trl", {**OPEN_R1, "generation_batch_size": 48, "steps_per_generation": 2},
                     nproc_per_node=4)
    assert any("can not be both configured" in m for m in messages(both))
    proc, _, _ = run(tmp_path, "trl", {**OPEN_R1, "num_processes": 7})
    assert (proc.layout.world, proc.layout.training_ranks) == (8, 7)


def test_openpi_batch_of_one_with_batchnorm(tmp_path):
    """OpenPI: per-device batch 1 breaks BatchNorm. evenrl: min_rows_per_micro_batch=2; the schedule honours it
    by training on fewer ranks (the planner says which and how to use them all), or explains why it cannot."""
    f = tmp_path / "bn.yaml"
    f.write_text(yaml.safe_dump({"data": {"prompts_per_step": 4}, "rollout": {"samples_per_prompt": 2},
                                 "train": {"min_rows_per_micro_batch": 2}}))
    lay = make_layout(1, 8, device="cuda", device_memory_gib=80)
    plan = make_plan(load_config(str(f)), lay)
    assert plan.schedule_error is None and sorted(r.samples for r in plan.ranks) == [0] * 4 + [2] * 4
    idle = {x.rule: x for x in plan.findings}["idle-ranks"]
    assert "min_rows_per_micro_batch=2" in idle.message and "data.prompts_per_step=8" in idle.fix
    assert "SyncBatchNorm" in idle.fix
    new, _ = fit(plan)  # prompts per step are the experiment's: --fit leaves the idle ranks to the warning's fix
    fitted = make_plan(new, lay)
    assert fitted.runnable and new.data.prompts_per_step == 4 and "idle-ranks" in {x.rule for x in fitted.findings}
    bad = make_plan(load_config(str(f), ["train.min_rows_per_micro_batch=3", "algo.minibatches_per_step=4"]), lay)
    err = {x.rule: x for x in bad.findings}["min-rows"]
    assert err.level == "error" and "mini-batch 0 has 2 row(s) but min_rows=3" in err.message
    assert "data.prompts_per_step=8" in err.fix and "algo.minibatches_per_step=2" in err.fix


def test_openrlhf_command_text(tmp_path):
    t, cfg, plan = run(tmp_path, "openrlhf", OPENRLHF)
    assert (t.layout.world, t.layout.rollout_devices) == (7, 3)
    deepspeed = ("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                 "gradient_acc_step * world_size 30 != 2 * 3 * 4")
    assert t.version == "0.10" and messages(t) == [deepspeed]  # flat flags: 0.8-0.10.1's checks
    old, _, _ = run(tmp_path, "openrlhf", OPENRLHF, peer_version="0.7")  # the two checks only 0.6-0.7 had
    assert messages(old) == ["rollout_bach_size must be divisible by actor_world_size, got 6 and 4",
                             "actor_world_size must be divisible by vllm_num_engines, got 4 and 3", deepspeed]
    colocated, _, _ = run(tmp_path, "openrlhf", OPENRLHF.replace("  # a comment", " --colocate_all_models"))
    assert "actor_num_nodes * actor_num_gpus_per_node must be equal to vllm_num_engines * " \
        "vllm_tensor_parallel_size, got 4 and 3" in messages(colocated)  # OpenRLHF >= 0.8, when colocated
    assert colocated.layout.rollout_devices == 0
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.parallel.sharding) == (6, 4, "fsdp")
    assert cfg.algo.advantage == "grpo" and cfg.model.dtype == "bfloat16" and plan.runnable
    few, _, _ = run(tmp_path, "openrlhf", {"rollout_batch_size": 2, "n_samples_per_prompt": 1,
                                           "micro_rollout_batch_size": 8, "train_batch_size": 4,
                                           "actor_num_gpus_per_node": 8})
    assert "The number of sample batches must be greater than or equal to the effective number of actor processes." \
        in messages(few)
    assert "Gradient accumulation steps: 0 has to be greater than 0" in messages(few)
    nested, cfg2, _ = run(tmp_path, "openrlhf", {"rollout": {"batch_size": 16, "n_samples_per_prompt": 8},
                                                 "actor": {"num_nodes": 1, "num_gpus_per_node": 8}})
    assert (cfg2.data.prompts_per_step, cfg2.rollout.samples_per_prompt) == (16, 8)


def test_parse_flags():
    assert parse_flags("python -m x --a 1 --flag --b=two --c 0.5 --list '[1, 2]'") == {
        "a": 1, "flag": True, "b": "two", "c": 0.5, "list": [1, 2]}


@pytest.mark.parametrize("content, overrides, match", [
    (None, [], "no such file"),
    ("", [], "file is empty"),
    ("- 1\n", [], "top level is a list"),
    ("data: [\n", [], "invalid YAML"),
    ("data: {}\n", ["~data.x"], "deleting keys"),
    ("data: {}\n", ["data.train_batch_size=abc"], "verl data.train_batch_size: got 'abc'"),
    ("data: {}\n", ["data.train_batch_size=-2"], "need an integer"),
    ("data: {}\n", ["data.train_batch_size=1000000000000"], r"1\.\.10\^9"),
    ("data: {}\n", ["data.train_batch_size=20000000"], "data.train_batch_size -> evenrl: data.prompts_per_step"),
    ("data: {}\n", ["actor_rollout_ref.actor.use_kl_loss=maybe"], "need true or false"),
    ("data: {}\n", ["actor_rollout_ref.rollout.temperature=hot"], "need a number"),
    ("data: {}\n", ["bad override"], "expected key=value"),
])
def test_bad_peer_input(tmp_path, content, overrides, match):
    f = tmp_path / "v.yaml"
    if content is not None:
        f.write_text(content)
    with pytest.raises(UsageError, match=match):
        data = read_foreign("verl", str(f), overrides)
        translate("verl", data, ns())


def test_cli_from(tmp_path, capsys):
    f = tmp_path / "easyr1.yaml"
    f.write_text(yaml.safe_dump(EASYR1))
    assert cli_main(["plan", "--from", "easyr1", str(f), "trainer.n_gpus_per_node=6"]) == 0
    out = capsys.readouterr().out
    assert "EasyR1 would fail 2 checks" in out and "ValueError: actor global batch size per device" in out
    assert "equivalent evenrl config" in out and "prompts_per_step: 512" in out
    assert cli_main(["plan", "--from", "easyr1", str(f), "trainer.n_gpus_per_node=6", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "evenrl.foreign/1" and d["framework"] == "easyr1" and d["plan"]["runnable"]
    assert set(d["checks"][0]) == {"stage", "error", "message", "why", "version"}
    assert d["config"]["data"]["prompts_per_step"] == 512 and d["plan"]["schema"] == "evenrl.plan/1"
    assert cli_main(["plan", "--from", "easyr1", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli_main(["plan", "--from", "megatron", str(f)]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["--2", "²", "1e3x"])
def test_a_peer_value_that_only_looks_like_an_integer_is_one_line(value):
    from evenrl.planner.peers.reader import Source

    with pytest.raises(UsageError, match="need an integer"):
        Source("verl", {"data": {"train_batch_size": value}}).int("data.train_batch_size", 1)


@pytest.mark.parametrize("framework, content, overrides, note", [
    ("verl", LOGIC_RL, ["+actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"], "no optimizer-only mode"),
    ("verl", LOGIC_RL, ["+actor_rollout_ref.actor.fsdp_config.param_offload=true",
                        "+actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"], None),
    ("verl", LOGIC_RL, ["+actor_rollout_ref.actor.fsdp_config.offload_policy=true"], None),
    ("easyr1", EASYR1, ["+worker.actor.offload.offload_optimizer=true"], "no optimizer-only mode"),
    ("easyr1", EASYR1, ["+worker.actor.offload.offload_params=true"], None),
    ("easyr1", EASYR1, ["+worker.actor.fsdp.enable_cpu_offload=true"], None),
    ("easyr1", EASYR1, ["+worker.actor.offload.offload_params=true", "+worker.actor.fsdp.enable_full_shard=false"],
     "needs sharding"),
    ("openrlhf", OPENRLHF, ["--adam_offload"], "no optimizer-only mode"),
])
def test_peer_offload_becomes_fsdp2_offload_and_runs_as_printed(tmp_path, framework, content, overrides, note):
    """Every peer offload flag becomes FSDP2's one offload mode (with fsdp, which it needs), the equivalent
    config's plan on the peer's GPUs has no error, and the YAML the command prints is that config."""
    if framework == "openrlhf":
        content, overrides = content.replace("--zero_stage 3", "--zero_stage 2 " + overrides[0]), []
    model = config_only_model(tmp_path / "qwen7b", QWEN7B)
    key = {"verl": "actor_rollout_ref.model.path", "easyr1": "worker.actor.model.model_path"}.get(framework)
    if key:
        overrides = overrides + [f"+{key}={model}"]
    else:
        content = content.replace("  # a comment", f" --pretrain {model}  # a comment")
    t, cfg, plan = run(tmp_path, framework, content, overrides, device_memory_gib=80)
    assert (cfg.parallel.sharding, cfg.parallel.cpu_offload) == ("fsdp", "full")
    assert plan.layout.device == "cuda" and plan.memory.host_gib > 0 and plan.memory.breakdown["optimizer"] == 0
    assert not {"offload-replicated", "offload-cpu"} & {f.rule for f in plan.findings}
    if note:
        assert any(note in n for n in t.notes), t.notes
    else:
        assert not any("offload" in n for n in t.notes), t.notes
    printed = load_config(None, [f"{sec}.{k}={json.dumps(v)}" for sec, vals in
                                 yaml.safe_load(minimal_yaml(cfg)).items() for k, v in vals.items()])
    assert printed == cfg
    new, _ = fit(plan)  # the peer's batch may not fit 80 GiB; the fitted config does, offload kept
    fitted = make_plan(new, plan.layout)
    assert fitted.runnable and (new.parallel.sharding, new.parallel.cpu_offload) == ("fsdp", "full"), render(fitted)


def test_peer_without_offload_keeps_the_device_state(tmp_path):
    t, cfg, _ = run(tmp_path, "verl", LOGIC_RL)
    assert (cfg.parallel.sharding, cfg.parallel.cpu_offload) == ("fsdp", "none")
    one, cfg1, _ = run(tmp_path, "verl", LOGIC_RL, ["trainer.n_gpus_per_node=1",
                                                    "+actor_rollout_ref.actor.fsdp_config.param_offload=true"])
    assert (cfg1.parallel.sharding, cfg1.parallel.cpu_offload) == ("fsdp", "full")  # offload needs fsdp, even on 1


# Logic-RL's run as its report describes it: REINFORCE++ with one sample per prompt, 2 prompts on 4 GPUs, with
# parameters, gradients and optimizer state offloaded to the host.
LOGIC_RL_PP = {"data": {"train_batch_size": 2, "max_prompt_length": 400, "max_response_length": 4096},
               "actor_rollout_ref": {
                   "model": {"enable_gradient_checkpointing": True},
                   "actor": {"ppo_mini_batch_size": 256, "ppo_micro_batch_size": 64, "use_kl_loss": True,
                             "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl",
                             "fsdp_config": {"param_offload": True, "grad_offload": True, "optimizer_offload": True}},
                   "rollout": {"n": 1}},
               "algorithm": {"adv_estimator": "reinforce_plus_plus", "kl_ctrl": {"kl_coef": 0.001}},
               "trainer": {"n_gpus_per_node": 4, "nnodes": 1}}


def test_logic_rl_reinforce_pp_one_sample_translates_and_plans_without_errors(tmp_path):
    t, cfg, plan = run(tmp_path, "verl", LOGIC_RL_PP)
    assert t.version == "logic-rl"  # grad_offload is a key of the older fork only
    # the fork splits the 2 prompts over 4 workers before it repeats them; the up-front check came later
    assert messages(t) == ["only support equal chunk. Got size of DataProto 2 and chunk 4."]
    assert (cfg.algo.advantage, cfg.rollout.samples_per_prompt, cfg.data.prompts_per_step) == ("reinforce_pp", 1, 2)
    assert (cfg.parallel.sharding, cfg.parallel.cpu_offload) == ("fsdp", "full")
    assert cfg.algo.kl_coef == 0.001 and cfg.algo.kl_in == "loss"
    assert not any("no evenrl equivalent" in n for n in t.notes)
    assert t.layout.training_ranks == 4
    assert [f for f in plan.findings if f.level == "error"] == [], [f.message for f in plan.findings]
    assert plan.runnable and sum(r.samples for r in plan.ranks) == 2


def test_verl_ppo_with_critic_dynamic_sampling_and_overlong(tmp_path):
    critic_dir = tmp_path / "critic"
    critic_dir.mkdir()
    peer = {**LOGIC_RL, "algorithm": {"adv_estimator": "gae", "gamma": 0.99, "lam": 0.95,
                                      "filter_groups": {"enable": True, "max_num_gen_batches": 6}},
            "critic": {"model": {"path": str(critic_dir)}, "optim": {"lr": 2e-5, "lr_warmup_steps": 10},
                       "cliprange_value": 0.3},
            "reward_model": {"overlong_buffer": {"enable": True, "len": 512, "penalty_factor": 0.5}}}
    t, cfg, plan = run(tmp_path, "verl", peer)
    assert (cfg.algo.advantage, cfg.algo.gamma, cfg.algo.lam) == ("gae", 0.99, 0.95)
    assert (cfg.critic.path, cfg.critic.lr, cfg.critic.warmup_steps, cfg.critic.value_clip) == \
        (str(critic_dir), 2e-5, 10, 0.3)
    assert cfg.algo.filter_groups and cfg.algo.max_generation_rounds == 6
    assert (cfg.rewards.overlong_buffer, cfg.rewards.overlong_penalty) == (512, 0.5)
    assert not [f for f in plan.findings if f.level == "error"]
    # the policy's own path as critic: no separate critic.path; verl's unlimited rounds: bounded, said so
    peer["critic"]["model"]["path"] = ""
    peer["algorithm"]["filter_groups"]["max_num_gen_batches"] = 0
    t2, cfg2, _ = run(tmp_path, "verl", peer)
    assert cfg2.critic.path == "" and cfg2.algo.max_generation_rounds == 4
    assert any("no limit on generation rounds" in n for n in t2.notes)


def test_openrlhf_and_easyr1_map_the_new_estimators(tmp_path):
    flags = OPENRLHF.replace("--advantage_estimator group_norm", "--advantage_estimator gae --gamma 0.9 --lambd 0.8 "
                             "--critic_learning_rate 3e-6 --value_clip 0.2 --dynamic_filtering "
                             "--overlong_buffer_len 256 --overlong_penalty_factor 2.0")
    _, cfg, _ = run(tmp_path, "openrlhf", flags)
    assert (cfg.algo.advantage, cfg.algo.gamma, cfg.algo.lam, cfg.critic.lr, cfg.critic.value_clip) == \
        ("gae", 0.9, 0.8, 3e-6, 0.2)
    assert cfg.algo.filter_groups and (cfg.rewards.overlong_buffer, cfg.rewards.overlong_penalty) == (256, 2.0)
    _, cfg, _ = run(tmp_path, "openrlhf", OPENRLHF.replace("group_norm", "reinforce"))
    assert cfg.algo.advantage == "reinforce_pp" and not cfg.algo.filter_groups
    easy = {**EASYR1, "algorithm": {**EASYR1["algorithm"], "adv_estimator": "reinforce_plus_plus",
                                    "gamma": 0.95, "online_filtering": True}}
    _, cfg, _ = run(tmp_path, "easyr1", easy)
    assert (cfg.algo.advantage, cfg.algo.gamma, cfg.algo.filter_groups) == ("reinforce_pp", 0.95, True)
    easy["algorithm"] = {**easy["algorithm"], "adv_estimator": "gae", "lam": 0.9}
    easy["worker"] = {**easy["worker"], "critic": {"optim": {"lr": 4e-6}, "cliprange_value": 0.4}}
    _, cfg, _ = run(tmp_path, "easyr1", easy)
    assert (cfg.algo.advantage, cfg.algo.lam, cfg.critic.lr, cfg.critic.value_clip) == ("gae", 0.9, 4e-6, 0.4)


@pytest.mark.parametrize("framework, content, want", [
    ("verl", {"actor_rollout_ref": {"model": {"lora_rank": 32, "lora_alpha": 64, "target_modules": "all-linear"}}},
     {"rank": 32, "alpha": 64.0}),
    ("trl", {"use_peft": True, "lora_target_modules": ["q_proj", "v_proj"]},  # TRL's ModelConfig defaults
     {"rank": 16, "alpha": 32.0, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}),
    ("trl", {"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}},
     {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"]}),
    ("openrlhf", "--lora_rank 8 --lora_alpha 16 --target_modules q_proj k_proj",
     {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj"]}),
    ("openrlhf", "--lora_rank 0", {}),
])
def test_peer_lora_settings_become_model_lora(tmp_path, framework, content, want):
    t, cfg, _ = run(tmp_path, framework, content)
    assert cfg.model.lora.model_dump() == {**RunConfig().model.lora.model_dump(), **want}
    if want.get("dropout"):
        assert any("dropout masks are drawn per rank" in n for n in t.notes)


def test_verl_multi_turn_and_trl_tools_map_to_trajectory_caps(tmp_path):
    """verl's agent loop: its response length is the whole trajectory (rollout.max_trajectory_tokens), a turn may use
    all of it, max_assistant_turns is rollout.max_turns, and its tool classes are a note (they become an evenrl
    environment); TRL's max_tool_calling_iterations n is n + 1 turns, its tools= a note."""
    multi = {"enable": True, "max_assistant_turns": 5, "max_user_turns": 3, "tool_config_path": "./tools.yaml",
             "format": "hermes", "max_tool_response_length": 256}
    peer = {**LOGIC_RL, "actor_rollout_ref": {**LOGIC_RL["actor_rollout_ref"],
                                              "rollout": {**LOGIC_RL["actor_rollout_ref"]["rollout"],
                                                          "multi_turn": multi}}}
    t, cfg, _ = run(tmp_path, "verl", peer)
    assert (cfg.rollout.max_turns, cfg.rollout.max_trajectory_tokens, cfg.rollout.max_new_tokens) == (5, 4096, 4096)
    notes = " ".join(t.notes)
    assert "./tools.yaml" in notes and "rollout.env=package.module:Name" in notes and "max_user_turns" in notes
    assert "max_tool_output_chars" in notes
    t, cfg, _ = run(tmp_path, "trl", {"num_generations": 8, "max_tool_calling_iterations": 2,
                                      "max_completion_length": 1024})
    assert (cfg.rollout.max_turns, cfg.rollout.max_trajectory_tokens) == (3, 1024)
    assert any("tools=" in n and "3 assistant turns" in n for n in t.notes)


def test_trl_fractional_epochs_become_the_steps_they_mean(tmp_path):
    """open-r1's recipes train on a share of an epoch (num_train_epochs: 0.1), which TRL accepts. 1000 local rows,
    generation batches of 2 x 3 x 2 = 12 samples = 2 prompts (rounded up from 1.5) a step: 500 steps an epoch;
    0.1 of it is 50 steps; 0.013 is 6.5, rounded up as transformers' Trainer rounds (math.ceil): 7. Whole epochs stay
    whole; a share that is no number of epochs is one line."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}"}}\n' for i in range(1000)))
    base = {k: v for k, v in OPEN_R1.items() if k != "max_steps"} | {"dataset_name": str(data)}
    for epochs, steps in ((0.1, 50), (0.013, 7), (2, 1000)):
        t, cfg, _ = run(tmp_path, "trl", {**base, "num_train_epochs": epochs}, nproc_per_node=4, peer_version="0.18")
        assert cfg.data.prompts_per_step == 2 and cfg.train.steps == steps
        assert any("rounded up" in n for n in t.notes) == (steps == 7)
    for bad in (0, -1, "a tenth"):
        with pytest.raises(UsageError, match="num_train_epochs"):
            run(tmp_path, "trl", {**base, "num_train_epochs": bad}, nproc_per_node=4)


def test_verl_megatron_expert_parallelism_maps_to_evenrls(tmp_path):
    """verl's Megatron expert_model_parallel_size is evenrl's parallel.expert_parallel_size (the same split of the
    experts over ranks borrowed from data parallelism), with a note; the reference's follows the policy's; expert
    tensor parallelism has no equivalent (each expert stays whole on its rank)."""
    peer = {**LOGIC_RL, "actor_rollout_ref": {
        **LOGIC_RL["actor_rollout_ref"],
        "actor": {**LOGIC_RL["actor_rollout_ref"]["actor"], "strategy": "megatron",
                  "megatron": {"expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1}},
        "ref": {"megatron": {"expert_model_parallel_size": 4}}}}
    t, cfg, _ = run(tmp_path, "verl", peer)
    assert cfg.parallel.expert_parallel_size == 4
    assert any("expert_model_parallel_size=4: evenrl's parallel.expert_parallel_size splits" in n for n in t.notes)
    assert t.layout.training_ranks == 4  # Megatron's EP leaves the data-parallel size alone
    rows = {r["key"]: r for r in t.keys}
    assert rows["actor_rollout_ref.ref.megatron.expert_model_parallel_size"]["why"].startswith(
        "the reference model follows")
    assert "each expert whole" in rows["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size"]["why"]
