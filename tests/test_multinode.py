"""Lesson 4, multinode.py, on one machine: torchrun "nodes" (--nnodes=2 on 127.0.0.1), each with
its own --data-dir and --checkpoint-dir (node-local disks): the rank layout, data staged per node
and checked, a checkpoint per node, a resume on another world size, a worker killed and the job
restarted across both nodes, a run stopped inside an epoch; launch_ddp.sh; the sbatch scripts'
preemption trap (with a stand-in srun: the real Slurm runs are in test_slurm.py).

Runs that need a crashing rank start tests/multinode_faults.py where a user would start
multinode.py. Runs that fail at start-up are started as srun starts slurm/train_srun.sbatch's
tasks (one process per "node", RANK etc. in its environment), without torchrun's agents."""

import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import (
    ROOT,
    assert_clean_failure,
    assert_ok,
    cpu_env,
    error_lines,
    free_port,
    run,
    run_nodes,
    run_python,
    run_spawned,
)

import multinode

FAULTS = "tests/multinode_faults.py"
# 512 samples, 2 ranks x 32 (a global batch of 64): 8 steps per epoch, 24 in all.
RESTART_RUN = ["--samples", "512", "--batch-size", "32", "--log-every", "1000", "--epochs", "3"]
# The README's command: two "nodes" of 2 processes, each with its own scratch/nodeN.
README = "--rdzv-endpoint 127.0.0.1:29400"


SCHEMA = {"model", "optimizer", "step", "epoch", "global_batch", "world_size", "data"}


def ckpt(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rank_rows(output):
    """The rank table: (rank, node, local_rank, data) per row rank 0 printed."""
    rows = re.findall(
        r"^rank (\d+) \| node (\d+) \| local_rank (\d+) \| host \S+ \| device \S+ \| data (\S+)$",
        output,
        re.M,
    )
    return [(int(r), int(n), int(lr), data) for r, n, lr, data in rows]


def launch_env():
    """launch_ddp.sh finds torchrun in the venv (or runs PYTHON -m torch.distributed.run)."""
    return cpu_env(PATH=f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", PYTHON=sys.executable)


def as_srun_tasks(node_args, tmp_path, script="multinode.py", wrap=None):
    """One process per "node", started the way slurm/train_srun.sbatch's srun starts them; wrap:
    {node: a command prefix} (a shell that sets a limit first)."""
    port = free_port()
    world = len(node_args)
    cmds = [
        (wrap or {}).get(n, [])
        + ["env", f"RANK={n}", "LOCAL_RANK=0", f"WORLD_SIZE={world}", "LOCAL_WORLD_SIZE=1"]
        + [f"SLURM_NODEID={n}", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}"]
        + [sys.executable, ROOT / script, *args]
        for n, args in enumerate(node_args)
    ]
    return run_nodes(cmds, tmp_path, timeout=120)


def one_error_line(results, code=1):
    """Every process failed (with `code`, as a rule), and the job said why in one `error:` line
    (rank 0's), with no traceback. (Seen twice in some 15 runs of this module under load: a rank
    that left by ddp_common.fail() with gloo still up aborted at interpreter teardown, -6.)"""
    codes = [r.returncode for r in results]
    assert code in codes and all(codes), [(r.returncode, r.stderr[-2000:]) for r in results]
    lines = [line for r in results for line in error_lines(r)]
    assert len(lines) == 1 and not any("Traceback" in r.stderr for r in results), lines
    return lines[0]


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
    """RESTART_RUN uninterrupted on 2 ranks of one node (forked: conftest.run_spawned), which the
    restarted two-node job and the run stopped and resumed inside an epoch must end equal to.
    Its last.pt."""
    out = tmp_path_factory.mktemp("single_node")
    args = [*RESTART_RUN, "--data-dir", out / "data", "--checkpoint-dir", out / "ckpt"]
    for r in run_spawned("multinode.py", *args):
        assert_ok(r)
    last = ckpt(out / "ckpt" / "last.pt")
    assert last["step"] == 24 and last["global_batch"] == 64 and last["world_size"] == 2
    # Fused on the CPU too: a checkpoint resumed on a GPU keeps the flag (docs/restarts.md).
    assert all(group["fused"] for group in last["optimizer"]["param_groups"])
    return last


@pytest.mark.slow
def test_two_nodes_stage_their_own_data_and_save_their_own_checkpoint(readme_run):
    """The README's command: c10d rendezvous, two nodes of 2 processes, each node with its own
    scratch dir. The global rank runs over both nodes, the local rank restarts at 0 on each; every
    node's local rank 0 staged the data on its own disk and wrote its own last.pt, and the copies
    are equal; evaluation counted each of the 1001 test samples once."""
    r = readme_run(README)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = rank_rows(r.stdout)
    assert [row[:3] for row in rows] == [(rank, rank // 2, rank % 2) for rank in range(4)]
    assert len({row[3] for row in rows}) == 1 and rows[0][3] != "none"
    assert re.search(r"^done: world 4 \| nodes 2 \| steps 30 \| .*\(\d+/1001\)", r.stdout, re.M)
    scratch = [r.cwd / "scratch" / f"node{n}" for n in (0, 1)]
    data = [ckpt(s / "data" / "points.pt") for s in scratch]
    assert same_weights(*data) and len(data[0]["x_test"]) == 1001
    last = [ckpt(s / "ckpt" / "last.pt") for s in scratch]
    assert [c["step"] for c in last] == [30, 30] and same_weights(
        last[0]["model"], last[1]["model"]
    )
    # The checkpoint names its data: the digest every rank printed.
    assert last[0].keys() == SCHEMA and last[0]["data"] == last[1]["data"] == rows[0][-1]


@pytest.mark.slow
def test_a_static_job_on_another_world_size_resumes_from_each_nodes_own_checkpoint(
    tmp_path, readme_run
):
    """The README job's per-node checkpoints (4 ranks x 64), resumed under static rendezvous on
    2 nodes of 1 rank x 128: the same global batch, so the same samples per step. Each node stages
    the data from a --data-source (shared storage) into its own empty --data-dir. Then node 1
    loses its checkpoint: the next job stops with one line instead of letting node 1 start over
    while node 0 resumes; so it does when node 1 holds another run's file of the same step (its
    own optimizer state would drift from node 0's), or when the data is not what it trained on."""
    done = readme_run(README)
    assert done.returncode == 0, done.stderr[-3000:]
    # Shared storage holds the set as another tool wrote it: float64 features, int32 labels.
    source = tmp_path / "shared" / "points.pt"
    source.parent.mkdir()
    sets = ckpt(done.cwd / "scratch" / "node0" / "data" / "points.pt")
    torch.save({k: t.double() if k[0] == "x" else t.int() for k, t in sets.items()}, source)
    nodes = [tmp_path / f"node{n}" for n in (0, 1)]
    for n, node in enumerate(nodes):
        shutil.copytree(done.cwd / "scratch" / f"node{n}" / "ckpt", node / "ckpt")
    port = free_port()
    cmds = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
        + [f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={port}"]
        + [ROOT / "multinode.py", "--samples", "4004", "--epochs", "3", "--batch-size", "128"]
        + ["--data-source", source, "--data-dir", node / "data"]
        + ["--checkpoint-dir", node / "ckpt", "--resume", "auto"]
        for n, node in enumerate(nodes)
    ]
    results = run_nodes(cmds, tmp_path)
    for r in results:
        assert_ok(r)
    out = results[0].stdout
    assert re.search(r"^resumed: \S+ \| step 30 \| epoch 3/3 \| world 4 -> 2$", out, re.M), out
    assert [row[:3] for row in rank_rows(out)] == [(0, 0, 0), (1, 1, 0)]
    for node in nodes:
        assert (node / "data" / "points.pt").read_bytes() == source.read_bytes()
    last = [ckpt(node / "ckpt" / "last.pt") for node in nodes]
    assert [(c["step"], c["world_size"]) for c in last] == [(45, 2), (45, 2)]
    assert same_weights(last[0]["model"], last[1]["model"])

    # The refusals below: the lesson's main() in ranks forked as two nodes (torchrun's variables).
    (nodes[1] / "ckpt" / "last.pt").unlink()
    args = ["--samples", "4004", "--epochs", "4", "--batch-size", "128", "--resume", "auto"]
    per_node = [[*args, "--data-dir", n / "data", "--checkpoint-dir", n / "ckpt"] for n in nodes]
    line = one_error_line(run_spawned("multinode.py", nodes=per_node))
    assert re.search(
        r"different checkpoints \(step, weights by rank: \[\(45, '\w+'\), None\]", line
    )
    assert ckpt(nodes[0] / "ckpt" / "last.pt")["step"] == 45  # untouched

    other_run = ckpt(nodes[0] / "ckpt" / "last.pt")
    other_run["model"]["0.weight"][0, 0] += 0.5
    torch.save(other_run, nodes[1] / "ckpt" / "last.pt")
    line = one_error_line(run_spawned("multinode.py", nodes=per_node))
    assert re.search(r"by rank: \[\(45, '(\w{12})'\), \(45, '(?!\1)\w{12}'\)\]\)", line), line

    args = ["--samples", "2002", "--epochs", "4", "--batch-size", "256", "--resume", "auto"]
    other_data = [*args, "--data-dir", tmp_path / "other", "--checkpoint-dir", nodes[0] / "ckpt"]
    line = one_error_line(run_spawned("multinode.py", *other_data, nproc=1), code=2)
    assert re.search(r"trained on data (\w{12}), not this run's (?!\1)\w{12}: resume with", line)
    assert ckpt(nodes[0] / "ckpt" / "last.pt")["step"] == 45  # untouched


def test_a_node_without_the_data_or_with_another_copy_stops_the_job_in_one_line(tmp_path):
    """Node 1 cannot stage the --data-source (its disk fills up: a file size limit): its
    --data-dir stays empty, with no partial copy left to fill it further, and it says why. Then
    node 1's --data-dir holds a stale copy (another seed): training would average gradients of
    two datasets. Either way every rank stops, with one line naming each node's copy."""
    source = tmp_path / "shared" / "points.pt"
    source.parent.mkdir()
    torch.save(multinode.make_data(0, 64), source)
    small = ["--epochs", "1", "--batch-size", "8"]
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    full_disk = {1: ["bash", "-c", 'ulimit -f 4 && exec "$@"', "bash"]}  # 4 KiB
    results = as_srun_tasks(
        [[*small, "--data-source", source, "--data-dir", dirs[n]] for n in (0, 1)],
        tmp_path,
        wrap=full_disk,
    )
    line = one_error_line(results)
    assert re.search(r"node 0 \(\S+\): [0-9a-f]{12}; node 1 \(\S+\): none\)", line), line
    assert "warning: staging" in results[1].stderr and "File too large" in results[1].stderr
    assert (dirs[0] / "points.pt").read_bytes() == source.read_bytes()
    assert source.stat().st_size > 4096 and list(dirs[1].iterdir()) == []

    torch.save(multinode.make_data(1, 64), dirs[1] / "points.pt")
    results = as_srun_tasks(
        [[*small, "--data-source", source, "--data-dir", dirs[n]] for n in (0, 1)], tmp_path
    )
    line = one_error_line(results)
    assert re.search(r"node 0 \(\S+\): (\w{12}); node 1 \(\S+\): (?!\1)\w{12}\)", line), line
    assert "empty --data-dir" in line


@pytest.mark.slow
def test_two_nodes_restart_after_a_worker_is_killed(tmp_path, single_node):
    """Two nodes of one worker each (2 ranks: a sum of two gradients does not depend on the
    order, so resumed and uninterrupted runs end bit-identical), each with its own data and
    checkpoint dirs. Rank 1, on node 1, is SIGKILLed at step 12, in epoch 2. Node 1's agent counts
    a restart; node 0's agent re-joins through a membership change. Both must meet again
    (launch_ddp.sh gives torchrun a fresh store per attempt), resume from their own node's
    last.pt of epoch 1 (step 8), and end with the weights of an uninterrupted run."""
    port = free_port()
    nodes = [
        ["bash", ROOT / "launch_ddp.sh", "--nnodes", "2", "--nproc", "1", "--max-restarts", "1"]
        + ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart", FAULTS, *RESTART_RUN]
        + ["--data-dir", tmp_path / f"node{n}" / "data"]
        + ["--checkpoint-dir", tmp_path / f"node{n}" / "ckpt", "--resume", "auto"]
        + ["--crash-rank", "1", "--crash-at", "12"]
        for n in (0, 1)
    ]
    results = run_nodes(nodes, tmp_path, timeout=180, env=launch_env())
    for r in results:
        assert_ok(r)
    assert sum("error: rank 1 crashed on purpose" in r.stderr for r in results) == 1
    out = "".join(r.stdout for r in results)
    assert re.search(r"^resumed: \S+ \| step 8 \| epoch 2/3 \| world 2 -> 2$", out, re.M), out
    for n in (0, 1):
        last = ckpt(tmp_path / f"node{n}" / "ckpt" / "last.pt")
        assert last["step"] == 24 and same_weights(last["model"], single_node["model"]), n


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_stopped_inside_an_epoch_resumes_where_it_stopped(tmp_path, single_node):
    """RESTART_RUN on 2 ranks: --max-steps 11 stops inside epoch 2 and saves step 11.
    `--resume PATH` with another --checkpoint-dir finishes: PATH was only read, the run saved to
    its own --checkpoint-dir, and the weights equal the uninterrupted run's, bit for bit (no
    batch skipped, none repeated). One process with the same --batch-size is another global
    batch: refused in one line. (The runs are forked: the processes torchrun would start, without
    the agent's start-up.)"""
    first, second, data = tmp_path / "first", tmp_path / "second", tmp_path / "data"
    common = [*RESTART_RUN, "--data-dir", data]
    for r in run_spawned("multinode.py", *common, "--max-steps", "11", "--checkpoint-dir", first):
        assert_ok(r)
    stopped = first / "last.pt"
    assert ckpt(stopped)["step"] == 11
    before = sha256(stopped)
    for r in run_spawned("multinode.py", *common, "--resume", stopped, "--checkpoint-dir", second):
        assert_ok(r)
    assert sha256(stopped) == before, "--resume PATH rewrote its input"
    assert os.listdir(first) == ["last.pt"]
    last = ckpt(second / "last.pt")
    assert last["step"] == 24 and same_weights(last["model"], single_node["model"])

    [r] = run_spawned(
        "multinode.py", *common, "--resume", "auto", "--checkpoint-dir", first, nproc=1
    )
    [line] = assert_clean_failure(r, code=2)
    assert "global batch of 64" in line and "1 x 32" in line
    assert sha256(stopped) == before


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


@pytest.mark.slow
def test_launch_ddp_runs_where_the_machine_name_does_not_resolve(tmp_path):
    """A laptop offline or a fresh VM: `hostname` names no address. torchrun --standalone hands
    its workers that name as MASTER_ADDR (with the launcher's own store per attempt), and they
    retried it until DDP_TIMEOUT; launch_ddp.sh gives them 127.0.0.1, as it does to two "nodes"
    meeting at 127.0.0.1 (c10d). The name is changed in a UTS namespace of the test's own (root
    only)."""
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        if os.environ.get("DDP_COURSE_ROOT") == "1" or os.environ.get("CI") == "true":
            pytest.fail(f"asked for root tests, but unshare --uts fails: {probe.stderr.strip()}")
        pytest.skip("unshare --uts needs root (DDP_COURSE_ROOT=1 makes this a failure)")
    launch = [ROOT / "launch_ddp.sh", "--nproc", "2", "multinode.py", "--samples", "512"]
    launch += [
        "--epochs",
        "1",
        "--data-dir",
        tmp_path / "data",
        "--checkpoint-dir",
        tmp_path / "ck",
    ]
    # Then two "nodes" on this machine (the README's rehearsal), c10d at 127.0.0.1, 1 rank each.
    port = free_port()
    nodes = [
        [ROOT / "launch_ddp.sh", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint"]
        + [f"127.0.0.1:{port}", "multinode.py", "--samples", "512", "--epochs", "1"]
        + ["--data-dir", tmp_path / f"n{n}" / "data", "--checkpoint-dir", tmp_path / f"n{n}" / "ck"]
        for n in (0, 1)
    ]
    node0, node1 = (" ".join(map(str, ["bash", *node])) for node in nodes)
    script = (
        f"hostname ddp-course-no-such-host && bash {' '.join(map(str, launch))}"
        f" && ({node0} & pid=$!; {node1} && wait $pid)"
    )
    r = run(["unshare", "--uts", "bash", "-c", script], timeout=150, env=cpu_env(DDP_TIMEOUT="60"))
    assert_ok(r)
    assert "done: world 2 | nodes 1" in r.stdout and "done: world 2 | nodes 2" in r.stdout


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
        ): (
            "--nnodes=2 --nproc-per-node=2 --node-rank=1 --master-addr=h0 --master-port=29500 "
            "multinode.py --x a\\ b"
        ),
        ("--nnodes", "3", "--nproc", "4", "--rdzv-endpoint", "h0", "multinode.py"): (
            "--nnodes=3 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=h0:29400 "
            "--rdzv-id=ddp-course multinode.py"
        ),
        ("--slurm", "--nnodes", "4", "multinode.py"): (
            f"sbatch --nodes=4 {ROOT}/slurm/train.sbatch multinode.py"
        ),
        ("--slurm-srun", "--nproc", "8", "multinode.py"): (
            f"sbatch --gpus-per-node=8 --ntasks-per-node=8 {ROOT}/slurm/train_srun.sbatch "
            "multinode.py"
        ),
    }
    for args, expected in cases.items():
        r = launch_sh("--dry-run", *args, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stderr.strip().splitlines()[-1].endswith(expected), (args, r.stderr)
    r = launch_sh("--dry-run", "--debug", "multinode.py", env=env)
    assert r.returncode == 0 and "NCCL_DEBUG=INFO" in r.stderr
    assert "TORCH_DISTRIBUTED_DEBUG=INFO" in r.stderr
    # torchrun gets a fresh store per restart attempt; --max-restarts reaches torchrun (or sbatch)
    dry = ["--dry-run", "--nnodes", "2", "--rdzv-endpoint", "h0", "--max-restarts", "2"]
    r = launch_sh(*dry, "multinode.py", env=env)
    assert "+ export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.stderr.splitlines()
    assert "--max-restarts=2 --nnodes=2" in r.stderr.splitlines()[-1]
    dry = ["--dry-run", "--slurm", "--nproc", "4", "--max-restarts", "2"]
    r = launch_sh(*dry, "multinode.py", env=env)
    last = r.stderr.splitlines()[-1]
    assert "sbatch --gpus-per-node=4 --export=ALL\\,NPROC_PER_NODE=4\\,MAX_RESTARTS=2 " in last


def test_launch_ddp_counts_only_the_gpus_cuda_visible_devices_allows(tmp_path):
    """nvidia-smi lists all 4 GPUs of the machine; CUDA_VISIBLE_DEVICES may allow fewer."""
    env = fake_nvidia_smi(tmp_path / "gpu4", 4)
    for visible, nproc in [(None, 4), ("0,1", 2), ("1,2,3", 3), ("3", 1), ("", 2)]:  # "": no GPU
        visible_env = env if visible is None else dict(env, CUDA_VISIBLE_DEVICES=visible)
        r = launch_sh("--dry-run", "multinode.py", env=visible_env)
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
        ["--dry-run", "--nnodes", "2", "--rdzv-endpoint", "h:x", "multinode.py"],
        ["--node-rank", "0", "--master-addr", "h", "multinode.py"],
        ["--slurm", "--master-addr", "h", "multinode.py"],
        ["--max-restarts", "-1", "multinode.py"],
        # Accepted once and ignored: --master-port or --rdzv-id where nothing reads them; a
        # leading zero (bash reads 08 as octal, torchrun as 8).
        ["--master-port", "12345", "multinode.py"],
        ["--rdzv-id", "x", "multinode.py"],
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "h",
            "--rdzv-id",
            "x",
            "multinode.py",
        ],
        ["--slurm", "--rdzv-id", "x", "multinode.py"],
        ["--nnodes", "08", "multinode.py"],
        ["--nnodes", "9", "--node-rank", "010", "--master-addr", "h", "multinode.py"],
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


def test_bad_flags_are_one_error_line():
    r = run_python("multinode.py", "--epochs", "0")
    assert r.returncode == 2 and len(error_lines(r)) == 1 and "Traceback" not in r.stderr
    assert "--epochs" in r.stderr
    # The test wrapper passes multinode.py's flags on; no launcher: the helper says how to launch.
    r = run_python(FAULTS, "--epochs", "1")
    assert r.returncode == 2 and len(error_lines(r)) == 1 and "Traceback" not in r.stderr
    assert "torchrun" in r.stderr


# A stand-in srun for the sbatch scripts' preemption trap: it warns the batch shell (what Slurm's
# --signal=B:USR1 does), then, per FAKE_SRUN: `ends` exits 0 at once (the training finished just
# as the warning came), `stops` exits 138 when the shell passes the warning on (a training that
# snapshots and stops), `fails` exits 1 with no warning.
FAKE_SRUN = """#!/bin/bash
case $FAKE_SRUN in
    ends) trap '' USR1; sleep 0.3; kill -USR1 $PPID; exit 0 ;;
    stops) trap 'kill $!; exit 138' USR1; sleep 0.3; kill -USR1 $PPID; sleep 20 & wait; exit 0 ;;
    fails) exit 1 ;;
esac
"""
FAKE_SCONTROL = """#!/bin/bash
case $1 in show) echo node1 ;; requeue) echo "requeue $2" >>"$FAKE_LOG" ;; esac
"""


@pytest.mark.parametrize("script", ["train.sbatch", "train_srun.sbatch"])
def test_sbatch_trap_requeues_a_stopped_training_and_nothing_else(tmp_path, script):
    """The scripts run outside Slurm, against a stand-in srun and scontrol. A training that ends
    by itself just as Slurm's warning arrives must not be requeued (before: `wait` ended by the
    trap left STATUS at 138 when srun exited before `kill -0`); one that stops on the warning is;
    a failure is not. `ends` runs 3 times: the race it guards against is a matter of timing."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("torchrun", "")]:
        (fake / name).write_text(text or "#!/bin/sh\necho --signals-to-handle\n")
        (fake / name).chmod(0o755)
    (fake / "python").symlink_to(sys.executable)
    expected = {"ends": (0, False), "stops": (138, True), "fails": (1, False)}
    modes = ["ends", "ends", "ends", "stops", "fails"]
    procs = []
    for i, mode in enumerate(modes):
        env = cpu_env(
            PATH=f"{fake}:/usr/bin:/bin",
            FAKE_SRUN=mode,
            FAKE_LOG=tmp_path / f"requeue{i}",
            DDP_COURSE_DIR=tmp_path,  # no .venv there: the stand-ins stay first on PATH
            SLURM_SUBMIT_DIR=ROOT,
            SLURM_JOB_NODELIST="node1",
            SLURM_JOB_ID="7",
            SLURM_JOB_NUM_NODES="1",
            SLURM_NTASKS="1",
            SLURM_NTASKS_PER_NODE="1",
        )
        cmd = ["bash", ROOT / "slurm" / script, "multinode.py"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True))
    for i, (mode, proc) in enumerate(zip(modes, procs, strict=True)):
        out, _ = proc.communicate(timeout=60)
        requeued = (tmp_path / f"requeue{i}").exists()
        assert (proc.returncode, requeued) == expected[mode], (mode, out)
        assert ("requeue: job 7" in out) == requeued, out
