import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evenrl.errors import UsageError
from evenrl.data.prompts import filter_by_length, load_prompts
from evenrl.train.data import PromptSampler

RECORDS = [
    {"question": "1+2=", "solution": "3", "level": 1},
    {"question": "10+20=", "solution": 30, "level": 2},
    {"question": "7*6=", "solution": "42", "level": 3},
]


def write_jsonl(path, records, blank_lines=False):
    lines = [json.dumps(r) for r in records]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n")
    return str(path)


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    j = write_jsonl(tmp_path / "p.jsonl", RECORDS, blank_lines=True)
    p = write_parquet(tmp_path / "p.parquet", [dict(r, solution=str(r["solution"])) for r in RECORDS])
    kw = dict(prompt_field="question", answer_field="solution", extra_fields=["level"])
    rows_j, rows_p = load_prompts(j, **kw), load_prompts(p, **kw)
    assert rows_j[0] == {"prompt": "1+2=", "answer": "3", "id": 0, "level": 1}
    assert [r["id"] for r in rows_j] == [0, 1, 2]
    assert rows_j[1]["answer"] == 30  # kept as stored
    assert [(r["prompt"], str(r["answer"]), r["level"]) for r in rows_j] == [
        (r["prompt"], r["answer"], r["level"]) for r in rows_p
    ]


def test_default_fields_and_no_answer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b", "other": 1}])
    assert load_prompts(path) == [{"prompt": "a", "answer": "b", "id": 0}]
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "a"}])
    assert load_prompts(path, answer_field=None) == [{"prompt": "a", "answer": None, "id": 0}]


def test_directory_of_files_in_name_order(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "b.jsonl", RECORDS[2:])
    write_parquet(d / "a.parquet", [dict(r, solution=str(r["solution"])) for r in RECORDS[:2]])
    (d / "README.md").write_text("ignored")
    rows = load_prompts(str(d), prompt_field="question", answer_field="solution")
    assert [(r["id"], r["prompt"]) for r in rows] == [(0, "1+2="), (1, "10+20="), (2, "7*6=")]


def one_line_error(fn, *words):
    with pytest.raises(UsageError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_errors_name_file_and_field(tmp_path):
    j = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    one_line_error(lambda: load_prompts(str(tmp_path / "missing.jsonl")), "missing.jsonl")
    one_line_error(lambda: load_prompts(j), "p.jsonl", "'prompt'", "question")  # default field absent
    one_line_error(lambda: load_prompts(j, prompt_field="question"), "p.jsonl", "'answer'")
    one_line_error(lambda: load_prompts(j, prompt_field="question", answer_field="solution", extra_fields=["x"]),
                   "p.jsonl", "'x'")
    one_line_error(lambda: load_prompts(j, prompt_field="level", answer_field="solution"), "'level'", "string")
    (tmp_path / "empty.jsonl").write_text("\n")
    one_line_error(lambda: load_prompts(str(tmp_path / "empty.jsonl")), "empty.jsonl", "no rows")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "b"}\n{oops\n')
    one_line_error(lambda: load_prompts(str(tmp_path / "bad.jsonl")), "bad.jsonl", "line 2")
    (tmp_path / "x.csv").write_text("prompt,answer\n")
    one_line_error(lambda: load_prompts(str(tmp_path / "x.csv")), "x.csv", ".jsonl")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    one_line_error(lambda: load_prompts(str(tmp_path / "junk.parquet")), "junk.parquet")
    (tmp_path / "emptydir").mkdir()
    one_line_error(lambda: load_prompts(str(tmp_path / "emptydir")), "emptydir")
    one_line_error(lambda: load_prompts(j, extra_fields=["id"]), "extra_fields")


TYPED = [dict(r, solution=str(r["solution"])) for r in RECORDS]  # Arrow columns hold one type


def write_save_to_disk(d, records, split=None):
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow stream file(s) listed in state.json."""
    target = d / split if split else d
    target.mkdir(parents=True)
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(target / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (target / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (target / "dataset_info.json").write_text("{}")
    if split:
        (d / "dataset_dict.json").write_text(json.dumps({"splits": [split]}))


def test_hf_save_to_disk_dir_reads_without_datasets(tmp_path):
    write_save_to_disk(tmp_path / "hf", TYPED)
    rows = load_prompts(str(tmp_path / "hf"), prompt_field="question", answer_field="solution")
    assert [r["prompt"] for r in rows] == [r["question"] for r in TYPED]
    write_save_to_disk(tmp_path / "dd", TYPED, split="train")
    assert len(load_prompts(str(tmp_path / "dd"), prompt_field="question", answer_field="solution")) == 3
    write_save_to_disk(tmp_path / "test_only", TYPED, split="test")
    one_line_error(lambda: load_prompts(str(tmp_path / "test_only")), "train")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "state.json").write_text("{}")
    (broken / "dataset_info.json").write_text("{}")
    one_line_error(lambda: load_prompts(str(broken)), "broken")


def test_hf_save_to_disk_matches_the_datasets_library(tmp_path):
    import datasets  # in the test extra: the real library writes the directory our reader reads
    datasets.Dataset.from_list(TYPED).save_to_disk(str(tmp_path / "real"))
    rows = load_prompts(str(tmp_path / "real"), prompt_field="question", answer_field="solution")
    assert [r["answer"] for r in rows] == [r["solution"] for r in TYPED]



def test_filter_by_length_skips_and_counts():
    rows = [{"id": i} for i in range(5)]
    kept, skipped = filter_by_length(rows, [3, 9, 4, 5, 10], max_prompt_tokens=5)
    assert [r["id"] for r in kept] == [0, 2, 3] and skipped == 2
    assert filter_by_length(rows, [1] * 5, 0) == ([], 5)
    with pytest.raises(ValueError):
        filter_by_length(rows, [1], 5)


def test_sampler_epochs_are_permutations_and_deterministic():
    s = PromptSampler(7, seed=3)
    draws = s.next_prompts(7 * 3 + 2)
    for e in range(3):
        assert sorted(draws[7 * e : 7 * e + 7]) == list(range(7))
    assert draws[0:7] != draws[7:14]  # a fresh order each epoch
    assert PromptSampler(7, seed=3).next_prompts(23) == draws
    assert PromptSampler(7, seed=4).next_prompts(23) != draws
    # Batch size does not matter, only how many were drawn.
    t = PromptSampler(7, seed=3)
    assert t.next_prompts(5) + t.next_prompts(0) + t.next_prompts(11) + t.next_prompts(7) == draws
    assert s.state_dict() == {"seed": 3, "n_rows": 7, "epoch": 3, "position": 2}


def test_sampler_resume_continues_exactly():
    a = PromptSampler(10, seed=1)
    a.next_prompts(13)
    state = json.loads(json.dumps(a.state_dict()))  # survives a checkpoint round trip
    expected = a.next_prompts(25)
    b = PromptSampler(10, seed=1)
    b.load_state_dict(state)
    assert b.next_prompts(25) == expected
    with pytest.raises(UsageError, match="n_rows"):
        PromptSampler(9, seed=1).load_state_dict(state)
    with pytest.raises(UsageError):
        PromptSampler(0, seed=1)
