"""The README is executable: every ```bash block runs as printed (with the `# cpu:` flags the
README gives for machines without GPUs), and its worked example is checked numerically."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_common
from conftest import ROOT, cpu_env, init_spawned, run, spawn

README = (ROOT / "README.md").read_text()
TEST_COMMAND = ". .venv/bin/activate && python -m pytest -q"


def bash_blocks(text):
    """Each ```bash block as a script; a `# cpu: FLAGS` line appends FLAGS to the line above."""
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = []
        for line in body.splitlines():
            m = re.match(r"\s*# cpu:(.*)", line)
            if m and lines:
                lines[-1] = lines[-1].rstrip() + " " + m.group(1).strip()
            else:
                lines.append(line)
        blocks.append("\n".join(lines).strip())
    return blocks


BLOCKS = bash_blocks(README)


def block_id(script):
    first = next(l for l in script.splitlines() if l.strip() and not l.startswith("#"))
    return first[:60]


def test_readme_has_commands_and_the_test_command_is_what_ci_runs():
    assert len(BLOCKS) >= 8
    assert TEST_COMMAND in BLOCKS
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def needs_slurm(script):
    return re.search(r"\b(sbatch|srun|salloc)\b", script) is not None


@pytest.fixture
def repo_copy(tmp_path):
    """A copy of the repository (what git tracks), sharing this venv, so commands that write
    ./data, ./checkpoints or snapshots do not touch the working tree."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in files or [p.name for p in ROOT.glob("*.py")]:
        if (ROOT / f).is_file():
            (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tmp_path / f)
    venv = ROOT / ".venv"
    if venv.is_dir():
        os.symlink(venv, tmp_path / ".venv")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("script", [b for b in BLOCKS if b != TEST_COMMAND], ids=block_id)
def test_readme_command_runs_as_printed(script, repo_copy, request):
    slurm_env = request.getfixturevalue("slurm") if needs_slurm(script) else {}  # real Slurm
    cwd = repo_copy
    if "python3 -m venv .venv" in script:
        # The set-up command (re)creates ./.venv: run it in the repository itself, against the
        # venv the tests run from (venv will not build into a symlink); pip then finds
        # everything installed. Its ./data and ./checkpoints are git-ignored.
        if not (ROOT / ".venv").is_dir() or Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
            pytest.skip("the tests do not run from ./.venv, so the set-up command would build a new one")
        cwd = ROOT
    bin_dir = os.path.dirname(sys.executable)
    env = cpu_env(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH="",
                  https_proxy="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9")
    env.update(slurm_env)
    result = run(["bash", "-euo", "pipefail", "-c", script], timeout=400, env=env, cwd=cwd)
    assert result.returncode == 0, (f"README command failed (exit {result.returncode}):\n{script}\n"
                                    f"--- stdout\n{result.stdout[-2500:]}\n--- stderr\n{result.stderr[-2500:]}")


def _worked_example(rank, world_size, port, out):
    init_spawned(rank, world_size, port)
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, t = [(1.0, 3.0), (2.0, 0.0)][rank]
    loss = 0.5 * (model(torch.tensor([[x]])) - t).pow(2).sum()
    loss.backward()
    grad = model.module.weight.grad.item()
    opt.step()
    result = [None] * world_size
    dist.all_gather_object(result, (grad, model.module.weight.item()))
    if rank == 0:
        torch.save(result, out)
    ddp_common.cleanup()


def test_worked_example_of_gradient_averaging(tmp_path):
    spawn(_worked_example, 2, str(tmp_path / "r.pt"))
    (g0, w0), (g1, w1) = torch.load(tmp_path / "r.pt")
    assert g0 == g1 == pytest.approx(1.0)  # (-2 + 4) / 2
    assert w0 == w1 == pytest.approx(0.9)
    # one process with both samples and the mean loss: the same gradient and step
    w = torch.ones(1, 1, requires_grad=True)
    x, t = torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [0.0]])
    (0.5 * (x @ w - t).pow(2)).mean().backward()
    assert w.grad.item() == pytest.approx(1.0) and 1 - 0.1 * w.grad.item() == pytest.approx(0.9)
    assert "w = 1 − 0.1 · 1 = 0.9" in README and "(−2 + 4) / 2 = 1" in README


def code_part(line):
    """A line without its trailing comment and surrounding blanks ('#' inside strings is rare in
    the excerpts; a line that is only a comment becomes empty)."""
    return re.sub(r"\s+#.*$|^#.*$", "", line.strip()).strip()


EXCERPTS = [(m.group(1), m.group(2)) for m in re.finditer(r"```python (\S+)\n(.*?)```", README, re.S)]


def test_every_code_excerpt_names_its_file():
    untagged = re.findall(r"```python\n(.*?)```", README, re.S)
    assert not untagged, f"a ```python block must name its file (```python FILE): {untagged[0][:200]}"
    assert len(EXCERPTS) >= 6


@pytest.mark.parametrize("name,body", EXCERPTS, ids=[e[0] for e in EXCERPTS])
def test_code_excerpts_stay_in_step_with_the_files(name, body):
    """Each code line of an excerpt (comments aside; `...` stands for omitted code) appears in the
    file it names, so the README cannot drift from the lessons. Whitespace and line breaks are
    folded, so an excerpt may join a statement the file wraps."""
    source = " ".join(c for c in (code_part(l) for l in (ROOT / name).read_text().splitlines()) if c)
    source = re.sub(r"\s+", " ", source)
    for line in body.splitlines():
        code = re.sub(r"\s+", " ", code_part(line))
        if not code or code == "...":
            continue
        pattern = r".{0,300}?".join(re.escape(part.strip()) for part in code.split("..."))
        assert re.search(pattern, source), f"README excerpt line not found in {name}: {line.strip()}"
