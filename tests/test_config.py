"""Run config: YAML file + dotted overrides, and every way they can be wrong -> one-line UsageError naming
the field or file, the value and what is allowed."""

import typing
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


@pytest.mark.parametrize("overrides, line", [
    (["nope=1"], "nope: unknown key; allowed here: algo, checkpoint, critic, data, eval, log, model, parallel, "
                 "rewards, rollout, sft, train"),
    (["data.batch_size=64"], "data.batch_size: unknown key; all keys of data: docs/config.md"),
    (["rollout.temprature=0.5"], "rollout.temprature: unknown key; did you mean rollout.temperature? (all keys: "
                                 "docs/config.md)"),
    (["rewards.functions=[{name: math, wieght: 2}]"], "rewards.functions.0.wieght: unknown key; did you mean "
                                                      "rewards.functions.0.weight? (all keys: docs/config.md)"),
    (["rewards.functions=[{name: math, xyz: 2}]"], "rewards.functions.0.xyz: unknown key; allowed here: judge, model, "
                                                   "name, weight"),
])
def test_unknown_keys_name_the_closest_key(overrides, line):
    assert fails(None, overrides) == f"config: {line}"


def test_an_unknown_key_is_one_short_line_in_every_section():
    """Every section, the largest too (rollout: ~25 keys), answers a typo of each of its keys in one line of at
    most 130 characters that names the key meant."""
    def sections(model, prefix):
        yield prefix, model
        for name, field in model.model_fields.items():
            if _is_section(field.annotation):  # lists of entries (rewards.functions) are checked above
                yield from sections(field.annotation, f"{prefix}{name}.")
    seen = 0
    for prefix, model in sections(RunConfig, ""):
        for key, field in model.model_fields.items():
            if len(key) < 4 or _is_section(field.annotation):
                continue
            typo = key[:-2] + key[-1]  # the second-to-last letter left out
            if typo in model.model_fields:
                continue
            msg = fails(None, [f"{prefix}{typo}=1"])
            assert len(msg) <= 130 and f"did you mean {prefix}{key}?" in msg, msg
            seen += 1
    assert seen > 100


def _is_section(ann) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


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


def test_yes_no_on_off_are_words_that_true_false_fields_read_as_booleans(tmp_path):
    """evenrl's configs keep yes/no/on/off as written (YAML 1.2's booleans are true/false only): a true/false field
    reads them as booleans, a text field and agent_args keep the word."""
    f = write(tmp_path, "model:\n  tf32: off\n  use_chat_template: yes\nlog:\n  tensorboard: on\n"
                        "data:\n  prompt_field: no\n")
    for cfg in (load_config(f), load_config(None, ["model.tf32=off", "model.use_chat_template=yes",
                                                   "log.tensorboard=on", "data.prompt_field=no"])):
        assert (cfg.model.tf32, cfg.model.use_chat_template, cfg.log.trackers) == (False, True, ["tensorboard"])
        assert cfg.data.prompt_field == "no"
    assert load_config(None, ["rollout.agent_args={think: on, n: true}"]).rollout.agent_args == {"think": "on", "n": True}
    fails(None, ["model.tf32=maybe"], match="model.tf32: got 'maybe'; input should be a valid boolean")


def test_booleans_stay_booleans_and_numbers_numbers():
    cfg = load_config(None, ["log.tensorboard=false", "train.betas=[0, 0.5]", "rewards.functions=[{name: a, weight: 2}]",
                             "train.seed=-1"])
    assert cfg.log.trackers == [] and cfg.train.betas == (0.0, 0.5) and cfg.rewards.functions[0].weight == 2.0


def _literal_fields(model=RunConfig, path=()):
    """(dotted path, allowed values) of every enumeration in the schema: Literal fields, also inside optional
    fields, unions and lists ("[]" marks a list's entry)."""
    for name, field in model.model_fields.items():
        yield from _literals(field.annotation, (*path, name))


def _literals(ann, path):
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        yield ".".join(path), typing.get_args(ann)
    elif _is_section(ann):
        yield from _literal_fields(ann, path)
    else:
        for arg in typing.get_args(ann):
            yield from _literals(arg, (*path, "[]") if origin is list else path)


def _get(cfg, path: str):
    for part in path.split("."):
        cfg = cfg[0] if part == "[]" else getattr(cfg, part)
    return cfg


# what a value needs beside it to be valid (the enumeration's reading is what is tested): other settings, and the
# required fields of a list's entry
_COMPANIONS = {"parallel.cpu_offload=full": ["parallel.sharding=fsdp"],
               "model.weights_dtype=bfloat16": ["model.dtype=bfloat16"]}
_ENTRY_NEEDS = {"algo.rejection": ", high: 2"}

ENUMS = [(path, value) for path, values in _literal_fields() for value in values]


@pytest.mark.parametrize("path, value", ENUMS, ids=[f"{p}={v}" for p, v in ENUMS])
def test_every_enumeration_value_loads_as_written(tmp_path, path, value):
    """Each allowed value of every enumeration, written bare in a YAML file and as a dotted override, loads as that
    value: YAML 1.1 would read off/on/yes/no as booleans (rollout.router_replay: off failed so)."""
    assert len(ENUMS) > 60 and ("rollout.router_replay", "off") in ENUMS
    companions = _COMPANIONS.get(f"{path}={value}", [])
    outer, _, inner = path.partition(".[]")
    if not _:  # a field: `section:\n  field: value` in the file, section.field=value on the command line
        *sections, field = path.split(".")
        text = "".join(f"{'  ' * i}{name}:\n" for i, name in enumerate(sections)) + \
            f"{'  ' * len(sections)}{field}: {value}\n"
        override = f"{path}={value}"
    else:  # a list's entry: `- value` or `- {field: value}`, the list as an override
        *sections, field = outer.split(".")
        entry = f"{{{inner[1:]}: {value}{_ENTRY_NEEDS.get(outer, '')}}}" if inner else value
        text = "".join(f"{'  ' * i}{name}:\n" for i, name in enumerate(sections)) + \
            f"{'  ' * len(sections)}{field}:\n{'  ' * len(sections)}- {entry}\n"
        override = f"{outer}=[{entry}]"
    assert _get(load_config(write(tmp_path, text), companions), path) == value, text
    assert _get(load_config(None, [override, *companions]), path) == value, override
