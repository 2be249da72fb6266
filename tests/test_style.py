"""The layout is the formatter's and the linter's (pyproject.toml), not a line count's: a lesson
that is long once formatted holds something that is not its lesson."""

import ast
import subprocess
import sys

import pytest
from conftest import ROOT

LESSONS = sorted(p.name for p in ROOT.glob("*.py") if p.name != "ddp_common.py")
# The numbered lessons; every other top-level module is shared or a lesson's companion.
NUMBERED = [
    "ddp_minimal",
    "ddp_mnist",
    "ddp_training",
    "multi_gpu_torchrun",
    "multinode",
    "gpt2_ddp",
    "ddp_benchmark",
    "ddp_knobs",
    "ddp_debug",
]
SHARED = {"ddp_common", "ddp_checkpoint", "ddp_extras"}


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


def course_imports(module):
    """The course's own modules that MODULE imports."""
    ours = {p.stem for p in ROOT.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse((ROOT / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module)
    return found & ours


def test_the_helper_is_small_and_stands_alone():
    """ddp_common.py holds what every lesson needs and nothing else (~180 lines aimed at)."""
    assert course_imports("ddp_common") == set()
    lines = len((ROOT / "ddp_common.py").read_text().splitlines())
    assert lines <= 210, f"ddp_common.py: {lines} lines: what not every lesson needs goes elsewhere"


def test_lessons_import_the_shared_modules_and_their_own_companions_only():
    """A lesson never imports another lesson, and a companion module belongs to one lesson."""
    companions = {p.stem for p in ROOT.glob("*.py")} - SHARED - set(NUMBERED)
    owners = {name: [] for name in companions}
    for lesson in NUMBERED:
        imported = course_imports(lesson)
        assert not imported & set(NUMBERED), f"{lesson} imports another lesson"
        for name in imported & companions:
            owners[name].append(lesson)
    for name, lessons in owners.items():
        assert len(lessons) == 1, f"companion {name} is imported by {lessons or 'no lesson'}"
