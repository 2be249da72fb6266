"""Tests for lesson 2, ddp_training.py (with training_data.py and training_run.py): real
processes on gloo/CPU.

One mp.spawn of 4 processes runs every training scenario through ddp_training.main() (the machine
imports torch four times, not twenty): first the runs on 4, 2 and 1 ranks with one global batch,
after which ranks 2 and 3 leave; then on 2 ranks the other scenarios, the failure paths (each one
error line and an exit code, caught in the process), then the no_sync / --verify-sync / host-sync
checks. Two torchrun "nodes" with node-local disks and a kill during a save run as real launches.
"""

import contextlib
import hashlib
import io
import math
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import (
    ROOT,
    assert_ok,
    cpu_env,
    error_lines,
    flat_tensors,
    free_port,
    init_spawned,
    run,
    run_torchrun,
    run_torchrun_nodes,
    spawn,
    torchrun_cmd,
    torchrun_env,
)

import ddp_common
import training_data as D
import training_run as R

# 100 synthetic samples: 90 train (45 per rank), 10 validation (a fixed 10%), 20 test.
TINY = [
    "--model",
    "cnn",
    "--data",
    "synthetic",
    "--subset",
    "100",
    "--log-every",
    "1",
    "--warmup-epochs",
    "0.5",
    "--seed",
    "3",
]
# One global batch of 16 on any world size: 4 ranks x 4, 2 ranks x 4 x 2 accumulation, 1 x 4 x 4.
# 90 training samples: 5 steps of 16 per epoch (80 samples). The BN-free cnn: a step is then the
# same maths on every split of the batch. A 2-rank run stopped at step 7 (inside epoch 2) resumes
# on 4 ranks and on 1 (with another per-rank batch: 8 x 2 accumulation).
GB = ["--epochs", "2", "--global-batch-size", "16", "--batch-size", "4", "--clip-grad", "0.5"]
GB += ["--lr", "0.8", "--weight-decay", "1e-4"]
# An LR for a global batch of 256 (R.REFERENCE_BATCH); the run scales it to its own batch.
STEADY = ["--epochs", "3", "--batch-size", "5", "--accum-steps", "2", "--keep-best", "2"]
SCENARIOS = {  # name -> (world size, flags); the 4-rank runs first, then ranks 2 and 3 leave
    "gb_w4": (4, GB),
    "gb_half": (2, GB + ["--max-steps", "7"]),
    "gb_rest4": (4, GB + ["--resume", "GB_HALF"]),
    "gb_w2": (2, GB),
    "gb_w1": (1, GB),
    "gb_rest1": (1, GB + ["--resume", "GB_HALF", "--batch-size", "8"]),
    "adamw_w2": (
        2,
        ["--epochs", "2", "--optimizer", "adamw", "--lr", "0.012", "--batch-size", "8"],
    ),
    "adamw_w1": (
        1,
        ["--epochs", "2", "--optimizer", "adamw", "--lr", "0.012", "--batch-size", "16"],
    ),
    # Resume: 12 steps straight vs 6 (stopped inside epoch 2), then --resume auto; then a resume
    # of the finished run (nothing left to do: evaluate, done, exit cleanly).
    "straight": (2, STEADY),
    "half": (2, STEADY + ["--max-steps", "6"]),
    "rest": (2, STEADY + ["--resume", "auto"]),
    "finished": (2, STEADY + ["--resume", "STRAIGHT"]),
    # Early stopping: an LR too small to change any prediction -> no improvement after epoch 1.
    "early": (2, ["--epochs", "8", "--batch-size", "8", "--lr", "1e-9", "--patience", "2"]),
    # Mixed precision on CPU; bf16 also takes the --data auto fallback (no CIFAR-10 offline).
    "bf16": (
        2,
        [
            "--subset",
            "400",
            "--epochs",
            "2",
            "--lr",
            "1.6",
            "--batch-size",
            "8",
            "--amp",
            "bf16",
            "--clip-grad",
            "1",
            "--verify-sync",
            "1",
            "--data",
            "auto",
        ],
    ),
    "fp16": (
        2,
        [
            "--subset",
            "400",
            "--epochs",
            "2",
            "--lr",
            "1.6",
            "--batch-size",
            "8",
            "--amp",
            "fp16",
            "--clip-grad",
            "1",
        ],
    ),
    # BatchNorm (buffers differ per rank) with a clock that jumps 1000 s in every evaluation.
    "bn": (
        2,
        [
            "--model",
            "cnn-bn",
            "--epochs",
            "2",
            "--batch-size",
            "8",
            "--lr",
            "0.32",
            "--log-every",
            "2",
        ],
    ),
    # The real CIFAR-10 file format: 105 train / 17 test divide by neither world size nor batch.
    "cifar": (
        2,
        [
            "--data",
            "cifar10",
            "--data-dir",
            "CIFAR",
            "--subset",
            "0",
            "--epochs",
            "2",
            "--batch-size",
            "8",
            "--profile",
            "--verify-sync",
            "2",
        ],
    ),
}
DIRS = {"half": "resume", "rest": "resume"}  # the two halves share one checkpoint dir


def write_tiny_cifar(root, per_batch=21, n_test=17):
    """A tiny CIFAR-10 in the real on-disk format (python version): pickled dicts with 'data'
    (N x 3072 uint8) and 'labels', in cifar-10-batches-py/."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = n_test if name == "test_batch" else per_batch
        entry = {
            "batch_label": name,
            "labels": rng.integers(0, 10, n).tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)


def _buffers_sha(model):
    return hashlib.sha256(b"".join(b.numpy().tobytes() for b in model.buffers())).hexdigest()


@contextlib.contextmanager
def _patched(module, **attrs):
    old = {k: getattr(module, k) for k in attrs}
    module.__dict__.update(attrs)
    try:
        yield
    finally:
        module.__dict__.update(old)


def _instrumented(T, name, record):
    """Spies for the scenarios that check a property from inside the run."""
    if name == "bn":  # every rank's BatchNorm buffers at each evaluation; a clock that jumps there
        clock = [0.0]
        real_eval = T.evaluate

        def evaluate(model, *args):
            result = real_eval(model, *args)  # (it syncs the buffers first)
            record.setdefault("eval_buffers", []).append(_buffers_sha(model))
            clock[0] += 1000.0
            return result

        fake_time = SimpleNamespace(perf_counter=lambda: time.perf_counter() + clock[0])
        return _patched(T, evaluate=evaluate, time=fake_time)
    if name == "rest":  # where the checkpoint is loaded, and whether it is freed before training
        real_load, real_step = T.load_checkpoint, T.train_step

        def load_checkpoint(path, device="cpu", **targets):
            ckpt = real_load(path, device, **targets)
            record["load_device"] = str(device)
            record["refs"] = [weakref.ref(t) for t in ckpt["model"].values()]
            return ckpt

        def train_step(*a, **k):
            record.setdefault("alive_at_first_step", sum(r() is not None for r in record["refs"]))
            return real_step(*a, **k)

        return _patched(T, load_checkpoint=load_checkpoint, train_step=train_step)
    if name.startswith("gb_"):  # the training samples each rank augments: (epoch, index) pairs
        real_to_input = T.to_input

        def to_input(images, norm, augment=None):
            if augment:
                index, epoch, _ = augment
                record.setdefault("seen", []).extend((epoch, int(i)) for i in index)
            return real_to_input(images, norm, augment)

        return _patched(T, to_input=to_input)
    return contextlib.nullcontext()


def _scenarios(T, rank, out, ports):
    results = {}
    for name, (size, flags) in SCENARIOS.items():
        if rank >= size:
            continue
        torchrun_env(rank, size, ports[name])
        where = {
            "STRAIGHT": str(out / "straight" / "last.pt"),
            "GB_HALF": str(out / "gb_half" / "last.pt"),
            "CIFAR": str(out / "data"),
        }
        flags = [where.get(f, f) for f in flags]
        argv = (
            TINY
            + ["--data-dir", str(out / "nodata")]
            + flags
            + ["--checkpoint-dir", str(out / DIRS.get(name, name))]
        )
        record, stdout = {}, io.StringIO()
        with _instrumented(T, name, record), contextlib.redirect_stdout(stdout):
            results[name] = T.main(argv)
        results[name].update(record, stdout=stdout.getvalue())
        results[name].pop("refs", None)
    return results


def _expect_exit(T, argv):
    """Run main() that must fail: (exit code, stderr). Then leave the group it joined."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            T.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    ddp_common.cleanup()
    return code, err.getvalue()


def _failures(T, rank, out, ports):
    good = out / "gb_w1" / "last.pt"
    bad = {}
    for damage in ("truncated", "corrupt", "shape"):
        path = out / f"{damage}.pt"
        if rank == 0:
            data = good.read_bytes()
            if damage == "truncated":
                path.write_bytes(data[: len(data) // 2])
            elif damage == "corrupt":
                path.write_bytes(b"\x00garbage" * 64 + data[512:])
            else:
                ckpt = torch.load(good, weights_only=True)
                ckpt["model"]["10.weight"] = torch.zeros(10, 7)
                torch.save(ckpt, path)
        bad[damage] = ["--resume", str(path), "--batch-size", "8"]
    cases = {
        **bad,
        "missing": ["--resume", str(out / "nope.pt")],
        "too_few": ["--batch-size", "64"],
        "offline": ["--data", "cifar10", "--data-dir", str(out / "nodata")],
        # rank 0's node has CIFAR-10 on its local disk, rank 1's node has none
        "one_node_lacks_data": [
            "--data",
            "cifar10",
            "--data-dir",
            str(out / ("data" if rank == 0 else "nodata")),
        ],
        # a checkpoint of a global batch of 16 resumed with 2 ranks x 8 x 2 accumulation = 32
        "other_global_batch": [
            "--resume",
            str(out / "gb_w2" / "last.pt"),
            "--batch-size",
            "8",
            "--accum-steps",
            "2",
        ],
        # 2 ranks x 8 do not divide a global batch of 20
        "indivisible": ["--global-batch-size", "20", "--batch-size", "8"],
    }
    results = {}
    for name, flags in cases.items():
        local_world_size = None
        if name == "one_node_lacks_data":
            local_world_size = 1
        torchrun_env(rank, 2, ports[name], local_world_size=local_world_size)
        results[name] = _expect_exit(
            T, TINY + ["--epochs", "2", "--checkpoint-dir", str(out / "fail")] + flags
        )
    # --data auto with CIFAR-10 on one node only: every rank takes the synthetic set
    torchrun_env(rank, 2, ports["auto_one_node"], local_world_size=1)
    with contextlib.redirect_stdout(io.StringIO()):
        results["auto_one_node"] = T.main(
            TINY
            + [
                "--data",
                "auto",
                "--batch-size",
                "8",
                "--max-steps",
                "1",
                "--checkpoint-dir",
                str(out / "auto1"),
                "--data-dir",
                str(out / ("data" if rank == 0 else "nodata")),
            ]
        )
    return results


class _Copies(torch.overrides.TorchFunctionMode):
    """Records host-to-device traffic a hot loop must not have: a blocking .to(device), or a tensor
    built from Python numbers on a device (each is a copy, and on a GPU a sync, per batch)."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The lesson's own calls, and its companions'.
        caller = sys._getframe(1).f_code.co_filename
        if not caller.endswith(("ddp_training.py", "training_data.py", "training_run.py")):
            return func(*args, **kwargs)
        if (
            func is torch.Tensor.to
            and not kwargs.get("non_blocking")
            and ("device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:]))
        ):
            self.found.append(f"blocking .to(device), line {sys._getframe(1).f_lineno}")
        if func in (torch.tensor, torch.as_tensor) and "device" in kwargs:
            self.found.append(f"torch.tensor(..., device=...), line {sys._getframe(1).f_lineno}")
        return func(*args, **kwargs)


def _units(T, rank, world, port, out):
    """no_sync under three DDP configurations, --verify-sync, and the host-sync rule."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = init_spawned(rank, world, port)
    results = {}
    for variant in ({}, {"static_graph": True}, {"gradient_as_bucket_view": True}):
        torch.manual_seed(0)
        model = D.build_model("cnn")
        ddp_model = DDP(model, bucket_cap_mb=0.02, **variant)  # small buckets: several per step
        calls = [0]

        def counting_hook(state, bucket, calls=calls):
            calls[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        ddp_model.register_comm_hook(None, counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        g = torch.Generator().manual_seed(rank)
        micro = [
            (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g))
            for _ in range(4)
        ]
        counts = []
        for accum in (1, 1, 1, 4, 1, 3):  # DDP rebuilds its buckets in the first steps
            calls[0] = 0
            T.train_step(ddp_model, ddp_model, opt, scaler, micro[:accum], None, 0.0)
            counts.append(calls[0])
        results[" ".join(variant) or "plain"] = (counts, R.verify_sync(model))
    # The hot paths: augmentation, a step, an evaluation; none may copy Python numbers to a device.
    norm = [torch.tensor(v).view(1, 3, 1, 1) for v in (D.MEAN, D.STD)]
    images, labels = (
        torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8),
        torch.randint(0, 10, (8,)),
    )
    with _Copies() as copies:
        x = D.to_input(images, norm, (torch.arange(8), 1, 0))
        T.train_step(ddp_model, ddp_model, opt, scaler, [(x, labels)], None, 1.0)
        T.evaluate(model, torch.utils.data.TensorDataset(images, labels), ddp, norm, None, 4)
    results["copies"] = copies.found
    if rank == 1:  # a deliberate desync: rank 1 nudges one weight outside DDP
        with torch.no_grad():
            model[3].weight[3, 1, 0, 0] += 1e-3
    results["desync"] = R.verify_sync(model)
    del ddp_model, opt  # a DDP wrapper alive at exit can abort gloo: free it first
    ddp_common.cleanup()
    return results


def _worker(rank, world, port, out, ports):
    import pathlib

    import ddp_training as T

    out = pathlib.Path(out)
    results = {"scenarios": _scenarios(T, rank, out, ports)}
    if rank < 2:
        results["failures"] = _failures(T, rank, out, ports)
        results["units"] = _units(T, rank, 2, port, out)
    torch.save(results, out / f"results{rank}.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("training")
    write_tiny_cifar(out / "data")
    names = list(SCENARIOS) + [
        "truncated",
        "corrupt",
        "shape",
        "missing",
        "too_few",
        "offline",
        "one_node_lacks_data",
        "other_global_batch",
        "indivisible",
        "auto_one_node",
    ]
    spawn(_worker, 4, str(out), {name: free_port() for name in names})
    return out, [torch.load(out / f"results{r}.pt", weights_only=False) for r in range(4)]


def _ckpt(out, name, file="last.pt"):
    return torch.load(out / DIRS.get(name, name) / file, weights_only=True)


# ---- training scenarios ----------------------------------------------------------------------
def _assert_same_run(out, name, reference, bound):
    """Two runs end at the same weights and optimizer state, to float tolerance: how far apart
    they end, relative to how far training moved the weights. Float sums in another order leave
    ~1e-6 to 1e-5 with SGD (a ReLU or a max-pool that flips on a rounding error amplifies it; the
    momentum, a sum of the last gradients, 10x more); a real error (no averaging, wrong samples,
    wrong LR) is of order 1."""
    run, ref = _ckpt(out, name), _ckpt(out, reference)
    assert run["step"] == ref["step"] and run["epoch"] == ref["epoch"]
    torch.manual_seed(3)  # --seed 3: the initial weights of every run
    init = D.build_model("cnn").state_dict()
    assert run["model"].keys() == ref["model"].keys()
    for key, p_ref in ref["model"].items():
        moved = float((p_ref - init[key]).norm())
        assert moved > 1e-3, f"{reference}: {key} did not train"
        assert float((run["model"][key] - p_ref).norm()) / moved < bound, f"{name}: {key} differs"
    opt, opt_ref = flat_tensors(run["optimizer"]["state"]), flat_tensors(ref["optimizer"]["state"])
    assert opt.keys() == opt_ref.keys() and opt
    for key in opt:  # momentum / Adam moments (and step counts)
        diff = float((opt[key].double() - opt_ref[key].double()).norm())
        assert diff <= 10 * bound * float(opt_ref[key].double().norm()) + 1e-12, f"{name}: {key}"


@pytest.mark.parametrize("name", ["gb_w4", "gb_w1"])
def test_one_global_batch_is_the_same_run_on_any_world_size(spawned, name):
    """The central proof: a global batch of 16 as 4 ranks x 4, 2 x 4 x 2 accumulation steps, or
    1 x 4 x 4 takes the same steps. Rank r reads positions r, r+W, ... of the epoch's permutation
    and cuts its shard into the step's micro-batches, so step s covers positions [sG, (s+1)G) on
    every world size; augmentation depends on the sample, not the rank."""
    out, results = spawned
    assert _ckpt(out, name)["step"] == 10  # 2 epochs of 90 // 16 = 5 steps
    _assert_same_run(out, name, "gb_w2", 1e-4)


def test_adamw_on_two_ranks_equals_one_process(spawned):
    """AdamW, 2 ranks x 8 against 1 x 16. Adam divides by sqrt(v): where a gradient is ~0 its
    rounding noise becomes a full-size step, so AdamW gets a looser bound."""
    _assert_same_run(spawned[0], "adamw_w2", "adamw_w1", 1e-2)


@pytest.mark.parametrize("name", ["gb_rest4", "gb_rest1"])
def test_a_run_stopped_on_2_ranks_resumes_on_4_or_1_as_if_uninterrupted(spawned, name):
    """Stopped by --max-steps 7 on 2 ranks (2 steps into epoch 2), resumed on 4 ranks (x 4, no
    accumulation) or on 1 (x 8, 2 accumulation steps): the same weights as the 2-rank run that
    never stopped, and every sample of the interrupted epoch trained exactly once."""
    out, results = spawned
    half = results[0]["scenarios"]["gb_half"]
    assert half["step"] == 7 and half["epoch"] == 1 and half["epoch_samples"] == 2 * 16
    _assert_same_run(out, name, "gb_w2", 1e-4)
    ranks = {"gb_rest4": 4, "gb_rest1": 1}[name]
    seen = []
    for r in range(2):
        seen += [i for epoch, i in results[r]["scenarios"]["gb_half"]["seen"] if epoch == 1]
    for r in range(ranks):
        seen += [i for epoch, i in results[r]["scenarios"][name]["seen"] if epoch == 1]
    straight = []
    for r in range(2):
        straight += [i for epoch, i in results[r]["scenarios"]["gb_w2"]["seen"] if epoch == 1]
    assert len(seen) == 5 * 16 == len(set(seen))  # the epoch's size, nothing twice
    assert sorted(seen) == sorted(straight)  # the samples the uninterrupted run trained on


def test_lr_scales_with_the_global_batch(spawned):
    """--lr is the LR of a global batch of 256: SGD scales it linearly with the whole global
    batch (accumulation included), AdamW by the square root."""
    out, _ = spawned
    for name in ("gb_w4", "gb_w2", "gb_w1"):  # 16 = 4 x 4 = 4 x 2 x 2 = 4 x 1 x 4
        assert _ckpt(out, name)["scheduler"]["base_lrs"] == [0.8 * 16 / R.REFERENCE_BATCH]
    adamw = _ckpt(out, "adamw_w2")["scheduler"]["base_lrs"][0]
    assert adamw == pytest.approx(0.012 * math.sqrt(16 / R.REFERENCE_BATCH))


def test_equivalence_is_not_trivial(spawned):
    """The runs above really trained, and the different runs (sgd vs adamw) ended apart."""
    out, _ = spawned
    sgd, adamw = _ckpt(out, "gb_w1")["model"], _ckpt(out, "adamw_w1")["model"]
    assert max(float((sgd[k] - adamw[k]).abs().max()) for k in sgd) > 1e-2


def test_resume_continues_bitwise(spawned):
    """12 steps straight == 6 steps (stopped inside epoch 2) + --resume auto to 12: bitwise-equal
    parameters, optimizer state, schedule, progress counters, best-k list and RNG states."""
    out, results = spawned
    half = results[0]["scenarios"]["half"]
    assert half["step"] == 6 and half["epoch_samples"] == 2 * 20
    straight, resumed = _ckpt(out, "straight"), _ckpt(out, "rest")
    assert straight["step"] == resumed["step"] == 12 and straight["epoch"] == resumed["epoch"] == 3
    for name, p in straight["model"].items():
        assert torch.equal(p, resumed["model"][name]), name
    a, b = flat_tensors(straight["optimizer"]), flat_tensors(resumed["optimizer"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight["scheduler"] == resumed["scheduler"]
    assert straight["best"] == resumed["best"] and straight["bad_epochs"] == resumed["bad_epochs"]
    for r in range(2):  # every rank's RNG state is in the checkpoint
        assert torch.equal(straight["rng"][r][0], resumed["rng"][r][0])


def test_resume_loads_to_the_cpu_and_frees_the_checkpoint(spawned):
    """No GPU holds a second copy of the checkpoint, and none of it lives on into training."""
    _, results = spawned
    for r in range(2):
        rest = results[r]["scenarios"]["rest"]
        assert rest["load_device"] == "cpu"
        assert rest["alive_at_first_step"] == 0


def test_resuming_a_finished_run_is_a_clean_no_op(spawned):
    """Nothing left to train: evaluate, done, return on every rank. (A DDP wrapper that never ran
    a backward aborted the process at exit before main() freed it; the spawn would fail then.)"""
    _, results = spawned
    for r in range(2):
        finished = results[r]["scenarios"]["finished"]
        assert finished["step"] == 12 and finished["epoch"] == 3
    assert "done:" in results[0]["scenarios"]["finished"]["stdout"]


def test_checkpoint_contents_and_best_k(spawned):
    out, _ = spawned
    ckpt = _ckpt(out, "straight")
    keys = {"model", "optimizer", "scheduler", "scaler", "epoch", "epoch_samples", "step", "rng"}
    assert keys | {"global_batch", "world_size", "best"} <= ckpt.keys()
    assert ckpt["global_batch"] == 20 and ckpt["world_size"] == 2  # 2 ranks x 5 x 2 accumulation
    assert len(ckpt["rng"]) == 2 and isinstance(ckpt["rng"][1][0], torch.Tensor)
    assert not any(k.startswith("module.") for k in ckpt["model"])  # model.module was saved
    on_disk = {f.name for f in (out / "straight").iterdir() if f.name.startswith("best-")}
    # k=2 kept, the rest deleted; the file names follow from the epochs
    assert len(on_disk) == 2 and on_disk == {R.best_name(epoch) for _, epoch in ckpt["best"]}
    accs = [acc for acc, _ in ckpt["best"]]
    assert accs == sorted(accs, reverse=True) and ckpt["best_acc"] == accs[0]


def test_early_stopping_ends_every_rank_at_the_same_epoch(spawned):
    out, results = spawned
    # epoch 1 sets the best; epochs 2 and 3 do not improve it -> patience 2 stops after epoch 3.
    assert (
        results[0]["scenarios"]["early"]["epoch"] == results[1]["scenarios"]["early"]["epoch"] == 3
    )
    assert _ckpt(out, "early")["epoch"] == 3


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_on_cpu_learns(spawned, amp):
    out, results = spawned
    res = results[0]["scenarios"][amp]
    assert res["loss"] < 0.6 * math.log(10), res["stdout"][
        -2000:
    ]  # from ~ln(10) = 2.30 at the start
    assert res["val_acc"] > 0.5
    scaler = _ckpt(out, amp)["scaler"]
    assert ("scale" in scaler) == (amp == "fp16")  # fp16 trains with a GradScaler, bf16 without
    if amp == "bf16":
        assert res["dataset"] == "synthetic"  # --data auto fell back offline


def test_batchnorm_buffers_are_the_same_on_every_rank_when_evaluated_and_saved(spawned):
    """Each rank updates BatchNorm's running statistics from its own shard; before evaluating and
    saving they are rank 0's everywhere, and the checkpoint holds exactly what was evaluated."""
    out, results = spawned
    evals = [results[r]["scenarios"]["bn"]["eval_buffers"] for r in range(2)]
    assert len(evals[0]) == 3 and evals[0] == evals[1]  # 2 epoch ends + the final test evaluation
    saved = _ckpt(out, "bn")["model"]
    buffers = [saved[k] for k in saved if "running" in k or "num_batches" in k]
    assert (
        hashlib.sha256(b"".join(b.numpy().tobytes() for b in buffers)).hexdigest() == evals[0][-1]
    )


def test_samples_per_second_leaves_out_evaluation_time(spawned):
    """The clock jumps 1000 s in every evaluation: the first log line of epoch 2 still reports the
    training throughput (at most a few hundred samples/s would be left otherwise: 16 / 1000 s)."""
    _, results = spawned
    lines = [
        line
        for line in results[0]["scenarios"]["bn"]["stdout"].splitlines()
        if line.startswith("epoch 2/2 | step")
    ]
    rate = float(lines[0].split(" samples/s")[0].rsplit("| ", 1)[1])
    assert rate > 1, lines[0]


def test_real_cifar_files_uneven_sizes_profile_and_sync_check(spawned):
    """The CIFAR-10 reader on real-format files; 95 train / 17 test samples divide by neither
    world size nor batch (no hang, exact counts); --profile writes a trace; --verify-sync passes."""
    out, results = spawned
    res = results[0]["scenarios"]["cifar"]
    assert res["dataset"] == "cifar10" and res["epoch"] == 2
    assert res["test_count"] == 17  # every test sample exactly once
    assert (out / "cifar" / "profile_rank0.json").stat().st_size > 1000
    assert (out / "cifar" / "last.pt").is_file()


# ---- failures: one error line, the right exit code, no traceback ------------------------------
def _one_line(results, name, code=None, ranks=(0, 1)):
    outcomes = [results[r]["failures"][name] for r in ranks]
    lines = {line for _, err in outcomes for line in err.splitlines() if line.startswith("error: ")}
    assert len(lines) == 1 and all(c != 0 and (code is None or c == code) for c, _ in outcomes), (
        outcomes
    )
    assert all("Traceback" not in err for _, err in outcomes)
    return lines.pop()


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "shape"])
def test_bad_checkpoint_is_one_error_line(spawned, damage):
    out, results = spawned
    assert str(out / f"{damage}.pt") in _one_line(results, damage, code=1)


def test_resume_path_that_does_not_exist(spawned):
    _one_line(spawned[1], "missing")


def test_too_few_samples_for_one_step_is_an_error(spawned):
    _one_line(spawned[1], "too_few", code=2)  # 45 training samples per rank: not one batch of 64


def test_cifar10_unavailable_offline_is_one_error_line(spawned):
    assert "--data synthetic" in _one_line(spawned[1], "offline", code=1)


def test_a_node_without_the_data_fails_every_rank_with_one_line(spawned):
    """Node-local --data-dir: rank 0's node has CIFAR-10, rank 1's has none. Every rank stops with
    the same line naming the rank that lacks it (before: rank 0 chose cifar10 alone, and rank 1
    crashed with a traceback)."""
    assert "rank 1 (node 1)" in _one_line(spawned[1], "one_node_lacks_data", code=1)


def test_data_auto_agrees_on_one_dataset_across_nodes(spawned):
    _, results = spawned
    assert [results[r]["failures"]["auto_one_node"]["dataset"] for r in range(2)] == [
        "synthetic"
    ] * 2


def test_resume_with_another_global_batch_is_refused(spawned):
    """A step is one global batch: resuming with another one (here 32 for a checkpoint of 16)
    stops with one line (exit 2) that says which to use. (Another world size is fine: above.)"""
    assert "--global-batch-size 16" in _one_line(spawned[1], "other_global_batch", code=2)


def test_a_global_batch_the_ranks_cannot_divide_is_refused(spawned):
    assert "--global-batch-size 20" in _one_line(spawned[1], "indivisible", code=2)


def test_bad_flags_exit_2_with_one_error_line(capsys):
    import ddp_training

    for flags in (
        ["--accum-steps", "0"],
        ["--lr", "0"],
        ["--amp", "fp8"],
        ["--epochs", "-1"],
        ["--global-batch-size", "-1"],
        ["--global-batch-size", "32", "--accum-steps", "2"],
    ):
        with pytest.raises(SystemExit) as e:
            ddp_training.parse_args(flags)
        err = capsys.readouterr().err
        assert (
            e.value.code == 2 and len([line for line in err.splitlines() if "error:" in line]) == 1
        ), (
            flags,
            err,
        )
    r = run([sys.executable, ROOT / "ddp_training.py", "--accum-steps", "0"], timeout=240)
    assert r.returncode == 2 and len(error_lines(r)) == 1 and "Traceback" not in r.stderr


# ---- no_sync, --verify-sync, host syncs, AMP choice -------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "static_graph", "gradient_as_bucket_view"])
def test_no_sync_skips_communication_on_non_final_micro_steps(spawned, variant):
    """Counted with a DDP communication hook (one call per bucket all-reduce): a step of 4 or 3
    micro-steps all-reduces exactly as often as a step of 1 -- only its last micro-step talks."""
    for rank in range(2):
        counts, in_sync = spawned[1][rank]["units"][variant]
        n_buckets = counts[2]
        assert n_buckets >= 2, counts  # bucket_cap_mb 0.02 splits the CNN into several buckets
        assert counts[3] == counts[4] == counts[5] == n_buckets, counts
        assert in_sync is None  # and after accumulation all ranks still hold the same weights


def test_verify_sync_names_the_first_differing_tensor(spawned):
    for rank in range(2):  # both ranks see the mismatch, so both stop
        name, diff = spawned[1][rank]["units"]["desync"]
        assert name == "3.weight" and diff == pytest.approx(1e-3, rel=1e-3)


def test_no_host_copies_in_the_hot_loop(spawned):
    """Augmentation, a training step and an evaluation make no blocking copy to the device and
    build no device tensor from Python numbers (each a host sync per batch on a GPU)."""
    for rank in range(2):
        assert spawned[1][rank]["units"]["copies"] == []


def test_amp_auto_takes_bf16_only_where_the_gpu_has_it(monkeypatch):
    """An emulated bf16 (a T4: is_bf16_supported() says yes, including_emulation=False says no)
    gets fp16 with a GradScaler; an A100/H100 gets bf16; a CPU gets none unless asked."""
    import ddp_training as T

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    assert T.pick_amp("auto", gpu) == "fp16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert T.pick_amp("auto", gpu) == "bf16"
    assert T.pick_amp("auto", cpu) == "off" and T.pick_amp("bf16", cpu) == "bf16"


# ---- real launches: two "nodes" with node-local disks; a kill during a save --------------------
@pytest.mark.slow
def test_two_nodes_with_local_disks_agree_on_data_and_on_resume(tmp_path):
    """Two torchrun agents (--nnodes=2) on this machine, each node with its own --data-dir and
    --checkpoint-dir. Node 0 has CIFAR-10, node 1 none: with --data auto every rank trains on
    the synthetic set (before: node 1 crashed). Only node 0 then holds last.pt (rank 0 writes):
    --resume auto stops every rank with one line (before: rank 0 resumed, rank 1 started fresh)."""
    write_tiny_cifar(tmp_path / "d0")
    common = TINY + ["--data", "auto", "--epochs", "1", "--batch-size", "8", "--max-steps", "2"]
    nodes = [
        common + ["--data-dir", tmp_path / f"d{i}", "--checkpoint-dir", tmp_path / f"c{i}"]
        for i in range(2)
    ]
    first = run_torchrun_nodes("ddp_training.py", nodes, timeout=240)
    for r in first:
        assert_ok(r)
    assert "done: data synthetic" in first[0].stdout and "warning: no CIFAR-10" in first[0].stdout
    assert (tmp_path / "c0" / "last.pt").is_file() and not (tmp_path / "c1" / "last.pt").exists()
    second = run_torchrun_nodes(
        "ddp_training.py", [n + ["--resume", "auto"] for n in nodes], timeout=240
    )
    assert all(r.returncode == 1 for r in second), [r.stderr[-1500:] for r in second]
    lines = {line for r in second for line in error_lines(r)}
    assert len(lines) == 1 and "different checkpoints" in lines.pop()
    assert not any('ddp_training.py", line' in r.stderr for r in second)


@pytest.mark.slow
def test_kill_during_save_leaves_last_checkpoint_loadable(tmp_path):
    """SIGKILL the whole job while rank 0 is writing last.pt (its temp file exists): last.pt is
    still a complete checkpoint, and --resume auto continues from it to the end."""
    ckpt = tmp_path / "ckpt"
    flags = TINY + [
        "--subset",
        "200",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--save-every",
        "1",
        "--checkpoint-dir",
        ckpt,
    ]
    killed_mid_save = False
    for _attempt in range(3):
        proc = subprocess.Popen(
            [str(c) for c in torchrun_cmd("ddp_training.py", *flags)],
            cwd=ROOT,
            env=cpu_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
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
    assert torch.load(ckpt / "last.pt", weights_only=True)["step"] >= 1
    r = run_torchrun("ddp_training.py", *flags, "--resume", "auto", timeout=240)
    assert_ok(r)
    final = torch.load(ckpt / "last.pt", weights_only=True)
    assert final["epoch"] == 2 and final["step"] == 2 * 11  # 180 train samples / 2 ranks / 8
    assert "steps 22 |" in r.stdout


# ---- a crafted checkpoint must not delete files (issue 24, item 1) ----------------------------
def _error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _crafted_best_worker(rank, world, port, out):
    import pathlib

    import ddp_training as T

    out = pathlib.Path(out)
    ckpt_dir = out / "a" / "b"
    base = TINY + ["--batch-size", "8", "--checkpoint-dir", str(ckpt_dir)]
    torchrun_env(rank, world, port)
    with contextlib.redirect_stdout(io.StringIO()):
        T.main(base + ["--epochs", "1"])
    # The checkpoint as a stranger could hand it over: its best-k list names a file two levels up
    # (the old layout [accuracy, epoch, name]), then the same path where an epoch belongs.
    ckpt = torch.load(ckpt_dir / "last.pt", weights_only=True)
    outcomes = {}
    for name, entry in (
        ("name", [-1.0, 1, "../../victim.txt"]),
        ("epoch", [-1.0, "../../victim.txt"]),
    ):
        (out / "victim.txt").write_text("keep me")
        ckpt["best"] = [entry]
        torch.save(ckpt, out / f"crafted_{name}.pt")
        torchrun_env(rank, world, free_port())
        argv = base + ["--epochs", "2", "--resume", str(out / f"crafted_{name}.pt")]
        try:
            code, err = _expect_exit(T, argv)
        except Exception as e:  # (the old code crashed on the second one)
            ddp_common.cleanup()
            code, err = -1, repr(e)
        outcomes[name] = (code, err, (out / "victim.txt").exists())
    torch.save(outcomes, out / "crafted.pt")


def test_a_crafted_checkpoint_cannot_delete_files_outside_its_dir(tmp_path):
    """A last.pt whose best-k list holds "../../victim.txt": on resume, the old code trained an
    epoch and then os.remove()d that path as an evicted best checkpoint. Now the names the run
    deletes come from epoch numbers, and a checkpoint holding anything else is refused."""
    spawn(_crafted_best_worker, 1, str(tmp_path))
    outcomes = torch.load(tmp_path / "crafted.pt", weights_only=False)
    for name, (code, err, victim_alive) in outcomes.items():
        assert victim_alive, f"{name}: the victim was deleted"
        assert code == 1 and len(_error_lines(err)) == 1 and "Traceback" not in err, (name, err)
