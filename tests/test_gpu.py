"""The GPU paths the CPU suite cannot reach (NCCL, fused optimizers, bf16, fp16 + GradScaler,
torch.compile, ZeRO save and resume with fused AdamW, SyncBatchNorm, comm hooks, lesson 9 on
CUDA streams): tests/gpu_check.sh runs every lesson a few steps on CUDA. Here it runs when a GPU
is visible and skips otherwise; on every machine, every flag and name the script uses must exist,
so that the next GPU machine finds a script that runs."""

import re
import subprocess

import pytest
import torch
from conftest import ROOT

SCRIPT = (ROOT / "tests" / "gpu_check.sh").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(560)
def test_every_lesson_runs_its_gpu_paths():
    result = subprocess.run(
        ["bash", ROOT / "tests" / "gpu_check.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "FAIL" not in result.stdout and "gpu_check: 0 failed" in result.stdout


def commands():
    """Each command of the script as one line: the array definitions expanded, continuations
    joined."""
    text = SCRIPT.replace("\\\n", " ")
    arrays = dict(re.findall(r"^(\w+)=\((.*)\)$", text, re.M))
    for name, body in arrays.items():
        text = text.replace(f'"${{{name}[@]}}"', body)
    return [line for line in text.splitlines() if re.match(r"\s*(check|expect) ", line)]


def flags_of(script):
    """The flags a lesson's parser knows: its file and the course modules it imports."""
    files = [ROOT / script]
    for module in re.findall(r"^from (\w+) import|^import (\w+)$", files[0].read_text(), re.M):
        name = (module[0] or module[1]) + ".py"
        if (ROOT / name).exists():
            files.append(ROOT / name)
    text = "".join(f.read_text() for f in files)
    return set(re.findall(r'add_argument\(\s*"(--[a-z][a-z0-9-]*)"', text))


def test_every_check_names_code_that_exists():
    """Each lesson the script runs exists and knows every flag it is given; each name the
    inline Python imports exists. (The old script called gpt2_ddp.LMHeadLoss after it had
    moved to gpt2_model: the GPU run failed, and nothing here had said so.)"""
    used = commands()
    assert len(used) >= 15, used
    lessons = {p.name for p in ROOT.glob("*.py")}
    for line in used:
        words = line.split()
        scripts = [w for w in words if w in lessons]
        for script in scripts[:1]:
            after = words[words.index(script) + 1 :]
            unknown = {w for w in after if w.startswith("--")} - flags_of(script)
            assert not unknown, f"{script} has no {sorted(unknown)}: {line.strip()[:120]}"
    for module, names in re.findall(r"^from (\w+) import (.+)$", SCRIPT, re.M):
        imported = __import__(module)
        for name in names.split(","):
            assert hasattr(imported, name.strip()), f"{module} has no {name.strip()}"


@pytest.mark.parametrize("lesson", ["ddp_training.py", "gpt2_ddp.py", "ddp_knobs.py"])
def test_the_checks_cover_each_lessons_gpu_flags(lesson):
    """The flags that only matter on a GPU are run there at least once."""
    text = " ".join(line for line in commands() if lesson in line)
    for flag in {"--amp", "--compile", "--zero"} & flags_of(lesson):
        assert flag in text, f"gpu_check.sh never runs {lesson} {flag}"
