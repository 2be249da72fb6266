"""Tests for lesson 2, ddp_training.py: real processes on gloo/CPU.

Most training scenarios run ddp_training.main() inside mp.spawn workers (one spawn runs several
short trainings, so the 2-core machine imports torch twice, not twenty times); the error paths,
the kill during a save and the real CIFAR-10 file format run the script under torchrun.
"""
import contextlib
import math
import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import ddp_common

from conftest import (ROOT, assert_ok, cpu_env, error_lines, free_port, init_spawned, run,
                      run_torchrun, spawn, torchrun_cmd)

# 100 synthetic samples: 80 train (40 per rank), 20 validation, 20 test.
TINY = ["--model", "cnn", "--data", "synthetic", "--subset", "100", "--val-fraction", "0.2",
        "--log-every", "1", "--warmup-epochs", "0.5", "--seed", "3"]


def _launch_env(rank, world, port):
    """Environment of a torchrun worker, so main() runs exactly as under torchrun."""
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(k, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      CUDA_VISIBLE_DEVICES="", DDP_TIMEOUT="60", OMP_NUM_THREADS="1")


# name -> (world size, extra flags). Equivalence: 2 ranks x B == 1 process x 2B, and with
# accumulation 2 ranks x 2 micro x B == 1 process x 4B (same LR: --no-lr-scaling).
EQ = ["--epochs", "2", "--no-lr-scaling", "--weight-decay", "1e-4"]
SCENARIOS = {
    "sgd_w2": (2, EQ + ["--optimizer", "sgd", "--lr", "0.05", "--batch-size", "8"]),
    "sgd_w1": (1, EQ + ["--optimizer", "sgd", "--lr", "0.05", "--batch-size", "16"]),
    "adamw_w2": (2, EQ + ["--optimizer", "adamw", "--lr", "0.003", "--batch-size", "8"]),
    "adamw_w1": (1, EQ + ["--optimizer", "adamw", "--lr", "0.003", "--batch-size", "16"]),
    "accum_w2": (2, EQ + ["--optimizer", "sgd", "--lr", "0.05", "--batch-size", "5", "--accum-steps", "2",
                          "--clip-grad", "0.5"]),
    "accum_w1": (1, EQ + ["--optimizer", "sgd", "--lr", "0.05", "--batch-size", "20", "--clip-grad", "0.5"]),
    # Resume: 12 steps straight vs 6 (stopped inside epoch 2), then --resume auto.
    "straight": (2, ["--epochs", "3", "--batch-size", "5", "--accum-steps", "2", "--keep-best", "2"]),
    "half": (2, ["--epochs", "3", "--batch-size", "5", "--accum-steps", "2", "--keep-best", "2",
                 "--max-steps", "6"]),
    "rest": (2, ["--epochs", "3", "--batch-size", "5", "--accum-steps", "2", "--keep-best", "2",
                 "--resume", "auto"]),
    # Early stopping: an LR too small to change any prediction -> no improvement after epoch 1.
    "early": (2, ["--epochs", "8", "--batch-size", "8", "--lr", "1e-9", "--patience", "2"]),
    # Mixed precision on CPU; bf16 also takes the --data auto fallback (no CIFAR-10 offline).
    "bf16": (2, ["--subset", "400", "--epochs", "3", "--lr", "0.05", "--batch-size", "8",
                 "--amp", "bf16", "--clip-grad", "1", "--verify-sync", "1", "--data", "auto"]),
    "fp16": (2, ["--subset", "400", "--epochs", "3", "--lr", "0.05", "--batch-size", "8",
                 "--amp", "fp16", "--clip-grad", "1"]),
}
RESUME_DIR = {"half": "resume", "rest": "resume"}  # the two halves share one checkpoint dir


def _scenario_worker(rank, world, port, out, ports):
    import ddp_training
    results = {}
    for name, (size, flags) in SCENARIOS.items():
        if rank >= size:
            continue
        _launch_env(rank, size, ports[name])
        ckpt_dir = os.path.join(out, RESUME_DIR.get(name, name))
        argv = TINY + flags + ["--checkpoint-dir", ckpt_dir, "--data-dir", os.path.join(out, "nodata")]
        results[name] = ddp_training.main(argv)
    torch.save(results, os.path.join(out, f"results{rank}.pt"))


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    out = tmp_path_factory.mktemp("scenarios")
    spawn(_scenario_worker, 2, str(out), {name: free_port() for name in SCENARIOS})
    results = [torch.load(out / f"results{r}.pt", weights_only=True) for r in range(2)]
    return out, results


def _ckpt(out, name, file="last.pt"):
    return torch.load(os.path.join(out, RESUME_DIR.get(name, name), file), weights_only=True)


def _tensors(state, prefix=""):
    """Flatten a nested state dict into {path: tensor}."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else []
    flat = {}
    for k, v in items:
        flat.update(_tensors(v, f"{prefix}.{k}"))
    return flat


@pytest.mark.parametrize("optim", ["sgd", "adamw", "accum"])
def test_two_ranks_equal_one_process_with_the_global_batch(scenarios, optim):
    """The central proof: DDP on 2 ranks x B takes the same steps as 1 process with batch 2B (and
    2 ranks x 2 micro-steps x B as 1 x 4B). The global batches hold the same samples: rank r
    reads positions r, r+2, ... of the shuffled order, so step k of both runs covers positions
    [kG, (k+1)G) of the same permutation; augmentation depends on the sample, not the rank."""
    out, _ = scenarios
    two, one = _ckpt(out, f"{optim}_w2"), _ckpt(out, f"{optim}_w1")
    assert two["step"] == one["step"] == (8 if optim == "accum" else 10)
    import ddp_training
    torch.manual_seed(3)  # --seed 3: the initial weights of both runs
    init = ddp_training.build_model("cnn").state_dict()
    # How far apart the runs end, relative to how far training moved the weights. Float sums in
    # a different order leave ~1e-6 with SGD. Adam divides by sqrt(v): where a gradient is ~0 its
    # rounding noise becomes a full-size step, so AdamW gets a looser bound. A real error (no
    # averaging, wrong samples, wrong LR) is of order 1.
    bound = 1e-2 if optim == "adamw" else 1e-4
    assert two["model"].keys() == one["model"].keys()
    for name, p1 in one["model"].items():
        moved = float((p1 - init[name]).norm())
        assert moved > 1e-3, f"{name} did not train"
        assert float((two["model"][name] - p1).norm()) / moved < bound, f"{optim}: {name} differs"
    opt2, opt1 = _tensors(two["optimizer"]["state"]), _tensors(one["optimizer"]["state"])
    assert opt2.keys() == opt1.keys() and opt2
    for key in opt2:  # momentum / Adam moments (and step counts)
        assert float((opt2[key].double() - opt1[key].double()).norm()) <= \
            bound * float(opt1[key].double().norm()) + 1e-12, f"{optim}: {key}"


def test_equivalence_is_not_trivial(scenarios):
    """The runs above really trained: the weights moved far more than the tolerance, and the
    different runs (sgd vs adamw) ended in different places."""
    out, _ = scenarios
    sgd, adamw = _ckpt(out, "sgd_w1")["model"], _ckpt(out, "adamw_w1")["model"]
    assert max(float((sgd[k] - adamw[k]).abs().max()) for k in sgd) > 1e-2


def test_resume_continues_bitwise(scenarios):
    """12 steps straight == 6 steps (stopped inside epoch 2) + --resume auto to 12: bitwise-equal
    parameters, optimizer state, schedule, progress counters and best-k list."""
    out, results = scenarios
    straight, resumed = _ckpt(out, "straight"), _ckpt(out, "rest")
    assert results[0]["half"]["step"] == 6 and results[0]["half"]["epoch_step"] == 2  # mid-epoch
    assert straight["step"] == resumed["step"] == 12 and straight["epoch"] == resumed["epoch"] == 3
    for name, p in straight["model"].items():
        assert torch.equal(p, resumed["model"][name]), name
    a, b = _tensors(straight["optimizer"]), _tensors(resumed["optimizer"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight["scheduler"] == resumed["scheduler"]
    assert straight["best"] == resumed["best"] and straight["bad_epochs"] == resumed["bad_epochs"]
    for r in range(2):  # every rank's RNG state is in the checkpoint
        assert torch.equal(straight["rng"][r]["torch"], resumed["rng"][r]["torch"])


def test_checkpoint_contents_and_best_k(scenarios):
    out, _ = scenarios
    ckpt = _ckpt(out, "straight")
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng"} <= ckpt.keys()
    assert len(ckpt["rng"]) == 2 and isinstance(ckpt["rng"][1]["torch"], torch.Tensor)
    assert not any(k.startswith("module.") for k in ckpt["model"])  # model.module was saved
    assert ckpt["scheduler"]["base_lrs"] == [0.04]  # cnn default 0.02 x 2 ranks (linear scaling)
    assert _ckpt(out, "sgd_w2")["scheduler"]["base_lrs"] == [0.05]  # --no-lr-scaling
    on_disk = {f for f in os.listdir(out / "straight") if f.startswith("best-")}
    assert len(on_disk) == 2 and on_disk == {b[2] for b in ckpt["best"]}  # k=2 kept, rest deleted
    accs = [b[0] for b in ckpt["best"]]
    assert accs == sorted(accs, reverse=True) and ckpt["best_acc"] == accs[0]


def test_early_stopping_ends_every_rank_at_the_same_epoch(scenarios):
    out, results = scenarios
    # epoch 1 sets the best; epochs 2 and 3 do not improve it -> patience 2 stops after epoch 3.
    assert results[0]["early"]["epoch"] == results[1]["early"]["epoch"] == 3
    assert _ckpt(out, "early")["epoch"] == 3


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_on_cpu_learns(scenarios, amp):
    out, results = scenarios
    res = results[0][amp]
    assert res["loss"] < 0.6 * math.log(10), res  # from ~ln(10) = 2.30 at the start
    assert res["val_acc"] > 0.5
    scaler = _ckpt(out, amp)["scaler"]
    assert ("scale" in scaler) == (amp == "fp16")  # fp16 trains with a GradScaler, bf16 without
    if amp == "bf16":
        assert res["dataset"] == "synthetic"  # --data auto fell back offline


# ---------------------------------------------------------------------------------------------
# no_sync and --verify-sync, driven through the script's functions
# ---------------------------------------------------------------------------------------------
def _units_worker(rank, world, port, out):
    ddp = init_spawned(rank, world, port)
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    import ddp_training as T
    results = {}
    for variant in ([], ["--static-graph"], ["--gradient-as-bucket-view"]):
        args = T.parse_args(["--model", "cnn", "--bucket-cap-mb", "0.02", *variant])
        torch.manual_seed(0)
        model = T.build_model("cnn")
        ddp_model = T.wrap_model(model, args, ddp)
        calls = [0]

        def counting_hook(state, bucket):
            calls[0] += 1
            return default_hooks.allreduce_hook(state, bucket)
        ddp_model.register_comm_hook(dist.group.WORLD, counting_hook)
        opt = T.build_optimizer(ddp_model, args, 0.01, ddp.device)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        g = torch.Generator().manual_seed(rank)
        micro = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g))
                 for _ in range(4)]
        counts = []
        for accum in (1, 1, 1, 4, 1, 3):  # DDP rebuilds its buckets in the first steps
            calls[0] = 0
            T.train_step(ddp_model, ddp_model, opt, scaler, micro[:accum], None, 0.0)
            counts.append(calls[0])
        results[" ".join(variant) or "plain"] = (counts, T.verify_sync(model))
    # A deliberate desync: rank 1 nudges one weight outside DDP.
    if rank == 1:
        with torch.no_grad():
            model.conv2.weight[3, 1, 0, 0] += 1e-3
    results["desync"] = T.verify_sync(model)
    torch.save(results, os.path.join(out, f"units{rank}.pt"))
    del ddp_model, opt  # a DDP wrapper alive at exit can abort gloo: free it first
    ddp_common.cleanup()


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    out = tmp_path_factory.mktemp("units")
    spawn(_units_worker, 2, str(out))
    return [torch.load(out / f"units{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("variant", ["plain", "--static-graph", "--gradient-as-bucket-view"])
def test_no_sync_skips_communication_on_non_final_micro_steps(units, variant):
    """Counted with a DDP communication hook (one call per bucket all-reduce): a step of 4 or 3
    micro-steps all-reduces exactly as often as a step of 1 -- only its last micro-step talks."""
    for rank in range(2):
        counts, in_sync = units[rank][variant]
        n_buckets = counts[2]
        assert n_buckets >= 2, counts  # --bucket-cap-mb 0.02 splits the CNN into several buckets
        assert counts[3] == counts[4] == counts[5] == n_buckets, counts
        assert in_sync is None  # and after accumulation all ranks still hold the same weights


def test_verify_sync_names_the_first_differing_tensor(units):
    for rank in range(2):  # both ranks see the mismatch, so both stop
        name, diff = units[rank]["desync"]
        assert name == "conv2.weight" and diff == pytest.approx(1e-3, rel=1e-3)


# ---------------------------------------------------------------------------------------------
# The script under torchrun: real CIFAR-10 files, bad checkpoints, a kill during a save
# ---------------------------------------------------------------------------------------------
def _write_tiny_cifar(root, per_batch=21, n_test=17):
    """A tiny CIFAR-10 in the real on-disk format (python version): pickled dicts with 'data'
    (N x 3072 uint8) and 'labels', in cifar-10-batches-py/."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else per_batch
        entry = {"batch_label": name, "labels": rng.integers(0, 10, n).tolist(),
                 "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 "filenames": [f"{name}_{i}.png" for i in range(n)]}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog",
                                     "frog", "horse", "ship", "truck"], "num_cases_per_batch": per_batch}, f)


def _worker_traceback(result):
    """A traceback through the lesson's own code (torchrun's launcher prints its own traceback
    when a worker exits non-zero; that one is not ours)."""
    return any(f'{name}", line' in result.stderr for name in ("ddp_training.py", "ddp_common.py"))


def _done(result):
    lines = [l for l in result.stdout.splitlines() if l.startswith("done:")]
    assert len(lines) == 1, result.stdout[-2000:]
    return dict(kv.split(" ", 1) for kv in lines[0][len("done: "):].split(" | "))


@pytest.mark.slow
def test_real_cifar_files_uneven_sizes_profile_and_sync_check(tmp_path):
    """The CIFAR-10 reader on real-format files; 105 train / 17 test samples divide by neither
    world size nor batch (no hang, exact counts); --profile writes a trace; --verify-sync passes."""
    _write_tiny_cifar(tmp_path / "data")
    ckpt = tmp_path / "ckpt"
    r = run_torchrun("ddp_training.py", "--model", "cnn", "--data", "cifar10", "--data-dir",
                     tmp_path / "data", "--epochs", "2", "--batch-size", "8", "--val-fraction", "0.2",
                     "--profile", "--verify-sync", "2", "--checkpoint-dir", ckpt, timeout=240)
    assert_ok(r)
    done = _done(r)
    assert done["data"] == "cifar10" and done["world"] == "2" and done["epochs"] == "2"
    assert done["test_acc"].endswith("/17)")  # every test sample exactly once
    assert (ckpt / "profile_rank0.json").stat().st_size > 1000
    assert (ckpt / "last.pt").is_file()


@pytest.fixture(scope="module")
def good_checkpoint(scenarios):
    out, _ = scenarios
    return os.path.join(out, "sgd_w1", "last.pt")


RESUME_ARGS = TINY + ["--epochs", "3", "--batch-size", "16"]


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "shape"])
def test_bad_checkpoint_is_one_error_line(tmp_path, good_checkpoint, damage):
    path = tmp_path / "bad.pt"
    data = open(good_checkpoint, "rb").read()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":
        path.write_bytes(b"\x00garbage" * 64 + data[512:])
    else:
        ckpt = torch.load(good_checkpoint, weights_only=True)
        ckpt["model"]["fc.weight"] = torch.zeros(10, 7)
        torch.save(ckpt, path)
    r = run_torchrun("ddp_training.py", *RESUME_ARGS, "--resume", path, "--checkpoint-dir",
                     tmp_path, nproc=2 if damage == "shape" else 1, timeout=240)
    assert r.returncode != 0
    errors = error_lines(r)
    assert errors and len(set(errors)) == 1, r.stderr[-3000:]  # the same line from each rank
    assert str(path) in errors[0]
    assert not _worker_traceback(r)


def test_resuming_a_finished_run_is_a_clean_no_op(scenarios, tmp_path):
    """Nothing left to train: evaluate, print done, exit 0 on every rank. (A DDP wrapper that
    never ran a backward aborted the process at exit in 1 of ~5 runs before main() freed it.)"""
    out, _ = scenarios
    flags = TINY + SCENARIOS["straight"][1] + ["--resume", out / "straight" / "last.pt",
                                              "--checkpoint-dir", tmp_path]
    for _ in range(3):
        r = run_torchrun("ddp_training.py", *flags, timeout=240)
        assert_ok(r)
        assert _done(r)["steps"] == "12"


def test_resume_path_that_does_not_exist(tmp_path):
    r = run_torchrun("ddp_training.py", *RESUME_ARGS, "--resume", tmp_path / "nope.pt",
                     "--checkpoint-dir", tmp_path, nproc=1, timeout=240)
    assert r.returncode != 0 and len(error_lines(r)) == 1 and not _worker_traceback(r)


@pytest.mark.parametrize("flags", [["--accum-steps", "0"], ["--val-fraction", "1"], ["--lr", "0"],
                                   ["--amp", "fp8"]])
def test_bad_flags_exit_2_with_one_error_line(flags):
    r = run([sys.executable, ROOT / "ddp_training.py", *flags], timeout=240)
    assert r.returncode == 2
    assert len([l for l in r.stderr.splitlines() if "error:" in l]) == 1 and "Traceback" not in r.stderr


def test_cifar10_unavailable_offline_is_one_error_line(tmp_path):
    r = run_torchrun("ddp_training.py", "--model", "cnn", "--data", "cifar10", "--data-dir",
                     tmp_path, "--checkpoint-dir", tmp_path, nproc=2, timeout=240)
    assert r.returncode == 1
    assert len(set(error_lines(r))) == 1 and "--data synthetic" in error_lines(r)[0]
    assert not _worker_traceback(r)


def test_too_few_samples_for_one_step_is_an_error(tmp_path):
    # 80 training samples -> 40 per rank: not one batch of 64
    r = run_torchrun("ddp_training.py", *TINY, "--batch-size", "64", "--checkpoint-dir", tmp_path,
                     nproc=2, timeout=240)
    assert r.returncode != 0 and len(set(error_lines(r))) == 1 and not _worker_traceback(r)


@pytest.mark.slow
def test_kill_during_save_leaves_last_checkpoint_loadable(tmp_path):
    """SIGKILL the whole job while rank 0 is writing last.pt (its temp file exists): last.pt is
    still a complete checkpoint, and --resume auto continues from it to the end."""
    ckpt = tmp_path / "ckpt"
    flags = TINY + ["--subset", "400", "--epochs", "4", "--batch-size", "8", "--save-every", "1",
                    "--checkpoint-dir", ckpt]
    killed_mid_save = False
    for _attempt in range(3):
        proc = subprocess.Popen([str(c) for c in torchrun_cmd("ddp_training.py", *flags)], cwd=ROOT,
                                env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            deadline = time.time() + 200
            while time.time() < deadline and proc.poll() is None:
                if (ckpt / "last.pt").exists() and any(".tmp" in f for f in os.listdir(ckpt)):
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_mid_save = True
                    break
                time.sleep(0.0005)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if killed_mid_save:
            break
        for f in ckpt.iterdir():
            f.unlink()
    assert killed_mid_save, "never caught a save in progress"
    ckpt_state = torch.load(ckpt / "last.pt", weights_only=True)
    assert ckpt_state["step"] >= 1
    r = run_torchrun("ddp_training.py", *flags, "--resume", "auto", timeout=240)
    assert_ok(r)
    final = torch.load(ckpt / "last.pt", weights_only=True)
    assert final["epoch"] == 4 and final["step"] == 4 * 20  # 320 train samples / 2 ranks / 8
    assert _done(r)["steps"] == "80"
