"""Lessons 3 and 4 under a real Slurm: slurm/train.sbatch (one torchrun per node) and
slurm/train_srun.sbatch (one srun task per rank, each mapping SLURM_* to RANK/LOCAL_RANK/WORLD_SIZE)
on a 2-node allocation, on CPU with gloo: the rank layout, a crashing rank, and a preempted job
that requeues itself and ends as if never stopped.

The session fixture (`slurm` in conftest) starts a two-node Slurm on this machine with
tests/slurm_cluster.sh, which installs munge and Slurm with apt-get if missing (root), and stops it
at the end. It does so only when asked: DDP_COURSE_SLURM=1, or CI=true. Otherwise these tests skip
with one line saying so; asked for and impossible (not root, no apt-get), they fail."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, assert_ok, cpu_env, error_lines, flat_tensors, run, run_torchrun

from multinode import params_sha256

SMALL = ["--samples", "1024", "--batch-size", "32", "--log-every", "1000"]
SCRIPTS = {"train.sbatch": "torchrun", "train_srun.sbatch": "slurm"}
# multinode.py plus the tests' fault injection and report (--crash-rank, --crash-at, --report).
FAULTS = "tests/multinode_faults.py"
# A job is still under way in these states (REQUEUED: on its way back to PENDING).
UNDER_WAY = (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED")


def submit(slurm, tmp_path, script, *args, options=(), ddp_timeout=60):
    """sbatch [options] from the repo root (so the job finds the .venv); returns (job id, output
    file)."""
    out = tmp_path / "job.out"
    env = cpu_env(DDP_TIMEOUT=ddp_timeout, **slurm)
    # --time: should a job hang anyway, Slurm itself ends it (a killed test would not). 10 min, so
    # that the scripts' warning signal (120-180 s before the limit) never reaches a test job.
    r = run(
        ["sbatch", "--time=10", "--output", out, *options, ROOT / "slurm" / script, *args],
        timeout=60,
        env=env,
    )
    assert_ok(r)
    return re.search(r"Submitted batch job (\d+)", r.stdout)[1], out


def job_fields(slurm, job):
    show = subprocess.run(
        ["scontrol", "-o", "show", "job", job],
        env=cpu_env(**slurm),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return dict(f.split("=", 1) for f in show.split() if "=" in f)


def wait_job(slurm, job, out, timeout, until=None):
    """Poll the job every 0.2 s (sbatch --wait polls every 2 s: seconds per job) until it has ended
    or, with `until`, its output holds that text. Returns the job's fields (JobState, ExitCode,
    Restarts...). Past the timeout the job is cancelled and the test fails: it never hangs."""
    deadline = time.monotonic() + timeout
    fields = {}
    while time.monotonic() < deadline:
        fields = job_fields(slurm, job)
        # (MinJobAge=5 keeps a finished job visible to scontrol for 5 s)
        if fields.get("JobState") not in UNDER_WAY:
            return fields
        if until and out.exists() and until in out.read_text():
            return fields
        time.sleep(0.2)
    subprocess.run(["scancel", job], env=cpu_env(**slurm), timeout=30)
    output = ""
    if out.exists():
        output = out.read_text()[-3000:]
    waited_for = "to end"
    if until:
        waited_for = f"to print {until!r}"
    pytest.fail(
        f"job {job} still {fields.get('JobState')} after {timeout}s, waiting {waited_for}\n"
        f"--- job output\n{output}"
    )


def job_result(fields):
    """The job's exit code: Slurm's ExitCode, or 1 if it did not end COMPLETED."""
    return int(fields["ExitCode"].split(":")[0]) or int(fields["JobState"] != "COMPLETED")


def sbatch(slurm, tmp_path, script, *args, ddp_timeout=60, timeout=300):
    """Submit, wait for the job to end; returns (exit code, job output)."""
    job, out = submit(slurm, tmp_path, script, *args, ddp_timeout=ddp_timeout)
    fields = wait_job(slurm, job, out, timeout)
    output = ""
    if out.exists():
        output = out.read_text()
    return job_result(fields), output


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
    code, output = sbatch(
        slurm,
        tmp_path,
        script,
        FAULTS,
        *SMALL,
        "--epochs",
        "2",
        "--checkpoint-dir",
        ckpt,
        "--report",
        report,
    )
    assert code == 0, output[-3000:]
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
    code, output = sbatch(
        slurm,
        tmp_path,
        script,
        FAULTS,
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
    assert code != 0, output
    assert "error: rank 3 crashed on purpose" in output
    assert not any(line.startswith("done:") for line in output.splitlines())
    # Preemption handling must not requeue a job that failed on its own.
    assert "requeue:" not in output
    assert elapsed < 240, f"the job took {elapsed:.0f} s to fail"


# Lesson 3 on 2 ranks: 2 epochs of 32 steps. --step-delay keeps the job training for 13 s or
# more, so that the signal sent once training has started arrives before it ends.
LESSON3 = ["--samples", "512", "--batch-size", "8", "--epochs", "2", "--hidden", "16"]
# One rank on each node (the tests above check the layout of two): the options a user would pass
# to sbatch to shrink a job; one CPU per rank, as in the uninterrupted run.
ONE_RANK_PER_NODE = {
    "train.sbatch": ["--gpus-per-node=1", "--cpus-per-task=1"],
    "train_srun.sbatch": ["--ntasks-per-node=1", "--gpus-per-node=1"],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Lesson 3's final weights after the same run on 2 ranks, never interrupted (torchrun on
    this machine: the world size, not the launcher, decides the arithmetic)."""
    ckpt = tmp_path_factory.mktemp("uninterrupted")
    r = run_torchrun(
        "multi_gpu_torchrun.py", *LESSON3, "--checkpoint-dir", ckpt, nproc=2, timeout=240
    )
    assert_ok(r)
    return load_weights(ckpt)


def load_weights(ckpt):
    snapshot = torch.load(ckpt / "snapshot.pt", map_location="cpu", weights_only=True)
    return flat_tensors(snapshot["model"])


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_preempted_job_requeues_itself_and_ends_as_if_never_stopped(
    slurm, tmp_path, script, uninterrupted
):
    """Slurm's warning signal mid-run (what --signal=B:USR1@120 sends before the time limit):
    the batch shell passes it on, lesson 3 snapshots and exits, the job requeues itself, resumes
    from the snapshot and ends with the uninterrupted run's weights, bit for bit."""
    ckpt = tmp_path / "ckpt"
    job, out = submit(
        slurm,
        tmp_path,
        script,
        "multi_gpu_torchrun.py",
        *LESSON3,
        "--step-delay",
        "0.2",
        "--checkpoint-dir",
        ckpt,
        options=ONE_RANK_PER_NODE[script],
    )
    fields = wait_job(slurm, job, out, timeout=240, until="start:")
    assert fields.get("JobState") == "RUNNING", (fields.get("JobState"), out.read_text()[-3000:])
    subprocess.run(
        ["scancel", "--signal=USR1", "--batch", job], env=cpu_env(**slurm), check=True, timeout=30
    )
    fields = wait_job(slurm, job, out, timeout=300)
    output = out.read_text()
    assert job_result(fields) == 0 and fields["Restarts"] == "1", (fields, output[-4000:])
    stopped = re.search(r"^preempted: signal SIGUSR1 \| step (\d+)/(\d+) \|", output, re.M)
    assert stopped and 0 < int(stopped[1]) < int(stopped[2]), output[-4000:]
    assert "requeue: job" in output and "requeued 1 times" in output, output[-4000:]
    assert re.search(r"^resumed: ", output, re.M), output[-4000:]
    assert sum(line.startswith("done:") for line in output.splitlines()) == 1, output[-4000:]
    weights = load_weights(ckpt)
    assert weights.keys() == uninterrupted.keys()
    differ = [k for k in weights if not torch.equal(weights[k], uninterrupted[k])]
    assert not differ, f"weights differ from the uninterrupted run: {differ}"


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
        text.strip()
        for text in (ROOT / "slurm" / script).read_text().splitlines()
        if text.strip().startswith(line)
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
