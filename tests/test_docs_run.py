"""The docs run as written: every shell block of README.md and docs/*.md marked runnable (an HTML comment
`<!-- runnable -->` on the line before its fence) is run from the repository root, each command in bash, with this
checkout's `evenrl`; it must exit 0, or N when the marker says `<!-- runnable exit=N -->`. A block written as
a transcript (`$ command` followed by what it prints, stdout and stderr) must print those lines, in that order (a transcript may leave
lines out, marked nowhere, but not change one). Only cheap commands are marked (plans: no model loads), so the whole
check takes a few seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!-- runnable(?: exit=(\d+))? -->")


def runnable_blocks() -> list[tuple[str, int, int, list[str]]]:
    """(file, line of the fence, the exit code its commands end with, the block's lines) of every marked block."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            m = MARK.fullmatch(line.strip())
            if m:
                assert i + 1 < len(lines) and lines[i + 1].startswith("```"), f"{doc.name}:{i + 1}: a mark, no block"
                end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
                out.append((doc.relative_to(ROOT).as_posix(), i + 2, int(m.group(1) or 0), lines[i + 2:end]))
    return out


def commands(block: list[str]) -> list[tuple[str, list[str]]]:
    """(command, the output lines the doc quotes after it) of a block: a transcript's `$ ...` lines, or every line
    of a plain block; `\\` continues a command on the next line."""
    transcript = any(line.startswith("$ ") for line in block)
    out, i = [], 0
    while i < len(block):
        line = block[i]
        if transcript and not line.startswith("$ "):
            out[-1][1].append(line)
            i += 1
            continue
        cmd = line[2:] if transcript else line
        while cmd.rstrip().endswith("\\") and i + 1 < len(block):
            i += 1
            cmd = cmd.rstrip()[:-1] + " " + block[i].strip()
        i += 1
        if cmd.strip() and not cmd.lstrip().startswith("#"):
            out.append((cmd, []))
    return out


BLOCKS = runnable_blocks()


def test_runnable_blocks_are_marked():
    """The marker is in use (a renamed or dropped marker would make the test below check nothing)."""
    assert len(BLOCKS) >= 3, BLOCKS


@pytest.mark.parametrize("doc, line, code, block", BLOCKS, ids=[f"{d}:{n}" for d, n, _, _ in BLOCKS])
def test_a_runnable_block_runs_as_written(doc, line, code, block, tmp_path):
    shim = tmp_path / "bin" / "evenrl"  # `evenrl` is this checkout's, whatever is installed
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m evenrl.cli \"$@\"\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for cmd, quoted in commands(block):
        proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        where = f"{doc}:{line}: {cmd}"
        assert proc.returncode == code, f"{where}: exit {proc.returncode}, not {code}\n{proc.stderr[-2000:]}"
        got = [x.rstrip() for x in (proc.stdout + proc.stderr).splitlines()]
        at = 0
        for want in (x.rstrip() for x in quoted):
            assert want in got[at:], f"{where}: prints no line {want!r} (after line {at})\n" + "\n".join(got)
            at = got.index(want, at) + 1
