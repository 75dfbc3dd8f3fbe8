"""Hugging Face dataset ids as data.path (`hiyouga/geometry3k@train`, what EasyR1's and verl's scripts say): read
from a `datasets` cache laid out here by hand (no network), the same for `evenrl plan`, `evenrl train` and
`--from`; `datasets.load_dataset` itself reads the same layout (so it is the library's); a dataset that is not
cached is one line, or the planner's finding, naming how to get it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from e2e import evenrl_here, metrics, shared_args
from evenrl.config import load_config
from evenrl.data import hub
from evenrl.data.readers import Fields, read_rows
from evenrl.errors import UsageError
from evenrl.planner.layout import make_layout
from evenrl.planner.plan import count_rows, make_plan
from evenrl.data.prompts import load_prompts

TRAIN = [{"problem": f"{i} + 1 =", "answer": str(i + 1)} for i in range(7)]
TEST = [{"problem": "9 + 9 =", "answer": "18"}]


def lay_out(cache, repo: str, config: str, splits: dict[str, list[list[dict]]], commit: str = "0123abc"):
    """One configuration of `repo` as `datasets` prepares it in its cache: <ns>___<name>/<config>/0.0.0/<commit>/
    with dataset_info.json and, per split, Arrow stream files NAME-SPLIT.arrow (one shard) or
    NAME-SPLIT-0000i-of-0000n.arrow (several)."""
    ns, name = repo.split("/")
    root = cache / f"{ns}___{name}" / config / "0.0.0" / commit
    root.mkdir(parents=True)
    info = {"config_name": config, "dataset_name": name, "splits": {}}
    for split, shards in splits.items():
        for i, rows in enumerate(shards):
            suffix = "" if len(shards) == 1 else f"-{i:05d}-of-{len(shards):05d}"
            table = pa.Table.from_pylist(rows)
            with pa.OSFile(str(root / f"{name}-{split}{suffix}.arrow"), "wb") as f:
                with pa.ipc.new_stream(f, table.schema) as w:
                    w.write_table(table)
        info["splits"][split] = {"name": split, "num_examples": sum(map(len, shards)), "dataset_name": name,
                                 **({"shard_lengths": [len(s) for s in shards]} if len(shards) > 1 else {})}
    (root / "dataset_info.json").write_text(json.dumps(info))
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A datasets cache with tiny-org/addition (train in two shards, test) and tiny-org/multi (two configs)."""
    cache = tmp_path / "datasets"
    lay_out(cache, "tiny-org/addition", "default", {"train": [TRAIN[:4], TRAIN[4:]], "test": [TEST]})
    for config in ("main", "socratic"):
        lay_out(cache, "tiny-org/multi", config, {"train": [[{"problem": config, "answer": "1"}]]})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    return cache


def test_ids_and_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.parse("hiyouga/geometry3k@train") == hub.HubDataset("hiyouga/geometry3k", None, "train")
    assert hub.parse("openai/gsm8k:main@test") == hub.HubDataset("openai/gsm8k", "main", "test")
    assert hub.parse("openai/gsm8k") == hub.HubDataset("openai/gsm8k", None, "train")  # EasyR1's default split
    assert str(hub.parse("openai/gsm8k:main")) == "openai/gsm8k:main@train"
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.parse("org/name") is None  # there: a path
    assert not any(map(hub.parse, ["data/train.jsonl", "d/x.parquet", "/abs/x", "./rel/x", "a/b/c", "name",
                                   "org/name@", "org/name:@x", ""]))


def test_rows_come_from_the_cache_in_order_split_by_split(cache):
    fields = Fields("problem", "answer")
    rows, complete = read_rows("tiny-org/addition@train", fields)
    assert complete and [(r["prompt"], r["answer"], r["id"]) for r in rows] == [
        (t["problem"], t["answer"], i) for i, t in enumerate(TRAIN)]  # both shards, in order
    assert read_rows("tiny-org/addition", fields)[0] == rows  # the train split by default
    assert [r["prompt"] for r in load_prompts("tiny-org/addition@test", prompt_field="problem")] == ["9 + 9 ="]
    head, complete = read_rows("tiny-org/addition@train", fields, max_rows=3)  # the planner's first rows
    assert [r["prompt"] for r in head] == [t["problem"] for t in TRAIN[:3]] and not complete
    assert read_rows("tiny-org/multi:socratic@train", fields)[0][0]["prompt"] == "socratic"


def test_the_library_reads_the_same_layout(cache):
    """datasets.load_dataset, offline, on this cache gives the rows evenrl reads: the layout is the library's."""
    code = ("import datasets, json; d = datasets.load_dataset('tiny-org/addition', split='train'); "
            "print(json.dumps(d.to_list()))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == TRAIN


def test_rows_are_counted_from_the_cached_metadata_without_torch(cache):
    assert count_rows("tiny-org/addition@train") == 7 and count_rows("tiny-org/addition@test") == 1
    for f in cache.rglob("*.arrow"):
        f.unlink()
    assert count_rows("tiny-org/addition@train") == 7  # dataset_info.json alone
    assert count_rows("tiny-org/missing@train") is None
    code = ("import sys; from evenrl.planner.plan import count_rows; "
            "assert count_rows('tiny-org/missing@train') is None; print('datasets' in sys.modules); "
            "assert count_rows('tiny-org/addition@train') == 7; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HF_DATASETS_CACHE": str(cache)},
                         capture_output=True, text=True, timeout=120)
    # a dataset with no directory in the cache costs a stat, not `datasets`' ~1 s import (a --from plan's budget);
    # neither the planner nor `datasets` imports torch
    assert out.stdout.split() == ["False", "False"], out.stderr


@pytest.mark.parametrize("path, line", [
    ("tiny-org/addition@validation", "prompts path: 'tiny-org/addition@validation': tiny-org/addition has no split "
                                     "'validation' (its splits: test, train); e.g. tiny-org/addition@train"),
    ("tiny-org/multi@train", "prompts path: 'tiny-org/multi@train': the cache holds several configurations of "
                             "tiny-org/multi (main, socratic); name one: tiny-org/multi:main@train"),
    ("tiny-org/missing@train", "prompts path: 'tiny-org/missing@train' is neither a local file nor a dataset in the "
                               "Hugging Face datasets cache ({cache}); `evenrl train` downloads it; or cache it: "
                               "python -c \"import datasets; datasets.load_dataset('tiny-org/missing', "
                               "split='train')\""),
    ("tiny-org/addition:other", "prompts path: 'tiny-org/addition:other@train' is neither a local file nor a "
                                "dataset in the Hugging Face datasets cache"),
])
def test_what_cannot_be_read_is_one_line(cache, path, line):
    with pytest.raises(UsageError) as e:
        read_rows(path, Fields("problem", "answer"))
    assert str(e.value).startswith(line.format(cache=cache)) and "\n" not in str(e.value)


def test_plan_reads_a_cached_dataset_and_reports_one_that_is_not(cache):
    base = ["data.prompt_field=problem", "data.prompts_per_step=2"]
    p = make_plan(load_config(None, base + ["data.path=tiny-org/addition@train"]), make_layout())
    assert p.dataset_rows == 7 and not [f for f in p.findings if f.rule.startswith("data")], p.findings
    p = make_plan(load_config(None, base + ["data.path=tiny-org/missing@train",
                                            "eval.path=tiny-org/addition@nope"]), make_layout())
    found = {f.rule: f for f in p.findings}
    assert found["data-path"].level == "error" and found["data-path"].message == (
        f"data.path 'tiny-org/missing@train' is not in the Hugging Face datasets cache ({cache}); evenrl plan never "
        "downloads")
    assert "python -c \"import datasets; datasets.load_dataset('tiny-org/missing', split='train')\"" in \
        found["data-path"].fix
    assert "has no split 'nope'" in found["eval-path"].message


def test_train_is_one_line_when_offline_or_when_the_hub_says_no(cache, assets, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = evenrl_here(capsys, "train", assets["cfg"], "data.path=tiny-org/missing",
                                 f"log.run_dir={tmp_path / 'run'}", "--nproc-per-node", "2")
    assert code == 2 and err.strip().splitlines() == [
        f"evenrl train: error: data.path: 'tiny-org/missing@train' is neither a local file nor a dataset in the "
        f"Hugging Face datasets cache ({cache}); HF_HUB_OFFLINE is set; or cache it: python -c \"import datasets; "
        "datasets.load_dataset('tiny-org/missing', split='train')\""], err
    assert not (tmp_path / "run").exists()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    import datasets

    def no_network(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'tiny-org/missing' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    with pytest.raises(UsageError, match=r"^eval.path: could not download 'tiny-org/missing:x@dev' \(ConnectionError: "
                                         r"Couldn't reach 'tiny-org/missing' on the Hub .*; give ORG/NAME"):
        hub.fetch(hub.parse("tiny-org/missing:x@dev"), "eval.path")
    hub.fetch(hub.parse("tiny-org/addition@test"), "data.path")  # cached: nothing to download


def test_a_run_on_a_hub_dataset_is_the_run_on_its_local_copy(cache, assets, shared_runs, tmp_path, capsys):
    """The shared config's data as a cached hub dataset: its first step equals shared_runs.one's."""
    rows = [json.loads(x) for x in assets["data"].read_text().splitlines() if x.strip()]
    lay_out(cache, "tiny-org/shared", "default", {"train": [rows]})
    run = tmp_path / "run"
    code, out, err = evenrl_here(capsys, "train", *shared_args(assets), "data.path=tiny-org/shared@train",
                                 "train.steps=1", f"log.run_dir={run}")
    assert code == 0, err
    got, want = metrics(run), metrics(shared_runs.one)
    assert got[0]["eval/reward"] == want[0]["eval/reward"]  # the greedy eval before the first step
    for key in ("reward/mean", "reward/std", "response/length_mean", "advantage/abs_mean"):
        assert got[1][key] == want[1][key], key


def test_from_writes_the_hub_id_and_reads_it_where_it_is_cached(cache, tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main config=examples/config.yaml \\\n"
                      "    data.train_files=tiny-org/addition@train data.prompt_key=problem\n")
    code, out, err = evenrl_here(capsys, "plan", "--from", "easyr1", script)
    assert "data.train_files=tiny-org/addition@train" in out and "-> data.path=tiny-org/addition@train" in out, out
    assert "dataset 7 rows" in out
    trl = tmp_path / "grpo.yaml"
    trl.write_text("model_name_or_path: /no/model\ndataset_name: tiny-org/multi\ndataset_config: socratic\n"
                   "dataset_prompt_column: problem\nnum_train_epochs: 1\n")
    code, out, err = evenrl_here(capsys, "plan", "--from", "trl", trl)
    assert "-> data.path=tiny-org/multi:socratic@train" in out, out
    missing = tmp_path / "missing.sh"
    missing.write_text(script.read_text().replace("tiny-org/addition", "tiny-org/missing"))
    code, out, err = evenrl_here(capsys, "plan", "--from", "easyr1", missing, "--write-config", tmp_path / "w.yaml")
    assert "the Hugging Face dataset tiny-org/missing@train, not in this machine's datasets cache" in out, out
    assert "not on this machine: " in out and "data.path=tiny-org/missing@train" in out
    assert load_config(str(tmp_path / "w.yaml")).data.path == "tiny-org/missing@train"
