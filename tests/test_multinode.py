"""Lesson 4 on one machine: two torchrun "nodes" (--nnodes=2) on 127.0.0.1, with c10d and with
static rendezvous; per-node snapshots and resume; a run stopped inside an epoch and resumed; a
worker killed on one node and the job restarted across both; launch_ddp.sh.

The runs that need a crashing rank or a report start tests/multinode_faults.py (multinode.py with
test hooks) where a user would start multinode.py."""

import hashlib
import json
import os
import re
import shutil
import sys

import pytest
import torch
from conftest import (
    ROOT,
    assert_ok,
    cpu_env,
    error_lines,
    free_port,
    run,
    run_nodes,
    run_python,
    spawn,
    torchrun_env,
)

from multinode import params_sha256

FAULTS = "tests/multinode_faults.py"
SMALL = ["--samples", "1024", "--batch-size", "32", "--log-every", "1000"]


def torchrun_node(node_args, *script_args, nproc=2):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--nproc-per-node={nproc}",
        *node_args,
        ROOT / FAULTS,
        *SMALL,
        *script_args,
    ]


def check_two_node_report(report, per_node):
    """2 nodes, per_node ranks each: global rank = node * per_node + local rank; all replicas
    identical."""
    world = 2 * per_node
    assert (report["world_size"], report["nodes"], report["launcher"]) == (world, 2, "torchrun")
    rows = report["ranks"]
    assert [r["rank"] for r in rows] == list(range(world))
    assert [(r["node"], r["local_rank"]) for r in rows] == [
        divmod(r, per_node) for r in range(world)
    ]
    assert all(r["device"] == "cpu" for r in rows)
    assert len({r["pid"] for r in rows}) == world
    assert len(set(report["params_sha256"])) == 1, report["params_sha256"]


def snapshot_sha(path):
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return ckpt["epoch"], params_sha256(ckpt["model"])


def file_sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def launch_env():
    """launch_ddp.sh finds torchrun in the venv (or runs PYTHON -m torch.distributed.run)."""
    return cpu_env(PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", PYTHON=sys.executable)


# 512 samples / 2 ranks / batch 32: 8 steps per epoch; rank 1 dies at step 12, in epoch 2.
RESTART_RUN = ["--samples", "512", "--batch-size", "32", "--log-every", "1000", "--epochs", "3"]


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
    """launch_ddp.sh on one node (2 processes): the uninterrupted run of RESTART_RUN, which the
    restarted two-node job and the run stopped and resumed inside an epoch must end equal to.
    Its report."""
    out = tmp_path_factory.mktemp("single_node")
    r = run(
        [
            "bash",
            ROOT / "launch_ddp.sh",
            "--nproc",
            "2",
            FAULTS,
            *RESTART_RUN,
            "--checkpoint-dir",
            out,
            "--report",
            out / "r.json",
        ],
        timeout=180,
        env=launch_env(),
    )
    assert_ok(r)
    report = json.loads((out / "r.json").read_text())
    assert snapshot_sha(out / "multinode.pt") == (3, report["params_sha256"][0])
    return report


@pytest.mark.slow
def test_two_nodes_restart_after_a_worker_is_killed(tmp_path, single_node):
    """Two nodes of one worker each (2 ranks: a sum of two gradients does not depend on the
    order, so resumed and uninterrupted runs end bit-identical). Rank 1, on node 1, is SIGKILLed
    in epoch 2. Node 1's agent counts a restart; node 0's agent, whose worker may still look
    healthy, re-joins through a membership change without counting one. Both must meet again
    (launch_ddp.sh gives torchrun a fresh store per attempt), resume from their own node-local
    snapshot of epoch 1, and end with the weights of an uninterrupted run."""
    port, report = free_port(), tmp_path / "report.json"
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    nodes = [
        [
            "bash",
            ROOT / "launch_ddp.sh",
            "--nnodes",
            "2",
            "--nproc",
            "1",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "restart",
            "--max-restarts",
            "1",
            FAULTS,
            *RESTART_RUN,
            "--snapshot-per-node",
            "--checkpoint-dir",
            dirs[n],
            "--resume",
            "auto",
            "--report",
            report,
            "--crash-rank",
            "1",
            "--crash-at",
            "12",
        ]
        for n in (0, 1)
    ]
    results = run_nodes(nodes, tmp_path, timeout=180, env=launch_env())
    for r in results:
        assert_ok(r)
    assert sum("error: rank 1 crashed on purpose" in r.stderr for r in results) == 1
    rep = json.loads(report.read_text())
    assert rep["world_size"] == 2 and rep["nodes"] == 2 and len(set(rep["params_sha256"])) == 1
    assert (rep["start_epoch"], rep["epoch"]) == (1, 3)  # the restart resumed from epoch 1
    expected = single_node["params_sha256"][0]  # the same job uninterrupted, on one node
    assert rep["params_sha256"][0] == expected
    assert [snapshot_sha(d / "multinode.pt") for d in dirs] == [(3, expected)] * 2


@pytest.mark.slow
def test_two_nodes_c10d_then_static_resume_from_node_local_snapshots(tmp_path):
    """Epoch 1 under c10d rendezvous (the same command on both 'nodes', 2 workers each, node
    ranks handed out by the rendezvous) into one shared dir; then each node's disk gets a copy and
    epoch 2 runs under static rendezvous (--node-rank, --master-addr; 1 worker per node: a
    snapshot taken at an epoch end resumes under another world size) with node-local dirs."""
    report, shared = tmp_path / "report.json", tmp_path / "shared"
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=t1"]
    results = run_nodes(
        [torchrun_node(rdzv, "--epochs", "1", "--checkpoint-dir", shared, "--report", report)] * 2,
        tmp_path,
    )
    for r in results:
        assert_ok(r)
    done = [line for r in results for line in r.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1  # only global rank 0 prints
    rep = json.loads(report.read_text())
    check_two_node_report(rep, per_node=2)
    assert rep["start_epoch"] == 0
    # rank 0 alone wrote the snapshot (shared dir), and it holds the replicas' final weights
    assert snapshot_sha(shared / "multinode.pt") == (1, rep["params_sha256"][0])
    assert os.listdir(shared) == ["multinode.pt"]

    port, dirs = free_port(), [tmp_path / "node0", tmp_path / "node1"]
    for d in dirs:  # each node's own disk holds a copy of epoch 1
        d.mkdir()
        shutil.copy(shared / "multinode.pt", d / "multinode.pt")

    def launch(epochs):
        return run_nodes(
            [
                torchrun_node(
                    [f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={port}"],
                    "--epochs",
                    epochs,
                    "--checkpoint-dir",
                    dirs[n],
                    "--resume",
                    "auto",
                    "--report",
                    report,
                    "--snapshot-per-node",
                    nproc=1,
                )
                for n in (0, 1)
            ],
            tmp_path,
        )

    for r in launch(2):  # both nodes resume from their own copy
        assert_ok(r)
    rep = json.loads(report.read_text())
    check_two_node_report(rep, per_node=1)
    assert (rep["start_epoch"], rep["epoch"]) == (1, 2)
    # local rank 0 of EACH node saved into its own directory
    assert [snapshot_sha(d / "multinode.pt") for d in dirs] == [(2, rep["params_sha256"][0])] * 2

    # Node 1's disk lost its snapshot (or the dir was never shared): resuming must stop, not let
    # node 1 silently train from epoch 0 while node 0 continues from epoch 2.
    (dirs[1] / "multinode.pt").unlink()
    results = launch(3)
    assert all(r.returncode != 0 for r in results)
    errors = [line for r in results for line in error_lines(r)]
    assert sum("different snapshots" in line for line in errors) == 1, errors
    assert not (dirs[1] / "multinode.pt").exists()
    assert snapshot_sha(dirs[0] / "multinode.pt")[0] == 2  # untouched


def _main_as_torchrun_worker(rank, world_size, port, flags):
    """In a spawned process: multinode.main() with the environment torchrun would give it."""
    torchrun_env(rank, world_size, port)
    sys.argv = ["multinode.py", *RESTART_RUN, *map(str, flags)]
    import multinode

    multinode.main()


@pytest.mark.slow
def test_stopped_inside_an_epoch_resumes_where_it_stopped(tmp_path, single_node):
    """RESTART_RUN (8 steps per epoch) on 2 ranks: --max-steps 11 stops inside epoch 2.
    `--resume PATH` with another --checkpoint-dir finishes: PATH was only read (its bytes did not
    change), the run saved to its own --checkpoint-dir, and the weights equal the uninterrupted
    run's, bit for bit (no batch skipped, none repeated). One process may not take over the
    stopped epoch: another world size cuts the rest of it into other shards. The two-rank runs
    are spawned (the processes torchrun would start, without the agent's start-up)."""
    first, second = tmp_path / "first", tmp_path / "second"
    spawn(_main_as_torchrun_worker, 2, ["--max-steps", "11", "--checkpoint-dir", first])
    stopped = first / "multinode.pt"
    before = file_sha256(stopped)
    spawn(_main_as_torchrun_worker, 2, ["--resume", stopped, "--checkpoint-dir", second])
    assert file_sha256(stopped) == before, "--resume PATH rewrote its input"
    assert os.listdir(first) == ["multinode.pt"]
    assert snapshot_sha(second / "multinode.pt") == (3, single_node["params_sha256"][0])

    one_rank = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1}
    env = cpu_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), **one_rank)
    r = run_python(
        "multinode.py", *RESTART_RUN, "--resume", "auto", "--checkpoint-dir", first, env=env
    )
    assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr[-2000:]
    assert "same world size" in error_lines(r)[0] and "Traceback" not in r.stderr
    assert file_sha256(stopped) == before


def launch_sh(*args, env=None):
    return run(["bash", ROOT / "launch_ddp.sh", *args], timeout=60, env=env)


def fake_nvidia_smi(folder, gpus):
    """A stand-in nvidia-smi listing `gpus` GPUs (0: fails, like a machine without a driver)."""
    folder.mkdir()
    lines = "".join(f"echo 'GPU {i}: Fake (UUID: GPU-{i})'\n" for i in range(gpus))
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\n{lines}" + ("exit 9\n" if gpus == 0 else ""))
    (folder / "nvidia-smi").chmod(0o755)
    env = cpu_env(PATH=f"{folder}:{os.environ['PATH']}")
    del env["CUDA_VISIBLE_DEVICES"]  # a GPU machine: every GPU visible
    return env


def test_launch_ddp_help_and_dry_run(tmp_path):
    r = launch_sh("--help")
    assert r.returncode == 0 and "--rdzv-endpoint" in r.stdout and "--slurm" in r.stdout
    r = launch_sh("--dry-run", "multinode.py", env=fake_nvidia_smi(tmp_path / "gpu3", 3))
    assert r.returncode == 0 and "--standalone --nproc-per-node=3 multinode.py" in r.stderr
    env = fake_nvidia_smi(tmp_path / "nogpu", 0)  # no GPU: 2 CPU processes
    cases = {
        (
            "multinode.py",
            "--epochs",
            "1",
        ): "--standalone --nproc-per-node=2 multinode.py --epochs 1",
        (
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "h0",
            "multinode.py",
            "--x",
            "a b",
        ): "--nnodes=2 --nproc-per-node=2 --node-rank=1 --master-addr=h0 --master-port=29500 "
        "multinode.py --x a\\ b",
        (
            "--nnodes",
            "3",
            "--nproc",
            "4",
            "--rdzv-endpoint",
            "h0",
            "multinode.py",
        ): "--nnodes=3 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=h0:29400 "
        "--rdzv-id=ddp-course multinode.py",
        (
            "--slurm",
            "--nnodes",
            "4",
            "multinode.py",
        ): f"sbatch --nodes=4 {ROOT}/slurm/train.sbatch multinode.py",
        (
            "--slurm-srun",
            "--nproc",
            "8",
            "multinode.py",
        ): f"sbatch --ntasks-per-node=8 {ROOT}/slurm/train_srun.sbatch multinode.py",
    }
    for args, expected in cases.items():
        r = launch_sh("--dry-run", *args, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stderr.strip().splitlines()[-1].endswith(expected), (args, r.stderr)
    r = launch_sh("--dry-run", "--debug", "multinode.py", env=env)
    assert (
        r.returncode == 0
        and "NCCL_DEBUG=INFO" in r.stderr
        and "TORCH_DISTRIBUTED_DEBUG=INFO" in r.stderr
    )
    # torchrun gets a fresh store per restart attempt; --max-restarts reaches torchrun (or sbatch)
    r = launch_sh(
        "--dry-run",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "h0",
        "--max-restarts",
        "2",
        "multinode.py",
        env=env,
    )
    assert "+ export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.stderr.splitlines()
    assert "--max-restarts=2 --nnodes=2" in r.stderr.splitlines()[-1]
    r = launch_sh(
        "--dry-run", "--slurm", "--nproc", "4", "--max-restarts", "2", "multinode.py", env=env
    )
    assert "sbatch --export=ALL\\,NPROC_PER_NODE=4\\,MAX_RESTARTS=2 " in r.stderr.splitlines()[-1]


def test_launch_ddp_counts_only_the_gpus_cuda_visible_devices_allows(tmp_path):
    """nvidia-smi lists all 4 GPUs of the machine; CUDA_VISIBLE_DEVICES may allow fewer."""
    env = fake_nvidia_smi(tmp_path / "gpu4", 4)
    for visible, nproc in [(None, 4), ("0,1", 2), ("1,2,3", 3), ("3", 1), ("", 2)]:  # "": no GPU
        r = launch_sh(
            "--dry-run",
            "multinode.py",
            env=env if visible is None else dict(env, CUDA_VISIBLE_DEVICES=visible),
        )
        assert f"--standalone --nproc-per-node={nproc} multinode.py" in r.stderr, (
            visible,
            r.stderr,
        )


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--bogus", "multinode.py"],
        ["missing.py"],
        ["--nproc", "zero", "multinode.py"],
        ["--nproc"],
        ["--nnodes", "2", "multinode.py"],
        ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "multinode.py"],
        ["--nnodes", "2", "--rdzv-endpoint", "h", "--node-rank", "0", "multinode.py"],
        ["--node-rank", "0", "--master-addr", "h", "multinode.py"],
        ["--slurm", "--master-addr", "h", "multinode.py"],
        ["--max-restarts", "-1", "multinode.py"],
        ["--slurm-srun", "--max-restarts", "1", "multinode.py"],
        # static rendezvous cannot restart a healthy node with a failed one: refused
        ["--dry-run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h"]
        + ["--max-restarts", "1", "multinode.py"],
    ],
)
def test_launch_ddp_usage_errors(args):
    r = launch_sh(*args)
    assert r.returncode == 2
    assert len(error_lines(r)) == 1 and r.stdout == "", r.stderr


@pytest.mark.slow
def test_launch_ddp_single_node_runs(single_node):
    rep = single_node
    assert rep["world_size"] == 2 and rep["nodes"] == 1 and len(set(rep["params_sha256"])) == 1


def test_launch_ddp_guards_every_array_that_may_be_empty():
    """bash <= 4.3 (RHEL/CentOS 7) stops with "unbound variable" under `set -u` when an empty
    array is expanded as "${A[@]}"; bash 4.4+ does not, so running the script here cannot show
    it. Every array that starts empty (A=() or read -a A) must be expanded as
    ${A[@]+"${A[@]}"}, which is empty, not an error, on every bash."""
    lines = (ROOT / "launch_ddp.sh").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    may_be_empty = set(re.findall(r"\b(\w+)=\(\)", text))
    may_be_empty |= set(re.findall(r"read -\w*a\w* (\w+)", text))
    assert "OPTS" in may_be_empty
    for name in may_be_empty:
        # Every ${A[@]} or ${A[*]} must sit inside the guard (a count, ${#A[@]}, is safe).
        uses = re.findall(rf"\$\{{{name}\[[@*]\]", text)
        guarded = re.findall(rf'\$\{{{name}\[@\]\+"\$\{{{name}\[@\]\}}"\}}', text)
        assert len(uses) == 2 * len(guarded), f"unguarded ${{{name}[@]}} in launch_ddp.sh"


def test_bad_flags_are_one_error_line(tmp_path):
    r = run_python("multinode.py", "--epochs", "0")
    assert r.returncode == 2 and len(error_lines(r)) == 1 and "Traceback" not in r.stderr
    assert "--epochs" in r.stderr
    # The test wrapper passes multinode.py's flags on; no launcher: the helper says how to launch.
    r = run_python(FAULTS, "--epochs", "1")
    assert r.returncode == 2 and len(error_lines(r)) == 1 and "Traceback" not in r.stderr
    assert "torchrun" in r.stderr
