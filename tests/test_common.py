"""ddp_common: the helper under torchrun and mp.spawn (srun: tests/test_slurm.py), its errors and
its restart store; ddp_checkpoint's atomic save and safe load; and ddp_extras' download rules (the
long barrier, the folder lock)."""

import json
import os
import socket
import stat
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
from conftest import (
    cpu_env,
    error_lines,
    free_port,
    init_spawned,
    run,
    run_python,
    run_torchrun,
    spawn,
)

import ddp_checkpoint
import ddp_common
import ddp_extras

PROBE = "tests/probe_setup.py"


def probe_records(result):
    return sorted(
        (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )


def test_setup_under_torchrun():
    result = run_torchrun(PROBE, nproc=2)
    assert result.returncode == 0, result.stderr[-2000:]
    recs = probe_records(result)
    assert [r["rank"] for r in recs] == [0, 1]
    for r in recs:
        assert r["world_size"] == 2 and r["local_world_size"] == 2 and r["launcher"] == "torchrun"
        assert r["local_rank"] == r["rank"] and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["rank_sum"] == 1.0  # the all-reduce really went across both processes
        assert r["threads"] == 1  # OMP_NUM_THREADS=1 (cpu_env) is kept, not overridden


def _spawned_probe(rank, world_size, port, out_dir):
    ddp = init_spawned(rank, world_size, port)
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": ddp.rank,
                "world": ddp.world_size,
                "launcher": ddp.launcher,
                "local_rank": ddp.local_rank,
                "sum": t.item(),
            },
            f,
        )
    ddp_common.cleanup()


def test_setup_under_mp_spawn(tmp_path):
    spawn(_spawned_probe, 3, str(tmp_path))
    recs = [json.load(open(tmp_path / f"{r}.json")) for r in range(3)]
    assert [(r["rank"], r["local_rank"], r["world"], r["launcher"]) for r in recs] == [
        (r, r, 3, "spawn") for r in range(3)
    ]
    assert all(r["sum"] == 6.0 for r in recs)


# ---- launch mistakes: one `error:` line, non-zero exit, no hang, no traceback ----


def assert_one_error(result, code, *words):
    errs = error_lines(result)
    assert result.returncode == code, (result.returncode, result.stderr[-1500:])
    assert len(errs) == 1, result.stderr[-1500:]
    assert "Traceback" not in result.stderr
    for w in words:
        assert w in errs[0], errs[0]


def test_no_launcher_env_says_how_to_launch():
    assert_one_error(run_python(PROBE, timeout=60), 2, "torchrun")


def test_incomplete_launcher_env_names_the_missing_variables():
    result = run_python(PROBE, timeout=60, env=cpu_env(RANK=0, WORLD_SIZE=2))
    assert_one_error(result, 2, "MASTER_ADDR", "MASTER_PORT")


def test_port_in_use_names_the_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = cpu_env(RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        assert_one_error(run_python(PROBE, timeout=60, env=env), 2, str(port), "in use")


def test_missing_rank_times_out_with_one_line_instead_of_hanging():
    env = cpu_env(
        RANK=0,
        LOCAL_RANK=0,
        WORLD_SIZE=2,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=free_port(),
        DDP_TIMEOUT=2,
    )
    assert_one_error(run_python(PROBE, timeout=60, env=env), 1, "rank 0", "2 ranks")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_without_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        ddp_common.pick_device(0, 1, "nccl")
    assert e.value.code == 2 and "a GPU per process" in capsys.readouterr().err


def fake_gpus(monkeypatch, count, visible=None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_each_local_rank_gets_its_own_gpu(monkeypatch, capsys):
    fake_gpus(monkeypatch, 2)
    assert ddp_common.pick_device(1, 2) == (torch.device("cuda", 1), "nccl")
    assert ddp_common.pick_device(0, 2, "gloo") == (torch.device("cuda", 0), "gloo")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("local_rank", [0, 1])
def test_fewer_gpus_than_processes_runs_on_the_cpu_with_one_warning(
    monkeypatch, capsys, local_rank
):
    """The README's first command on a laptop with one GPU: gloo on the CPU, said once (local
    rank 0), instead of stopping. Asked for NCCL, it cannot: one error line."""
    fake_gpus(monkeypatch, 1)
    assert ddp_common.pick_device(local_rank, 2) == (torch.device("cpu"), "gloo")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == (1 if local_rank == 0 else 0)
    assert all(line.startswith("warning: 2 processes") and "1 GPU" in line for line in err)
    with pytest.raises(SystemExit) as e:
        ddp_common.pick_device(local_rank, 2, "nccl")
    assert e.value.code == 2 and "error: --backend nccl" in capsys.readouterr().err


def test_one_gpu_bound_per_task_is_cuda_0(monkeypatch):
    """srun --gpus-per-task / Kubernetes: each process sees only its own GPU, as cuda:0."""
    fake_gpus(monkeypatch, 1, visible="3")
    assert ddp_common.pick_device(1, 4) == (torch.device("cuda", 0), "nccl")
    fake_gpus(monkeypatch, 1, visible="0,1")
    assert ddp_common.pick_device(1, 2)[0] == torch.device("cpu")


def test_cpu_count_without_sched_getaffinity(monkeypatch):
    """macOS has no os.sched_getaffinity: the helper (and setup) must not need it."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert ddp_common.cpu_count() == os.cpu_count()


# ---- the launcher environment: the GPU index, and torchrun's shared store ----


def _env(monkeypatch, **env):
    for k in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "SLURM_PROCID",
    ):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1, **env}.items():
        monkeypatch.setenv(k, str(v))


@pytest.mark.parametrize(
    "env,local_rank",
    [
        (dict(RANK=1, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2), 1),  # one node: the global rank is the GPU
        (dict(RANK=0, WORLD_SIZE=1), 0),
        (dict(RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2), 1),
        (dict(RANK=3, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2), None),  # node 1 of 2: GPU 3 would be wrong
        (dict(RANK=1, WORLD_SIZE=2), None),  # how many nodes? unknown: never guess
    ],
)
def test_local_rank_is_not_guessed_from_the_global_rank(monkeypatch, capsys, env, local_rank):
    _env(monkeypatch, **env)
    if local_rank is not None:
        assert ddp_common.read_launcher_env() and os.environ["LOCAL_RANK"] == str(local_rank)
        return
    with pytest.raises(SystemExit) as e:
        ddp_common.read_launcher_env()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "LOCAL_RANK" in err[0], err


def test_torchrun_shared_store_gets_one_namespace_per_attempt(monkeypatch, capsys):
    """Plain torchrun: the agent's store outlives a restart, so each attempt gets a prefix; with
    2+ nodes and restarts rank 0 warns once; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the
    agent (workers see TORCHELASTIC_USE_AGENT_STORE=False) setup takes the plain env:// path."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _env(
        monkeypatch,
        TORCHELASTIC_USE_AGENT_STORE="True",
        MASTER_PORT=server.port,
        RANK=0,
        GROUP_WORLD_SIZE=1,
        TORCHELASTIC_MAX_RESTARTS=1,
        TORCHELASTIC_RESTART_COUNT=1,
    )
    ddp_common.torchrun_store(2, timedelta(seconds=10)).set("key", "new")
    assert server.check(["attempt1/key"]) and server.get("attempt1/key") == b"new"
    assert capsys.readouterr().err == ""  # one node: no warning
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    ddp_common.torchrun_store(2, timedelta(seconds=10))
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning[0]
    assert "c10d" in warning[0]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert ddp_common.torchrun_store(2, timedelta(seconds=10)) is None


# ---- waiting for one rank's download ----


def _late_download(rank, world_size, port, barrier, out_dir):
    """Rank 0 'downloads' for 4 s while rank 1 waits; the group's collectives time out at 2 s."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    # The default group's collectives time out after 2 s.
    ddp_common.setup(backend="gloo", rank=rank, world_size=world_size, timeout_s=2)
    torch.distributed.barrier()
    if rank == 0:
        time.sleep(4)
    try:
        if barrier == "long":
            ddp_extras.long_barrier(seconds=30)
        else:
            torch.distributed.barrier()
        outcome = "passed"
    except Exception as e:
        outcome = type(e).__name__
    with open(os.path.join(out_dir, f"{barrier}{rank}.txt"), "w") as f:
        f.write(outcome)


@pytest.mark.parametrize("barrier", ["long", "default"])
def test_a_download_may_outlast_the_collective_timeout(tmp_path, barrier):
    """long_barrier waits past the group's timeout; a plain barrier (the control) does not."""
    spawn(_late_download, 2, barrier, str(tmp_path))
    outcome = (tmp_path / f"{barrier}1.txt").read_text()
    if barrier == "long":
        assert outcome == "passed"
    else:
        assert outcome != "passed"


def test_folder_lock_makes_nodes_on_one_disk_take_turns(tmp_path):
    """Two processes (two nodes' local rank 0 on a shared home directory): the second waits."""
    code = (
        "import sys, time, ddp_extras\n"
        "with ddp_extras.folder_lock(sys.argv[1]):\n"
        "    print(time.time()); time.sleep(1.5); print(time.time())\n"
    )
    env = cpu_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "data")],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    spans = sorted(tuple(map(float, p.communicate(timeout=60)[0].split())) for p in procs)
    assert spans[1][0] >= spans[0][1]  # the second got the lock after the first let it go


# ---- checkpoints ----


def test_save_is_atomic_and_load_restores(tmp_path):
    path = str(tmp_path / "ck" / "model.pt")
    model = torch.nn.Linear(3, 2)
    ddp_checkpoint.save_checkpoint({"model": model.state_dict(), "step": 7}, path)
    assert os.listdir(tmp_path / "ck") == ["model.pt"]  # no temp file left behind
    other = torch.nn.Linear(3, 2)
    ckpt = ddp_checkpoint.load_checkpoint(path, "cpu", model=other)
    assert ckpt["step"] == 7 and torch.equal(other.weight, model.weight)


def test_save_writes_a_fresh_temp_file_and_syncs_the_folder(tmp_path, monkeypatch):
    """No predictable temp name (a link planted at path.tmp<pid> in a shared folder is left
    alone), the file gets a plain file's mode (umask), and the folder is synced after the rename."""
    path = tmp_path / "model.pt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in (f"model.pt.tmp{os.getpid()}", "model.pt.tmp"):
        (tmp_path / name).symlink_to(victim)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: synced.append(os.fstat(fd).st_mode) or real_fsync(fd)
    )
    old_umask = os.umask(0o022)
    try:
        ddp_checkpoint.save_checkpoint({"step": 1}, str(path))
    finally:
        os.umask(old_umask)
    assert victim.read_text() == "keep me"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [stat.S_ISDIR(mode) for mode in synced] == [False, True]  # the file, then its folder
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink()) == [
        "model.pt",
        "victim.txt",
    ]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "shape", "missing-key", "absent"])
def test_bad_checkpoints_are_one_line_errors(tmp_path, capsys, damage):
    path = str(tmp_path / "model.pt")
    ddp_checkpoint.save_checkpoint({"model": torch.nn.Linear(3, 2).state_dict()}, path)
    data = open(path, "rb").read()
    if damage == "truncated":
        open(path, "wb").write(data[: len(data) // 2])
    elif damage == "garbage":
        open(path, "wb").write(b"not a checkpoint" * 10)
    elif damage == "absent":
        os.remove(path)
    target = torch.nn.Linear(4, 2) if damage == "shape" else torch.nn.Linear(3, 2)
    key = "ema" if damage == "missing-key" else "model"
    with pytest.raises(SystemExit) as e:
        ddp_checkpoint.load_checkpoint(path, "cpu", **{key: target})
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code in (1, 2) and len(err) == 1 and err[0].startswith("error: checkpoint")


def test_load_checkpoint_loads_to_the_cpu_unless_told(tmp_path, monkeypatch):
    """A resume must not put a whole checkpoint on every GPU: load to the CPU, load_state_dict
    copies each tensor to its parameter's device."""
    path = str(tmp_path / "model.pt")
    ddp_checkpoint.save_checkpoint({"model": torch.nn.Linear(3, 2).state_dict()}, path)
    real_load, seen = torch.load, []
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: seen.append(k["map_location"]) or real_load(*a, **k)
    )
    ddp_checkpoint.load_checkpoint(path, model=torch.nn.Linear(3, 2))
    ddp_checkpoint.load_checkpoint(path, torch.device("cpu"), model=torch.nn.Linear(3, 2))
    assert seen == ["cpu", torch.device("cpu")]


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    """A process killed while writing the temp file leaves the old checkpoint loadable."""
    path = tmp_path / "model.pt"
    ddp_checkpoint.save_checkpoint({"step": torch.tensor(1)}, str(path))
    code = (
        "import os, torch, ddp_checkpoint\n"
        "real = torch.save\n"
        "def dying_save(obj, f):\n"
        "    f.write(b'half a checkpoint'); f.flush(); os._exit(9)\n"
        "torch.save = dying_save\n"
        f"ddp_checkpoint.save_checkpoint({{'step': torch.tensor(2)}}, {str(path)!r})\n"
    )
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 9
    assert ddp_checkpoint.load_checkpoint(str(path), "cpu")["step"].item() == 1
