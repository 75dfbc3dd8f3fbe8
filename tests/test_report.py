"""`evenrl report A [B]` on metrics it cannot use: both runs are read and checked before anything is written, and
every value it cannot read (a half-written line, an integer past Python's digit limit or beyond a float, a run
without weights hashes beside one with them) is one line, exit 2, both directories as they were."""

import json
from pathlib import Path

import pytest

from e2e import evenrl_here


def lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def run_dir(root: Path, name: str, rows: list[dict] | None = None, tail: str = "") -> Path:
    d = root / name
    d.mkdir()
    rows = rows if rows is not None else [{"step": s, "reward/mean": 0.1 * s, "weights/hash": f"h{s}"}
                                          for s in range(1, 4)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return d


BROKEN = {  # what B's metrics.jsonl holds -> the line's needle
    "half-written": ('{"step": 4, "reward/mean": 0.', "metrics.jsonl line 4: not valid JSON"),
    "4301 digits": ('{"step": 4, "reward/mean": ' + "9" * 5000 + "}\n", "metrics.jsonl line 4: a value cannot be "
                                                                         "read (Exceeds the limit (4300 digits)"),
    "huge step": ('{"step": ' + "9" * 400 + "}\n", 'metrics.jsonl line 4: "step" is 9999'),
    "beyond a float": ('{"step": 4, "load/rank_tokens": [1, ' + "9" * 400 + "]}\n",
                       'metrics.jsonl line 4: "load/rank_tokens[1]" holds a number too large for a plot'),
    "rounding run": (None, "no step logged weights/hash in both"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_report_refuses_in_one_line_before_writing(tmp_path, capsys, case):
    tail, needle = BROKEN[case]
    a = run_dir(tmp_path, "a")
    b = (run_dir(tmp_path, "b", [{"step": s, "reward/mean": 0.1 * s} for s in range(1, 4)]) if tail is None
         else run_dir(tmp_path, "b", tail=tail))
    before = tree(tmp_path)
    code, out, err = evenrl_here(capsys, "report", a, b)
    assert code == 2 and "Traceback" not in err and out == "", (code, out, err)
    assert len(lines(err)) == 1 and needle in err and len(err) < 400, err
    assert tree(tmp_path) == before  # A's plots were written before B was read
    if tail is not None:  # the same damage in A alone: refused as well
        code, _, err = evenrl_here(capsys, "report", b)
        assert code == 2 and len(lines(err)) == 1 and needle in err and tree(tmp_path) == before, err

