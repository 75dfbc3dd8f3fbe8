"""Run config: YAML file + dotted overrides, and every way they can be wrong -> one-line UsageError naming
the field or file, the value and what is allowed."""

from pathlib import Path

import pydantic
import pytest
import yaml
from pydantic import BaseModel

from evenrl.config import (MAX_COUNT, MAX_YAML_NODES, RunConfig, apply_overrides, config_to_yaml, load_config,
                           parse_yaml, validation_message)
from evenrl.config import yaml_reader
from evenrl.errors import UsageError


def fails(path, overrides=(), *, match="", lines=1):
    """The UsageError of loading `path` with `overrides`: `lines` lines (one problem: one line), holding `match`."""
    with pytest.raises(UsageError) as e:
        load_config(path, list(overrides))
    msg = str(e.value)
    assert len(msg.splitlines()) == lines and match in msg, msg
    return msg


def write(tmp_path, text, name="c.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


def test_defaults_file_and_overrides(tmp_path):
    assert load_config(None) == RunConfig()
    f = write(tmp_path, "data:\n  prompts_per_step: 64\nrollout:\n  samples_per_prompt: 4\n")
    cfg = load_config(f, ["rollout.samples_per_prompt=8", "algo.kl_coef=1e-3", "parallel.capacity_weights=[1, 2]",
                          "log.run_dir=runs/my run", "model.gradient_checkpointing=true"])
    assert (cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.algo.kl_coef) == (64, 8, 0.001)
    assert cfg.parallel.capacity_weights == [1.0, 2.0] and cfg.log.run_dir == "runs/my run"
    assert cfg.model.gradient_checkpointing is True and cfg.samples_per_step() == 512
    assert load_config(write(tmp_path, config_to_yaml(cfg), "dump.yaml")) == cfg  # the dumped config reloads


def test_apply_overrides_copies_and_parses_yaml_scalars():
    data = {"data": {"prompts_per_step": 4}}
    out = apply_overrides(data, ["data.prompts_per_step=8", "rollout.top_p=0.9", "x.y=null", "x.z=[a, 1]"])
    assert data == {"data": {"prompts_per_step": 4}}  # the input is untouched
    assert out == {"data": {"prompts_per_step": 8}, "rollout": {"top_p": 0.9}, "x": {"y": None, "z": ["a", 1]}}
    assert apply_overrides({}, ["a=b: c: d"]) == {"a": "b: c: d"}  # not valid YAML: kept as text


@pytest.mark.parametrize("overrides, match", [
    (["data.prompts_per_step"], "override 'data.prompts_per_step': expected key=value"),
    (["=3"], "empty key segment"),
    (["data..prompts_per_step=3"], "empty key segment"),
    (["data.prompts_per_step.x=1"], "override data.prompts_per_step.x: prompts_per_step is a value, not a section"),
])
def test_override_syntax(tmp_path, overrides, match):
    fails(write(tmp_path, "data:\n  prompts_per_step: 4\n"), overrides, match=match)


@pytest.mark.parametrize("overrides, match", [
    (["nope=1"], "nope: unknown key; allowed here: algo, checkpoint, critic, data, eval, log, model, parallel, rewards, rollout, "
                 "sft, train"),
    (["data.batch_size=64"], "data.batch_size: unknown key; allowed here: answer_field, extra_fields, image_key, "
                             "max_images_per_prompt, max_pixels, max_prompt_tokens, min_pixels, path, prompt_field, "
                             "prompts_per_step, seed"),
    (["rewards.functions=[{name: math, wieght: 2}]"], "rewards.functions.0.wieght: unknown key; "
                                                      "allowed here: judge, model, name, weight"),
])
def test_unknown_keys_list_the_allowed_ones(overrides, match):
    fails(None, overrides, match=match)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.samples_per_prompt=lots"], "rollout.samples_per_prompt: got 'lots'; input should be a valid integer"),
    (["model.gradient_checkpointing=maybe"], "model.gradient_checkpointing: got 'maybe'; input should be a valid "
                                             "boolean"),
    (["data=3"], "data: got 3; input should be a valid dictionary"),
    (["model.dtype=fp8"], "model.dtype: got 'fp8'; input should be 'float32' or 'bfloat16'"),
    (["data.prompts_per_step=1.5"], "data.prompts_per_step: got 1.5"),
    (["data.prompts_per_step=-4"], "data.prompts_per_step: got -4; input should be greater than or equal to 1"),
    (["data.prompts_per_step=1000000000000"],
     f"data.prompts_per_step: got 1000000000000; input should be less than or equal to {MAX_COUNT}"),
    (["parallel.capacity_weights=[1, 0, 2]"], "parallel.capacity_weights: got [1, 0, 2]; item 1 is 0; expected 'auto'"),
    (["parallel.capacity_weights=[1, -2]"], "parallel.capacity_weights: got [1, -2]; item 1 is -2; expected 'auto'"),
    (["parallel.capacity_weights=[1, .nan]"], "parallel.capacity_weights: got [1, nan]; item 1 is nan; expected"),
    (["parallel.capacity_weights=1,2"], "parallel.capacity_weights: got '1,2'; expected 'auto' or a list of relative speeds"),
    (["parallel.capacity_weights=fast"], "parallel.capacity_weights: got 'fast'; expected 'auto' or a list of"),
])
def test_bad_values(overrides, match):
    assert fails(None, overrides, match=match).startswith("config: ")


def test_every_problem_at_once_each_with_its_source(tmp_path):
    msg = fails(None, ["data.prompts_per_step=0", "rollout.samples_per_prompt=0", "train.lr=-1"], lines=4)
    assert msg.splitlines() == ["3 problems in the config:",
                                "  config: data.prompts_per_step: got 0; input should be greater than or equal to 1",
                                "  config: rollout.samples_per_prompt: got 0; input should be greater than or equal "
                                "to 1", "  config: train.lr: got -1; input should be greater than 0"]
    f = write(tmp_path, "data: {prompts_per_step: 0}\nrewards: {functions: [{name: math}]}\n")
    lines = fails(f, ["rollout.samplez=3", "rewards.functions=[{name: math, wieght: 2}]"], lines=4).splitlines()
    assert lines[0] == "3 problems in the config:"
    assert lines[1].startswith(f"  {f}: data.prompts_per_step: got 0")  # the file's
    assert lines[2].startswith("  command line: rollout.samplez: unknown key")  # the typo is the command line's
    assert lines[3].startswith("  command line: rewards.functions.0.wieght: unknown key")


def test_an_empty_override_is_the_empty_string():
    assert load_config(None, ["eval.path=", "log.run_name="]).eval.path == ""
    assert load_config(None, ["log.wandb.entity= "]).log.wandb.entity == " "


@pytest.mark.parametrize("content, match", [
    ("", "file is empty; expected a mapping of sections"),
    ("# only a comment\n", "file is empty"),
    ("- a\n- b\n", "top level is a list; expected a mapping of sections"),
    ("42\n", "top level is a int"),
    ("data: [\n", "invalid YAML at line 2; fix the syntax"),
    ("data:\n  nope: 1\n", "data.nope: unknown key"),
])
def test_bad_files(tmp_path, content, match):
    f = write(tmp_path, content)
    assert fails(f, match=match).startswith(str(f))


def test_bad_paths(tmp_path):
    fails(tmp_path, match="is a directory; give a YAML config file")
    fails(tmp_path / "missing.yaml", match="no such file")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    fails(tmp_path / "bin.yaml", match="cannot read (UnicodeDecodeError); give a UTF-8 YAML file")


def test_validation_message_is_one_line_with_the_source():
    with pytest.raises(pydantic.ValidationError) as e:
        RunConfig.model_validate({"data": {"prompts_per_step": "x" * 200}})
    msg = validation_message(e.value, "peer.yaml")
    assert msg.startswith("peer.yaml: data.prompts_per_step: got 'xxx") and "..." in msg and "\n" not in msg
    assert "x" * 58 not in msg  # a long value is cut, the message stays one readable line


def test_every_field_has_a_description():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
    walk(RunConfig)
    assert yaml.safe_load(config_to_yaml(RunConfig()))["data"]["prompts_per_step"] == 16


def test_bounded_yaml_reads_what_safe_load_reads():
    """The bounded reader builds what yaml.safe_load builds: aliases, merge keys, YAML 1.1 scalars ('1e-6' stays
    text, as before), and every shipped example."""
    text = ("base: &b {lr: 1.0e-3, betas: [0.9, 0.99], on: yes, when: 2001-12-14, n: 0x10, s: 1e-6}\n"
            "train:\n  <<: *b\n  steps: 3\nlist: [*b, *b]\n")
    assert parse_yaml(text, "t") == yaml.safe_load(text)
    for f in sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml")):
        assert parse_yaml(f.read_text(), str(f)) == yaml.safe_load(f.read_text())
    assert parse_yaml("", "t") is None and parse_yaml("# comment\n", "t") is None


def test_bounded_yaml_limits_are_exact(monkeypatch):
    """MAX_YAML_NODES values are read; one more is refused, also when an alias brings it."""
    monkeypatch.setattr(yaml_reader, "MAX_YAML_NODES", 100)
    items = 100 - 2  # the mapping, its key, the list: 3 values; items make it MAX_YAML_NODES + 1
    assert len(parse_yaml("x: [" + ", ".join(["1"] * (items - 1)) + "]", "t")["x"]) == items - 1
    with pytest.raises(UsageError, match="t: more than 100 values"):
        parse_yaml("x: [" + ", ".join(["1"] * items) + "]", "t")
    half = (100 - 5) // 2
    shared = "a: &a [" + ", ".join(["1"] * half) + "]\nb: *a\n"  # 2 keys, 2 uses of the list
    assert len(parse_yaml(shared, "t")["b"]) == half
    with pytest.raises(UsageError, match="more than 100 values"):
        parse_yaml(shared + "c: *a\n", "t")
    assert MAX_YAML_NODES == 100_000  # the shipped limit


@pytest.mark.parametrize("overrides, match", [
    (["data.prompts_per_step=true"], "data.prompts_per_step: got True; expected a number, not true/false"),
    (["train.betas=[0.9, true]"], "train.betas: got [0.9, True]; expected a number, not true/false"),
    (["rewards.functions=[{name: exact_match, weight: false}]"], "rewards.functions.0.weight: got False"),
    (["algo.clip_high=.inf"], "algo.clip_high: got inf; input should be a finite number"),
    (["algo.kl_coef=.nan"], "algo.kl_coef: got nan; input should be a finite number"),
    (["train.betas=[0.9, 1]"], "train.betas.1: got 1; input should be less than 1"),
    (["train.seed=-9223372036854775809"], "train.seed: got -9223372036854775809; input should be greater than"),
    (["data.prompt_field=\"a\\0\""], "data.prompt_field: got 'a\\x00'; expected text without a zero"),
])
def test_values_that_would_poison_a_run(overrides, match):
    fails(None, overrides, match=match)


def test_booleans_stay_booleans_and_numbers_numbers():
    cfg = load_config(None, ["log.tensorboard=false", "train.betas=[0, 0.5]", "rewards.functions=[{name: a, weight: 2}]",
                             "train.seed=-1"])
    assert cfg.log.trackers == [] and cfg.train.betas == (0.0, 0.5) and cfg.rewards.functions[0].weight == 2.0
