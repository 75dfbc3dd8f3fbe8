"""The docs that are generated from code stay in sync with it."""

import re
from pathlib import Path

from evenrl.config import describe

ROOT = Path(__file__).resolve().parents[1]


def test_compatibility_page_is_current():
    from evenrl.config.compatibility import markdown

    assert (ROOT / "docs" / "compatibility.md").read_text() == markdown(), \
        "docs/compatibility.md is stale: regenerate it with python -m evenrl.config.compatibility > docs/compatibility.md"


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


def test_readme_stays_short():
    """A newcomer reads the README in five minutes; everything else lives in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/ (at most 150)"


def test_relative_links_and_images_resolve():
    """Every relative link and image in README.md and docs/*.md points at a file that exists and, with `#anchor`, at
    a heading of that file (GitHub's slugs: lower case, punctuation dropped, spaces as hyphens)."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = target.partition("#")
            if "://" in path:
                continue
            file = page.parent / path if path else page
            if not file.exists() or (anchor and anchor not in _slugs(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "broken links: " + ", ".join(broken)


def _slugs(page: Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}
