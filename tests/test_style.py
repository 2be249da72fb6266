"""The layout is the formatter's and the linter's (pyproject.toml), not a line count's: a lesson
that is long once formatted holds something that is not its lesson."""

import subprocess
import sys

import pytest
from conftest import ROOT

LESSONS = sorted(p.name for p in ROOT.glob("*.py") if p.name != "ddp_common.py")


@pytest.mark.parametrize("command", [["format", "--check", "--diff"], ["check"]])
def test_ruff_passes(command):
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize("name", LESSONS)
def test_a_lesson_reads_in_one_sitting(name):
    """At most ~450 lines as formatted (the check above keeps every file formatted)."""
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= 460, f"{name}: {lines} lines: move what is not its lesson out of it"
