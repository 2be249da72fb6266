"""The course's shape (../shared/DESIGN.md): the layout is ruff's (pyproject.toml); each lesson's
READING SET (the lesson plus every course module it imports but ddp_common.py and gpt2_model.py)
stays within its budget, as do its flags, its functions and its README section; ddp_common.py
is the one shared module and stays small. The files are counted as they are: the ruff check
above keeps them formatted, so nothing can be packed to meet a number."""

import ast
import re
import subprocess
import sys

import pytest
from conftest import ROOT

# lesson: (reading set, its own file, flags), from DESIGN.md's table.
BUDGETS = {
    "ddp_minimal": (150, 150, 5),
    "ddp_mnist": (220, 220, 8),
    "ddp_training": (650, 350, 20),
    "multi_gpu_torchrun": (380, 380, 14),
    "multinode": (380, 380, 14),
    "gpt2_ddp": (300, 300, 18),
    "ddp_benchmark": (450, 300, 16),
    "ddp_knobs": (400, 300, 14),
    "ddp_debug": (260, 260, 14),
    "ddp_from_scratch": (250, 250, 8),
}
# Read beside a lesson but not counted in its reading set (DESIGN.md).
EXEMPT = {"ddp_common", "gpt2_model"}
# The one-process script lesson 1 starts from: a lesson's companion, read with the README's diff.
BESIDE = {"mnist_single": "ddp_mnist"}


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


def lines(module):
    return len((ROOT / f"{module}.py").read_text().splitlines())


def course_imports(module):
    """The course's own modules that MODULE imports."""
    ours = {p.stem for p in ROOT.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse((ROOT / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return (found & ours) - {module}


def reading_set(lesson):
    seen, todo = set(), [lesson]
    while todo:
        for module in course_imports(todo.pop()) - seen - EXEMPT:
            seen.add(module)
            todo.append(module)
    return seen


@pytest.mark.parametrize("lesson", [name for name in BUDGETS if (ROOT / f"{name}.py").exists()])
def test_a_lesson_reads_in_one_sitting(lesson):
    reading, own, flag_budget = BUDGETS[lesson]
    modules = reading_set(lesson)
    total = lines(lesson) + sum(lines(m) for m in modules)
    assert lines(lesson) <= own, f"{lesson}.py: {lines(lesson)} lines (budget {own})"
    assert total <= reading, f"{lesson}: reading set {total} lines over {modules} ({reading})"
    text = "".join((ROOT / f"{m}.py").read_text() for m in [lesson, *modules])
    flags = set(re.findall(r'add_argument\(\s*"(--[a-z][a-z0-9-]*)"', text))
    assert len(flags) <= flag_budget, f"{lesson}: {len(flags)} flags (budget {flag_budget})"


def test_functions_do_one_job():
    """<= 50 lines a function (parse_args is bounded by the flags; lesson 0 is one listing)."""
    long = []
    for path in ROOT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name != "parse_args":
                size = node.end_lineno - node.lineno + 1
                if size > 50 and path.name != "ddp_minimal.py":
                    long.append(f"{path.name}:{node.lineno} {node.name} ({size} lines)")
    assert not long, long


def test_the_helper_is_small_and_stands_alone():
    """ddp_common.py holds what every lesson needs and nothing else."""
    assert course_imports("ddp_common") == set()
    assert lines("ddp_common") <= 150, "ddp_common.py: what not every lesson needs goes elsewhere"


def test_one_shared_module_and_a_companion_belongs_to_one_lesson():
    """A lesson never imports another lesson; any other module is ONE lesson's companion."""
    lessons = [name for name in BUDGETS if (ROOT / f"{name}.py").exists()]
    owners = {}
    for lesson in lessons:
        imported = course_imports(lesson)
        assert not imported & set(lessons), f"{lesson} imports another lesson"
        for module in imported - {"ddp_common"}:
            owners.setdefault(module, []).append(lesson)
    for module in {p.stem for p in ROOT.glob("*.py")} - set(lessons) - {"ddp_common"}:
        if module in BESIDE:
            continue
        assert len(owners.get(module, [])) == 1, f"{module} is imported by {owners.get(module)}"


def test_readme_lesson_sections_are_short():
    """A lesson's README section: what you will learn, the command, the real output, the DDP
    lines; depth goes to docs/."""
    text = (ROOT / "README.md").read_text().splitlines()
    heads = [i for i, line in enumerate(text) if line.startswith("## ")] + [len(text)]
    for start, end in zip(heads, heads[1:], strict=False):
        if re.match(r"## Lesson \d", text[start]):
            assert end - start <= 120, f"{text[start]}: {end - start} lines"


def test_each_lesson_that_resumes_has_a_checkpoint_folder_of_its_own():
    """`--resume auto` (and lesson 3's restarts) take whatever last.pt the folder holds: a learner
    who runs the README's lessons in order in one directory must not resume lesson 4 from the
    file lesson 2 left there (it fails to load: another model)."""
    folders = {}
    for module in BUDGETS:
        source = (ROOT / f"{module}.py").read_text()
        for node in ast.walk(ast.parse(source)):
            flag = isinstance(node, ast.Call) and node.args and node.args[0]
            if isinstance(flag, ast.Constant) and flag.value == "--checkpoint-dir":
                default = next(k.value.value for k in node.keywords if k.arg == "default")
                if "--resume" in source or "TORCHELASTIC_RESTART_COUNT" in source:
                    folders[module] = default
    assert len(folders) >= 5, folders
    assert len(set(folders.values())) == len(folders), folders
