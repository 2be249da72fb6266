"""ddp_common: the helper under every launcher, its errors, and its checkpoint functions."""
import json
import os
import random
import socket
import subprocess
import sys

import pytest
import torch

import ddp_common
from conftest import ROOT, cpu_env, error_lines, free_port, init_spawned, run, run_python, \
    run_torchrun, spawn

PROBE = "tests/probe_setup.py"


def probe_records(result):
    return sorted((json.loads(l) for l in result.stdout.splitlines() if l.startswith("{")),
                  key=lambda r: r["rank"])


def test_setup_under_torchrun():
    result = run_torchrun(PROBE, nproc=2)
    assert result.returncode == 0, result.stderr[-2000:]
    recs = probe_records(result)
    assert [r["rank"] for r in recs] == [0, 1]
    for r in recs:
        assert r["world_size"] == 2 and r["local_world_size"] == 2 and r["launcher"] == "torchrun"
        assert r["local_rank"] == r["rank"] and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["rank_sum"] == 1.0  # the all-reduce really went across both processes
        assert r["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)


def _spawned_probe(rank, world_size, port, out_dir):
    ddp = init_spawned(rank, world_size, port)
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"rank": ddp.rank, "world": ddp.world_size, "launcher": ddp.launcher,
                   "local_rank": ddp.local_rank, "sum": t.item()}, f)
    ddp_common.cleanup()


def test_setup_under_mp_spawn(tmp_path):
    spawn(_spawned_probe, 3, str(tmp_path))
    recs = [json.load(open(tmp_path / f"{r}.json")) for r in range(3)]
    assert [(r["rank"], r["local_rank"], r["world"], r["launcher"]) for r in recs] == \
        [(r, r, 3, "spawn") for r in range(3)]
    assert all(r["sum"] == 6.0 for r in recs)


def _port_in_slurm_range():
    """A free port p with p = 20000 + job_id % 20000 for some job id (how setup derives it)."""
    for _ in range(200):
        port = random.randint(20000, 39999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port in 20000-39999")


def test_setup_under_srun_env_without_torchrun():
    """What srun gives each task: SLURM_* only. setup maps them to ranks, takes MASTER_ADDR from
    the node list and MASTER_PORT from the job id."""
    port = _port_in_slurm_range()
    procs = []
    for rank in range(2):
        env = cpu_env(SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NODEID=0, SLURM_STEP_ID=0,
                      SLURM_STEP_NUM_TASKS=2, SLURM_NTASKS=2, SLURM_STEP_TASKS_PER_NODE="2",
                      SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID=port - 20000 + 20000 * 7)
        procs.append(subprocess.Popen([sys.executable, str(ROOT / PROBE)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            p.kill()
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted((o["rank"], o["local_rank"], o["world_size"], o["launcher"]) for o in outs) == \
        [(0, 0, 2, "slurm"), (1, 1, 2, "slurm")]
    assert all(o["rank_sum"] == 1.0 for o in outs)


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("node[1-2]", "node1"),
                                            ("gpu[03-05,9],cpu1", "gpu03"), ("a,b", "a"),
                                            ("x-y[7,8]", "x-y7")])
def test_first_host_of_slurm_nodelist(nodelist, first):
    assert ddp_common.first_host(nodelist) == first


def test_slurm_tasks_per_node_is_read_per_node():
    assert [ddp_common._slurm_tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]


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
    env = cpu_env(RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
                  DDP_TIMEOUT=4)
    assert_one_error(run_python(PROBE, timeout=60, env=env), 1, "rank 0", "2 ranks")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_without_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        ddp_common.pick_device(0, "nccl")
    assert e.value.code == 2 and "--backend gloo" in capsys.readouterr().err


def test_more_processes_than_gpus_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ddp_common.pick_device(1)[0] == torch.device("cuda", 1)  # local rank -> its GPU
    with pytest.raises(SystemExit) as e:
        ddp_common.pick_device(2)
    assert e.value.code == 2 and "only 2" in capsys.readouterr().err


# ---- checkpoints ----

def test_save_is_atomic_and_load_restores(tmp_path):
    path = str(tmp_path / "ck" / "model.pt")
    model = torch.nn.Linear(3, 2)
    ddp_common.save_checkpoint({"model": model.state_dict(), "step": 7}, path)
    assert os.listdir(tmp_path / "ck") == ["model.pt"]  # no temp file left behind
    other = torch.nn.Linear(3, 2)
    ckpt = ddp_common.load_checkpoint(path, "cpu", model=other)
    assert ckpt["step"] == 7 and torch.equal(other.weight, model.weight)


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
        ddp_common.load_checkpoint(path, "cpu", **{key: target})
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code in (1, 2) and len(err) == 1 and err[0].startswith("error: checkpoint")


def test_crash_during_save_keeps_previous_checkpoint(tmp_path):
    """A process killed while writing the temp file leaves the old checkpoint loadable."""
    path = tmp_path / "model.pt"
    ddp_common.save_checkpoint({"step": torch.tensor(1)}, str(path))
    code = ("import os, torch, ddp_common\n"
            "real = torch.save\n"
            "def dying_save(obj, f):\n"
            "    f.write(b'half a checkpoint'); f.flush(); os._exit(9)\n"
            "torch.save = dying_save\n"
            f"ddp_common.save_checkpoint({{'step': torch.tensor(2)}}, {str(path)!r})\n")
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 9
    assert ddp_common.load_checkpoint(str(path), "cpu")["step"].item() == 1
