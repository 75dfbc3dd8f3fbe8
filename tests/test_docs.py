"""The docs that are generated from code stay in sync with it."""

from pathlib import Path

from evenrl.config import describe

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_current():
    text = (ROOT / "docs" / "config.md").read_text()
    assert describe() in text, "docs/config.md is stale: regenerate it with python -m evenrl.config"


def test_readme_opens_with_the_two_commands():
    head = (ROOT / "README.md").read_text().splitlines()[:6]
    assert any(line.startswith("make demo") for line in head)
    assert any(line.startswith("make test") for line in head)


def test_ci_runs_make_test_only():
    lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines()
             if x.strip() and not x.strip().startswith("#")]
    assert lines[-1] == "make test"
    assert not any("pytest" in x for x in lines)
