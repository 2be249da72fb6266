"""ddp_common, the one shared helper: setup under torchrun and mp.spawn (srun: tests/test_slurm.py),
its one-line errors, the device choice, torchrun's restart store, the flag parser, and the
atomic checkpoint save and safe load."""

import json
import os
import socket
import stat
import sys

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

import ddp_common

PROBE = "tests/probe_setup.py"


def probe_records(result):
    return sorted(
        (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )


def test_setup_under_torchrun():
    # All the cores: setup() would give each of the 2 ranks half of them, were it to override.
    result = run_torchrun(PROBE, nproc=2, env=cpu_env(OMP_NUM_THREADS=os.cpu_count()))
    assert result.returncode == 0, result.stderr[-2000:]
    recs = probe_records(result)
    assert [r["rank"] for r in recs] == [0, 1]
    for r in recs:
        assert r["world_size"] == 2 and r["local_rank"] == r["rank"]
        assert r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["rank_sum"] == 1.0  # the all-reduce really went across both processes
        assert r["threads"] == os.cpu_count()  # OMP_NUM_THREADS is kept, not overridden


def _spawned_probe(rank, world_size, port, out_dir):
    # The environment the forkserver was started with is not this test's: set it here. 7 threads:
    # a fresh process's default (all cores) on a 7-core machine, which setup() must not keep.
    os.environ.pop("OMP_NUM_THREADS", None)
    torch.set_num_threads(7)
    ddp = init_spawned(rank, world_size, port)
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t)
    record = {"rank": ddp.rank, "world": ddp.world_size, "local_rank": ddp.local_rank}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({**record, "sum": t.item(), "threads": torch.get_num_threads()}, f)
    ddp_common.cleanup()


def test_setup_under_mp_spawn(tmp_path):
    """mp.spawn: rank and world size passed in; without OMP_NUM_THREADS each of the 2 processes
    takes half the cores (not all of them each)."""
    spawn(_spawned_probe, 2, str(tmp_path))
    recs = [json.load(open(tmp_path / f"{r}.json")) for r in range(2)]
    assert [(r["rank"], r["local_rank"], r["world"]) for r in recs] == [(0, 0, 2), (1, 1, 2)]
    assert all(r["sum"] == 3.0 for r in recs)
    assert [r["threads"] for r in recs] == [max(1, os.cpu_count() // 2)] * 2


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


def launcher_env(**env):
    return cpu_env(
        **{"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1, **env},
        MASTER_ADDR="127.0.0.1",
    )


def test_a_launcher_that_sets_no_local_rank_gets_one_line():
    """A launcher of one's own that exports RANK and WORLD_SIZE only (docs/troubleshooting.md)."""
    env = launcher_env()
    del env["LOCAL_WORLD_SIZE"]
    assert_one_error(run_python(PROBE, timeout=60, env=env), 2, "LOCAL_WORLD_SIZE is not set")


def test_port_in_use_names_the_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = launcher_env(MASTER_PORT=port, DDP_TIMEOUT=5)
        assert_one_error(run_python(PROBE, timeout=60, env=env), 1, str(port), "EADDRINUSE")


def test_missing_rank_times_out_with_one_line_instead_of_hanging():
    env = launcher_env(WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, MASTER_PORT=free_port(), DDP_TIMEOUT=2)
    assert_one_error(run_python(PROBE, timeout=60, env=env), 1, "rank 0 of 2", "join")


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
    fake_gpus(monkeypatch, 1, visible="0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # started by torchrun
    assert ddp_common.pick_device(local_rank, 2) == (torch.device("cpu"), "gloo")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == (1 if local_rank == 0 else 0)
    assert all(line.startswith("warning: 1 GPU(s), 2 processes") for line in err)
    with pytest.raises(SystemExit) as e:
        ddp_common.pick_device(local_rank, 2, "nccl")
    assert e.value.code == 2 and "error: --backend nccl" in capsys.readouterr().err


def test_one_gpu_bound_per_srun_task_is_cuda_0_but_two_torchrun_ranks_never_share_it(monkeypatch):
    """srun --gpus-per-task (no torchrun): each task sees only its own GPU, as cuda:0. Two local
    ranks of torchrun or mp.spawn that see one GPU (CUDA_VISIBLE_DEVICES=0) would both take
    cuda:0 and NCCL would fail ("Duplicate GPU detected"): they run on the CPU instead, with a
    warning."""
    fake_gpus(monkeypatch, 1, visible="3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    # mp.spawn's workers inside one srun task (lesson 5 --nproc 2 on a 1-GPU allocation): no
    # RANK in their environment, they share the one GPU like torchrun's: the CPU.
    monkeypatch.delenv("RANK", raising=False)
    assert ddp_common.pick_device(1, 2)[0] == torch.device("cpu")
    monkeypatch.setenv("RANK", "5")  # slurm/train_srun.sbatch: RANK=$SLURM_PROCID
    assert ddp_common.pick_device(1, 4) == (torch.device("cuda", 0), "nccl")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert ddp_common.pick_device(1, 2)[0] == torch.device("cpu")
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert ddp_common.pick_device(1, 2)[0] == torch.device("cpu")


# ---- torchrun's shared store, the flag parser ----


def test_torchrun_shared_store_gets_one_namespace_per_attempt():
    """Plain torchrun hands its agent's store to every attempt: setup joins it under a prefix
    named by the attempt, so a restarted attempt never reads a dead one's keys. With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the agent (workers see
    TORCHELASTIC_USE_AGENT_STORE=False) setup takes the plain env:// path."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    code = "import ddp_common\nddp_common.setup()\nddp_common.cleanup()\n"
    env = launcher_env(
        MASTER_PORT=server.port, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=3
    )
    result = run([sys.executable, "-c", code], env=env, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    # What init_process_group's rendezvous wrote, all under the attempt's prefix.
    keys = server.list_keys()
    assert keys and all(key.startswith("attempt3/") for key in keys), keys


@pytest.mark.parametrize("value", ["0", "-3", "x", "1.5"])
def test_positive_int_refuses_what_is_not_a_count(value, capsys):
    parser = ddp_common.Parser()
    parser.add_argument("--steps", type=ddp_common.positive_int)
    assert parser.parse_args(["--steps", "12"]).steps == 12
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--steps", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: argument --steps")


# ---- checkpoints ----


def test_save_is_atomic_and_load_restores(tmp_path):
    path = str(tmp_path / "ck" / "model.pt")
    model = torch.nn.Linear(3, 2)
    ddp_common.save_checkpoint({"model": model.state_dict(), "step": 7}, path)
    assert os.listdir(tmp_path / "ck") == ["model.pt"]  # no temp file left behind
    other = torch.nn.Linear(3, 2)
    ckpt = ddp_common.load_checkpoint(path, model=other)
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
        ddp_common.save_checkpoint({"step": 1}, str(path))
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
    ddp_common.save_checkpoint({"model": torch.nn.Linear(3, 2).state_dict()}, path)
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
        ddp_common.load_checkpoint(path, **{key: target})
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code in (1, 2) and len(err) == 1 and err[0].startswith("error: checkpoint")


def test_load_checkpoint_loads_to_the_cpu(tmp_path, monkeypatch):
    """A resume must not put a whole checkpoint on every GPU: load to the CPU, load_state_dict
    copies each tensor to its parameter's device; weights_only: a file cannot run code."""
    path = str(tmp_path / "model.pt")
    ddp_common.save_checkpoint({"model": torch.nn.Linear(3, 2).state_dict()}, path)
    real_load, seen = torch.load, []
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k) or real_load(*a, **k))
    ddp_common.load_checkpoint(path, model=torch.nn.Linear(3, 2))
    assert seen == [{"map_location": "cpu", "weights_only": True}]


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    """A process killed while writing the temp file leaves the old checkpoint loadable."""
    path = tmp_path / "model.pt"
    ddp_common.save_checkpoint({"step": torch.tensor(1)}, str(path))
    code = (
        "import os, torch, ddp_common\n"
        "real = torch.save\n"
        "def dying_save(obj, f):\n"
        "    f.write(b'half a checkpoint'); f.flush(); os._exit(9)\n"
        "torch.save = dying_save\n"
        f"ddp_common.save_checkpoint({{'step': torch.tensor(2)}}, {str(path)!r})\n"
    )
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 9
    assert ddp_common.load_checkpoint(str(path))["step"].item() == 1
