"""Lesson 4 under a real Slurm: slurm/train.sbatch (one torchrun per node) and
slurm/train_srun.sbatch (one srun task per rank, each mapping SLURM_* to RANK/LOCAL_RANK/WORLD_SIZE)
on a 2-node allocation, on CPU with gloo.

The session fixture starts a two-node Slurm on this machine with tests/slurm_cluster.sh (it installs
munge and Slurm with apt-get if missing; needs root) and stops it at the end. Where that is
impossible the tests skip, saying why; with CI=true they fail instead. Outside CI, set
DDP_COURSE_NO_SLURM=1 to skip them rather than install Slurm on your machine."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, assert_ok, cpu_env, error_lines, run

from multinode import params_sha256

SMALL = ["--samples", "1024", "--batch-size", "32", "--log-every", "1000"]
SCRIPTS = {"train.sbatch": "torchrun", "train_srun.sbatch": "slurm"}


def sbatch(slurm, tmp_path, script, *args, ddp_timeout=60, timeout=300):
    """sbatch from the repo root (so the job finds the .venv), then wait for the job; returns
    (result, job output). Like `sbatch --wait` (its exit code is the job's), but polling every
    0.2 s: sbatch --wait polls every 2 s, seconds per job (the README's command uses it)."""
    out = tmp_path / "job.out"
    env = cpu_env(DDP_TIMEOUT=ddp_timeout, **slurm)
    # --time: should a job hang anyway, Slurm itself ends it (a killed test would not).
    r = run(
        ["sbatch", "--time=5", "--output", out, ROOT / "slurm" / script, "multinode.py", *args],
        timeout=60,
        env=env,
    )
    assert_ok(r)
    job = re.search(r"Submitted batch job (\d+)", r.stdout)[1]
    deadline, fields = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        show = subprocess.run(
            ["scontrol", "-o", "show", "job", job],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        fields = dict(f.split("=", 1) for f in show.split() if "=" in f)
        if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break  # (MinJobAge=5 keeps a finished job visible to scontrol for 5 s)
        time.sleep(0.2)
    else:
        subprocess.run(["scancel", job], env=env, timeout=30)
        pytest.fail(f"job {job} still {fields.get('JobState')} after {timeout}s")
    code = int(fields["ExitCode"].split(":")[0]) or int(fields["JobState"] != "COMPLETED")
    result = subprocess.CompletedProcess(r.args, code, r.stdout, r.stderr)
    return result, out.read_text() if out.exists() else ""


def table_rows(output):
    """The rank table rows multinode.py printed: (rank, node, local_rank, slurm_node)."""
    return [
        (int(m[1]), int(m[2]), int(m[3]), m[4])
        for m in re.finditer(
            r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+\S+\s+(node\d)\s+cpu\s+\d+\s*$", output, re.M
        )
    ]


def check_job(report_path, output, launcher):
    """4 ranks on 2 Slurm nodes, 2 each: ranks 0,1 on one node, 2,3 on the other."""
    try:
        _check_job(json.loads(report_path.read_text()), output, launcher)
    except (AssertionError, OSError, ValueError) as e:
        raise AssertionError(f"{type(e).__name__}: {e}\n--- job output\n{output[-4000:]}") from None


def _check_job(report, output, launcher):
    by_node = {}
    for rank, node, local, slurm_node in table_rows(output):
        by_node.setdefault(slurm_node, []).append((rank, node, local))
    assert sorted(by_node) == ["node1", "node2"], by_node
    for rows in by_node.values():
        (r0, n0, l0), (r1, n1, l1) = sorted(rows)
        assert (l0, l1) == (0, 1) and n0 == n1 and (r0, r1) == (2 * n0, 2 * n0 + 1), rows
    assert report["world_size"] == 4 and report["nodes"] == 2 and report["launcher"] == launcher
    assert sorted((r["slurm_node"], r["local_rank"]) for r in report["ranks"]) == [
        ("node1", 0),
        ("node1", 1),
        ("node2", 0),
        ("node2", 1),
    ]
    assert len(set(report["params_sha256"])) == 1, report["params_sha256"]
    assert sum(line.startswith("done:") for line in output.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_sbatch_two_nodes(slurm, tmp_path, script):
    report, ckpt = tmp_path / "report.json", tmp_path / "ckpt"
    r, output = sbatch(
        slurm,
        tmp_path,
        script,
        *SMALL,
        "--epochs",
        "2",
        "--checkpoint-dir",
        ckpt,
        "--report",
        report,
    )
    assert_ok(r)
    assert re.search(r"Submitted batch job \d+", r.stdout)
    check_job(report, output, SCRIPTS[script])
    rep = json.loads(report.read_text())
    snap = torch.load(ckpt / "multinode.pt", map_location="cpu", weights_only=True)
    assert snap["epoch"] == 2 and params_sha256(snap["model"]) == rep["params_sha256"][0]


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_crashing_rank_fails_the_job_fast(slurm, tmp_path, script):
    """Rank 3 dies at start-up, before joining the process group. The other ranks would wait for
    it in init_process_group for the whole 900 s timeout; srun --kill-on-bad-exit=1 must end the
    job at once, with a non-zero exit code."""
    t0 = time.monotonic()
    r, output = sbatch(
        slurm,
        tmp_path,
        script,
        *SMALL,
        "--epochs",
        "2",
        "--crash-rank",
        "3",
        "--crash-at",
        "start",
        "--checkpoint-dir",
        tmp_path / "ckpt",
        ddp_timeout=900,
        timeout=420,
    )
    elapsed = time.monotonic() - t0
    assert r.returncode != 0, output
    assert "error: rank 3 crashed on purpose" in output
    assert not any(line.startswith("done:") for line in output.splitlines())
    assert elapsed < 240, f"the job took {elapsed:.0f} s to fail"


@pytest.mark.slow
def test_bare_srun_is_one_error_line_pointing_at_the_mapping(slurm):
    """srun alone gives each task SLURM_* variables only. The helper does not guess ranks from
    them: every task says, in one line, where the mapping to RANK/LOCAL_RANK/WORLD_SIZE lives
    (slurm/train_srun.sbatch, whose tasks test_sbatch_two_nodes runs)."""
    r = run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", sys.executable, "multinode.py"],
        timeout=120,
        env=cpu_env(**slurm),
    )
    errors = [
        line for line in error_lines(r) if line.startswith("error:")
    ]  # srun adds its own lines
    assert r.returncode == 2 and len(errors) == 2, (r.returncode, r.stderr[-2000:])
    assert all("RANK" in e and "slurm/" in e for e in errors) and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "script,line", [("train.sbatch", "HEAD="), ("train_srun.sbatch", "export MASTER_ADDR=")]
)
def test_first_node_of_the_node_list_comes_from_scontrol(slurm, script, line):
    """The scripts' own line that picks the rendezvous host, run on node lists Slurm writes."""
    [code] = [
        line.strip()
        for line in (ROOT / "slurm" / script).read_text().splitlines()
        if line.strip().startswith(line)
    ]
    var = line.split()[-1].rstrip("=")
    for nodelist, first in [
        ("node1", "node1"),
        ("node[1-2]", "node1"),
        ("a,b", "a"),
        ("gpu[03-05,9],cpu1", "gpu03"),
        ("x-y[7,8]", "x-y7"),
        ("rack[01-02]-node[01-04]", "rack01-node01"),
    ]:
        r = subprocess.run(
            ["bash", "-c", f'{code}\necho "${var}"'],
            capture_output=True,
            text=True,
            env=dict(os.environ, SLURM_JOB_NODELIST=nodelist, **slurm),
            timeout=30,
        )
        assert r.stdout.strip() == first, (nodelist, r.stdout, r.stderr)
