"""Never accept what cannot run: bad input is one line on stderr naming the field or file, exit code 2, no
traceback, nothing written; and `evenrl plan` never calls runnable what `evenrl train` refuses.

One group per class of bad input:
  config values that validate but poison the run (NaN, inf, true for a number, betas AdamW refuses, seeds torch
  refuses), from both `plan` and `train`;
  YAML that expands without bound (aliases, nesting, size), from files, overrides and peers' configs;
  broken input files (model directory, dataset), from `train` (nothing written) and `plan` (exit 1 or 2);
  a broken checkpoint under --resume, and a broken metrics.jsonl under `evenrl report`.
Everything runs in this process through evenrl.cli.main (tests/e2e.py evenrl_here), except one proof through
`python -m evenrl.cli`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from e2e import ENV, evenrl_here
from evenrl.demo import write_addition_data
from evenrl.testing import make_tiny_model


def lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.strip()]


def refused(code: int, err: str, needle: str) -> str:
    """Exit 2, exactly one non-empty stderr line holding `needle`, no traceback; returns the line."""
    assert code == 2, err
    assert "Traceback" not in err, err
    got = lines(err)
    assert len(got) == 1, err
    assert needle in got[0], (needle, got[0])
    return got[0]


def tree(path: Path) -> dict | None:
    """What lies under `path` (relative name -> size, mtime), None when it does not exist: equal before and after
    a refused command means nothing was written."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    model = Path(make_tiny_model(str(root / "model"), hidden=16, layers=1, heads=2))
    data = root / "add.jsonl"
    write_addition_data(data)
    return model, data


class Case:
    """Copies of the tiny model and data to break, and a config that trains on them into `run`."""

    def __init__(self, base, root: Path):
        self.model = Path(shutil.copytree(base[0], root / "model"))
        self.data = root / "add.jsonl"
        shutil.copy(base[1], self.data)
        self.run = root / "run"
        self.cfg = root / "cfg.yaml"
        self.write_cfg()

    def write_cfg(self, **extra) -> None:
        cfg = {"model": {"path": str(self.model)},
               "data": {"path": str(self.data), "prompts_per_step": 4, "max_prompt_tokens": 16},
               "rollout": {"samples_per_prompt": 2, "max_new_tokens": 2},
               "train": {"steps": 1, "token_cap_per_micro_batch": 64},
               "log": {"run_dir": str(self.run), "progress": False, "tensorboard": False}}
        for section, values in extra.items():
            cfg[section] = {**cfg.get(section, {}), **values}
        self.cfg.write_text(json.dumps(cfg))  # JSON is YAML


@pytest.fixture
def case(base, tmp_path) -> Case:
    return Case(base, tmp_path)


def test_the_unbroken_case_trains(case, capsys):
    """The fixture is sound: every refusal below comes from the one thing each case breaks."""
    code, out, err = evenrl_here(capsys, "plan", case.cfg)
    assert code == 0, out + err
    code, out, err = evenrl_here(capsys, "train", case.cfg)
    assert code == 0, err
    assert (case.run / "metrics.jsonl").exists() and (case.run / "final").is_dir()


# ------------------------------------------------------------------------------------ 1. values that poison a run

POISON = [
    ("data.prompts_per_step=true", "data.prompts_per_step"),  # pydantic's lax mode read it as 1
    ("rollout.samples_per_prompt=false", "rollout.samples_per_prompt"),
    ("rewards.functions=[{name: exact_match, weight: .nan}]", "rewards.functions.0.weight"),
    ("algo.kl_coef=.inf", "algo.kl_coef"),
    ("algo.entropy_coef=nan", "algo.entropy_coef"),  # the text 'nan', which float() reads
    ("train.lr=1e999", "train.lr"),  # overflows to inf
    ("train.betas=[0.9, 1.0]", "train.betas"),  # AdamW: "Invalid beta parameter at index 1"
    ("train.betas=[-0.1, 0.999]", "train.betas"),
    ("train.betas=[true, 0.999]", "train.betas"),
    ("parallel.capacity_weights=[true, 1]", "parallel.capacity_weights"),
    ("train.seed=18446744073709551616", "train.seed"),  # torch.manual_seed: Overflow when unpacking long
    ('log.run_dir="runs/a\\0b"', "log.run_dir"),  # a NUL in a path: mkdir raises ValueError
]


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("override, needle", POISON, ids=[p[0] for p in POISON])
def test_poisonous_values_are_refused(case, capsys, command, override, needle):
    refused(*evenrl_here(capsys, command, case.cfg, override)[::2], needle)
    assert tree(case.run) is None


@pytest.mark.parametrize("command", ["plan", "train"])
def test_poisonous_value_in_the_file(case, capsys, command):
    case.cfg.write_text(case.cfg.read_text().replace('"max_new_tokens": 2', '"max_new_tokens": 2, "temperature": .nan'))
    line = refused(*evenrl_here(capsys, command, case.cfg)[::2], "rollout.temperature")
    assert str(case.cfg) in line
    assert tree(case.run) is None


# ------------------------------------------------------------------------------------ 2. YAML without bound

def laughs(levels: int = 10, width: int = 10) -> str:
    """'Billion laughs': each level lists the previous one `width` times; 10 x 10 is 10**10 values, in 600 bytes."""
    out = [f"l0: &l0 [{', '.join(['ha'] * width)}]"]
    out += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(out) + "\n"


BOMBS = {
    "laughs": (laughs(), "more than 100,000 values"),
    "deep": ("model: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than 64 levels"),
    "deep-by-aliases": ("a: &a " + "[" * 40 + "1" + "]" * 40 + "\nb: &b " + "[" * 40 + "*a" + "]" * 40 + "\n",
                        "nested deeper than 64 levels"),
    "recursive": ("model: &m {path: *m}\n", "recursive aliases are not allowed"),
    "long-text": ("a: &a '" + "x" * 200_000 + "'\nb: [" + ", ".join(["*a"] * 40) + "]\n", "characters of text"),
    "huge-file": ("# " + "x" * (1024**2 + 10) + "\n", "larger than 1,048,576 bytes"),
    "huge-integer": ("train: {seed: " + "9" * 5000 + "}\n", "a value cannot be read"),
}


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("name", list(BOMBS))
def test_yaml_bombs_are_refused_quickly(case, tmp_path, capsys, command, name):
    text, needle = BOMBS[name]
    bomb = tmp_path / f"{name}.yaml"
    bomb.write_text(text)
    t0 = time.perf_counter()
    line = refused(*evenrl_here(capsys, command, bomb)[::2], needle)
    assert time.perf_counter() - t0 < 2.0
    assert str(bomb) in line


@pytest.mark.parametrize("framework", ["verl", "trl"])
def test_peer_configs_are_read_with_the_same_bounds(tmp_path, capsys, framework):
    bomb = tmp_path / "peer.yaml"
    bomb.write_text(laughs())
    t0 = time.perf_counter()
    line = refused(*evenrl_here(capsys, "plan", "--from", framework, bomb)[::2], "more than 100,000 values")
    assert time.perf_counter() - t0 < 2.0 and str(bomb) in line


def test_openrlhf_flag_values_are_read_with_the_same_bounds(tmp_path, capsys):
    value = "[" * 100 + "]" * 100
    cmd = tmp_path / "train.sh"
    cmd.write_text(f"python3 -m openrlhf.cli.train_ppo_ray --actor_num_gpus_per_node 4 --bad '{value}'\n")
    refused(*evenrl_here(capsys, "plan", "--from", "openrlhf", cmd)[::2], "--bad: nested deeper than 64 levels")


@pytest.mark.parametrize("command", ["plan", "train"])
def test_override_bombs_are_refused_quickly(case, capsys, command):
    bomb = "[&a [x, x, x, x, x, x, x, x, x, x]" + "".join(
        f", &{b} [{', '.join([f'*{a}'] * 10)}]" for a, b in zip("abcdefgh", "bcdefghi")) + "]"
    t0 = time.perf_counter()
    refused(*evenrl_here(capsys, command, case.cfg, f"data.extra_fields={bomb}")[::2],
            "override data.extra_fields: more than 100,000 values")
    assert time.perf_counter() - t0 < 2.0
    assert tree(case.run) is None


def test_billion_laughs_from_the_real_entry_point(tmp_path):
    """The same refusal through `python -m evenrl.cli` in a fresh process: time and memory stay small."""
    bomb = tmp_path / "laughs.yaml"
    bomb.write_text(laughs())
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "evenrl.cli", "plan", str(bomb)], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert time.perf_counter() - t0 < 10.0  # interpreter start included
    refused(proc.returncode, proc.stderr, "more than 100,000 values")


# ------------------------------------------------------------------------------------ 3. broken input files

def truncate_weights(c: Case) -> None:
    f = c.model / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def empty_weights(c: Case) -> None:
    (c.model / "model.safetensors").write_bytes(b"")


def no_weights(c: Case) -> None:
    (c.model / "model.safetensors").unlink()


def no_tokenizer(c: Case) -> None:
    (c.model / "tokenizer.json").unlink()
    (c.model / "tokenizer_config.json").unlink()


def tokenizer_config_only(c: Case) -> None:  # transformers builds a tokenizer of 4 special tokens from it
    (c.model / "tokenizer.json").unlink()


def special_tokens_only(c: Case) -> None:
    f = c.model / "tokenizer.json"
    tok = json.loads(f.read_text())
    tok["model"]["vocab"] = {t: i for t, i in tok["model"]["vocab"].items() if i < 4}
    f.write_text(json.dumps(tok))


def edit_config(**changes):
    def edit(c: Case) -> None:
        f = c.model / "config.json"
        f.write_text(json.dumps({**json.loads(f.read_text()), **changes}))
    return edit


def config_text(text: str):
    def edit(c: Case) -> None:
        (c.model / "config.json").write_text(text)
    return edit


def no_model_type(c: Case) -> None:
    f = c.model / "config.json"
    cfg = json.loads(f.read_text())
    del cfg["model_type"]
    f.write_text(json.dumps(cfg))


def data_line(text: str):
    def edit(c: Case) -> None:
        rows = c.data.read_text().splitlines()
        rows.insert(2, text)
        c.data.write_text("\n".join(rows) + "\n")
    return edit


def parquet_without_prompt(c: Case) -> None:
    c.data = c.data.with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "1+1=", "answer": "2"}] * 8), str(c.data))
    c.write_cfg()


def parquet_prompt_not_text(c: Case) -> None:
    c.data = c.data.with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": i, "answer": "2"} for i in range(8)]), str(c.data))
    c.write_cfg()


def eval_line(c: Case) -> None:
    bad = c.data.with_name("eval.jsonl")
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n[1, 2]\n')
    c.write_cfg(eval={"path": str(bad)})


BROKEN = [
    (truncate_weights, "model.safetensors: truncated"),
    (empty_weights, "model.safetensors: empty (0 bytes)"),
    (no_weights, "no weights (model.safetensors"),
    (no_tokenizer, "no tokenizer files"),
    (tokenizer_config_only, "no tokenizer files"),
    (special_tokens_only, "tokenizer.json: the vocabulary holds only the 4 special tokens"),
    (edit_config(model_type="nosuchmodel"), "config.json: model_type 'nosuchmodel' is not a causal LM"),
    (edit_config(model_type="t5"), "config.json: model_type 't5' is not a causal LM"),
    (no_model_type, 'config.json: no "model_type"'),
    (config_text("{not json"), "config.json: not valid JSON"),
    (config_text("[1, 2]"), "config.json: top level is a list"),
    (data_line("{oops"), "add.jsonl line 3: not valid JSON"),
    (data_line('["1+1=", "2"]'), "add.jsonl line 3: a JSON list; expected a JSON object"),
    (data_line('{"question": "1+1=", "answer": "2"}'), "add.jsonl line 3: no field 'prompt'"),
    (parquet_without_prompt, "add.parquet: no column 'prompt' (data.prompt_field)"),
    (parquet_prompt_not_text, "add.parquet: column 'prompt' (data.prompt_field) holds int64; expected text"),
    (eval_line, "eval.jsonl line 2: a JSON list"),
]


@pytest.mark.parametrize("breaks, needle", BROKEN, ids=[b[0].__qualname__.split(".")[0] + f"-{i}"
                                                        for i, b in enumerate(BROKEN)])
def test_broken_inputs_are_refused_before_anything_is_written(case, capsys, breaks, needle):
    breaks(case)
    refused(*evenrl_here(capsys, "train", case.cfg)[::2], needle)
    assert tree(case.run) is None
    # plan parity: what train refuses, plan does not call runnable
    code, out, err = evenrl_here(capsys, "plan", case.cfg)
    assert code in (1, 2), out
    assert needle in (out.replace("\n" + " " * 10, " ") if code == 1 else err), out + err


def test_sft_refuses_the_same_inputs(case, capsys):
    truncate_weights(case)
    refused(*evenrl_here(capsys, "sft", case.cfg)[::2], "model.safetensors: truncated")
    assert tree(case.run) is None


# ------------------------------------------------------------------------------------ 4. --resume, report

def checkpoint_with(c: Case, meta: str, trainer: bytes = b"") -> Path:
    """A run directory holding a checkpoint step-000001 whose meta.json is `meta`."""
    step = c.run / "checkpoints" / "step-000001"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(meta)
    (step / "trainer.pt").write_bytes(trainer)
    (c.run / "checkpoints" / "latest").write_text("step-000001\n")
    (c.run / "metrics.jsonl").write_text('{"step": 1}\n')
    return step


CHECKPOINTS = [
    ("{not json", "meta.json: not valid JSON"),
    ('{"time": 1.0}', 'meta.json: no "step" field'),
    ('[1]', "meta.json: top level is a list"),
    ('{"step": "one"}', "meta.json: step is 'one'; expected a whole number"),
    ('{"step": 7}', "meta.json: step is 7 but the directory is step-000001"),
    ('{"step": 1}', "trainer.pt: unreadable checkpoint"),
]


@pytest.mark.parametrize("meta, needle", CHECKPOINTS, ids=[c[1].split(":")[1].strip()[:20] for c in CHECKPOINTS])
def test_resume_from_a_broken_checkpoint(case, capsys, meta, needle):
    checkpoint_with(case, meta)
    before = tree(case.run)
    refused(*evenrl_here(capsys, "train", case.cfg, "--resume")[::2], needle)
    assert tree(case.run) == before


REPORTS = [
    ('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.\n', "metrics.jsonl line 2: not valid JSON"),
    ('{"step": 1}\n\n[2]\n', "metrics.jsonl line 3: a JSON list"),
    ('{"reward/mean": 0.5}\n', 'metrics.jsonl line 1: "step" is None'),
    ('{"step": "2"}\n', "metrics.jsonl line 1: \"step\" is '2'"),
]


@pytest.mark.parametrize("text, needle", REPORTS, ids=["json", "list", "no-step", "text-step"])
def test_report_on_a_broken_metrics_file(tmp_path, capsys, text, needle):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(text)
    before = tree(run)
    refused(*evenrl_here(capsys, "report", run)[::2], needle)
    assert tree(run) == before


def test_report_draws_every_phase_integer_ranks_and_no_flat_kl(tmp_path, capsys, monkeypatch):
    """Phases come from the rows (`advantage` was missing from a fixed list), rank ticks are whole numbers, and
    with KL off the KL panel shows the policy drift alone and says why."""
    import matplotlib.axes

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "kl": 0.0, "policy/approx_kl": 1e-3 * s, "time/rollout": 0.1, "time/advantage": 0.01,
             "time/new_phase": 0.02, "time/step": 0.2, "load/rank_tokens": [10, 12, 9]} for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: dict[str, list] = {}
    titles: list[str] = []
    ticks: list = []
    orig_plot, orig_title, orig_ticks = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.set_title, \
        matplotlib.axes.Axes.set_xticks

    def plot(self, *a, **k):
        drawn.setdefault(k.get("label"), []).append(a)
        return orig_plot(self, *a, **k)

    def set_title(self, title, *a, **k):
        titles.append(title)
        return orig_title(self, title, *a, **k)

    def set_xticks(self, t, *a, **k):
        ticks.append(list(t))
        return orig_ticks(self, t, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", set_title)
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", set_xticks)
    code, out, err = evenrl_here(capsys, "report", run)
    assert code == 0, err
    assert {"rollout", "advantage", "new_phase", "whole step"} <= set(drawn)
    assert "kl" not in drawn and "policy/approx_kl" in drawn
    assert any("KL to a reference" in t and "off" in t for t in titles)
    assert [0, 1, 2] in ticks
    assert {p.name for p in (run / "plots").glob("*.png")} == {"kl.png", "phases.png", "rank_load.png"}


def test_a_model_that_passes_the_file_checks_but_has_no_vocabulary(case, monkeypatch):
    """load_policy's last line of defence: a tokenizer of special tokens only is refused even when the torch-free
    file checks are skipped."""
    from evenrl.errors import UsageError
    from evenrl.models import loading

    tokenizer_config_only(case)
    monkeypatch.setattr(loading, "check_model_dir", lambda path: None)
    with pytest.raises(UsageError, match="none of them ordinary") as e:
        loading.load_policy(str(case.model))
    assert "\n" not in str(e.value) and str(case.model) in str(e.value)


def test_vocab_json_alone_must_hold_a_vocabulary(case, capsys):
    no_tokenizer(case)
    (case.model / "vocab.json").write_text("{}")
    (case.model / "merges.txt").write_text("")
    refused(*evenrl_here(capsys, "train", case.cfg)[::2], "vocab.json: the vocabulary is empty")
    assert evenrl_here(capsys, "plan", case.cfg)[0] == 1
    assert os.path.exists(case.model / "vocab.json")


# ------------------------------------------------------------------------------------ 5. the run directory

def symlink_loop(c: Case) -> str:
    (c.run.parent / "loop").symlink_to(c.run.parent / "loop")
    return str(c.run.parent / "loop")


def dangling_symlink(c: Case) -> str:
    (c.run.parent / "dangling").symlink_to(c.run.parent / "nowhere" / "run")
    return str(c.run.parent / "dangling")


RUN_DIRS = [
    (lambda c: "/proc/evenrl_run", "log.run_dir: /proc/evenrl_run cannot be created"),
    (lambda c: str(c.run.parent / ("x" * 5000)), "a name of 5,000 bytes"),
    (lambda c: str(c.run.parent / "/".join(["y" * 200] * 25)), "bytes as an absolute path"),
    (symlink_loop, "is a symlink loop"),
    (dangling_symlink, "which does not exist"),
    (lambda c: "", "log.run_dir: got ''"),
    (lambda c: ".", "is the current directory"),
    (lambda c: "..", "is above the current directory"),
]


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("run_dir, needle", RUN_DIRS, ids=["proc", "long-name", "long-path", "loop", "dangling",
                                                          "empty", "cwd", "parent"])
def test_a_run_directory_that_cannot_hold_a_run_is_refused_before_anything_loads(case, capsys, monkeypatch,
                                                                                  run_dir, needle, processes):
    """One line, exit 2, from N processes as from one (the launcher speaks for its workers), from sft too, nothing
    written: a file system that makes no directories, names past the system's limits, symlinks that lead nowhere,
    the current directory or above it (where --overwrite would delete the user's files)."""
    monkeypatch.chdir(case.model)  # the current directory, for "." and ".."
    d = run_dir(case)
    before = sorted(os.listdir(case.run.parent)), tree(case.model)
    more = ["--nproc-per-node", "2"] if processes == 2 else []
    refused(*evenrl_here(capsys, "train", case.cfg, f"log.run_dir={d}", *more)[::2], needle)
    if processes == 1:
        refused(*evenrl_here(capsys, "sft", case.cfg, f"log.run_dir={d}")[::2], needle)
    assert (sorted(os.listdir(case.run.parent)), tree(case.model)) == before
