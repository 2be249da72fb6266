"""Lesson 2, ddp_training.py (with training_data.py): real processes on gloo/CPU.

The lesson runs as torchrun starts it: its main() in processes that hold the variables torchrun
sets (RANK, WORLD_SIZE, ... and a fresh port per run), forked from one forkserver that imported
torch once, so twenty runs cost four imports. The tests read what a user sees: the printed
lines, exit codes and error lines, the checkpoint files. Nothing in the lesson is patched; a
probe on torch itself counts DDP's all-reduces (a communication hook on every DDP model), the
calls from the lesson's lines that wait for the device, and moves the clock on in evaluation.
Node-local data and checkpoints (two torchrun "nodes" on one machine) are lesson 4's:
tests/test_multinode.py.
"""

import contextlib
import functools
import io
import math
import os
import pickle
import struct
import subprocess
import sys
import time
import traceback
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ROOT,
    assert_clean_failure,
    assert_ok,
    cpu_env,
    flat_tensors,
    free_port,
    kill_tree,
    run_python,
    run_spawned,
    spawn,
    torchrun_cmd,
    torchrun_env,
)

import ddp_training
import training_data

# One global batch of 16 on any world size, in micro-batches of at most 4: 4 ranks x 4, 3 ranks
# x (4 + 2 or 4 + 1), 2 x (4 + 4), 1 x (4 x 4). The tiny CIFAR-10 below holds 105 training
# images: 10 held out for validation, 95 left, 5 steps of 16 per epoch. No --clip-grad: clipping
# rescales every step to one norm and would hide a gradient of the wrong size.
SEED, LR, GLOBAL_BATCH, WARMUP_EPOCHS = 3, 0.8, 16, 0.5
SAME = ["--model", "cnn", "--data", "cifar10", "--epochs", "2", "--batch-size", "4"]
SAME += ["--global-batch-size", str(GLOBAL_BATCH), "--lr", str(LR), "--seed", str(SEED)]
SAME += ["--warmup-epochs", str(WARMUP_EPOCHS), "--log-every", "5"]
# BatchNorm and mixed precision: synthetic images (400: 360 to train, 22 steps of 16 an epoch).
SMALL = ["--data", "synthetic", "--subset", "400", "--epochs", "2", "--batch-size", "8"]
SMALL += ["--lr", "0.64", "--log-every", "100"]
# name -> (world size, flags). HALF is the checkpoint of half_w2, stopped at step 7 (2 steps into
# epoch 2); the same command resumes it on 2, 4, 3 and 1 ranks. The 4-rank run comes early:
# the ranks a run does not need go on to the next run and wait for the others there.
TRAINING = {
    "half_w2": (2, SAME + ["--max-steps", "7"]),
    "rest_w4": (4, SAME + ["--resume", "HALF"]),
    "rest_w3": (3, SAME + ["--resume", "HALF"]),
    "rest_w1": (1, SAME + ["--resume", "HALF"]),
    "full_w2": (2, SAME),
    "rest_w2": (2, SAME + ["--resume", "HALF"]),
    # BatchNorm, saved without a loss scaler (--amp off), resumed where --amp picks fp16 (a job
    # requeued from an H100 onto a V100); and bf16. Clipping: the BatchNorm-free CNN needs it.
    "amp_off": (2, SMALL + ["--model", "cnn-bn", "--amp", "off", "--max-steps", "20"]),
    "amp_fp16": (
        2,
        SMALL + ["--model", "cnn-bn", "--amp", "fp16", "--clip-grad", "1", "--resume", "AMP_OFF"],
    ),
    "bf16": (2, SMALL + ["--model", "cnn", "--amp", "bf16", "--clip-grad", "1"]),
    # fp16 from scratch, its first steps overflowing as a large model's do: the scaler starts at
    # 2^30 here (FIRST_SCALE, set on torch's GradScaler, not in the lesson), and skips them.
    "fp16_skips": (2, SMALL + ["--model", "cnn-bn", "--amp", "fp16", "--max-steps", "15"]),
}
FIRST_SCALE = {"fp16_skips": 2.0**30}


class Python2Pickler(pickle._Pickler):
    """Pickles as Python 2 did when CIFAR-10's files were made: byte strings as BINSTRING, and
    numpy's array constructor under numpy 1's module name (what the lesson's reader must allow)."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_bytes(self, obj):
        self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    def save_builtin(self, obj, name=None):
        if obj.__name__ != "_reconstruct":
            return self.save_global(obj, name)
        self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
        self.memoize(obj)

    dispatch[bytes] = save_bytes
    dispatch[type(len)] = save_builtin


def write_tiny_cifar(root, per_batch=21, n_test=17, first_label=None):
    """A tiny CIFAR-10 in the real on-disk format (the python version): Python 2 pickles of dicts
    with 'data' (N x 3072 uint8) and 'labels', in cifar-10-batches-py/. 17 test images: 9 + 8 on
    2 ranks. first_label: the first training image's label instead of a random class."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in training_data.CIFAR_FILES:
        n = n_test if name == "test_batch" else per_batch
        entry = {
            "batch_label": name,
            "labels": rng.integers(0, 10, n).tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        }
        if first_label is not None and name == "data_batch_1":
            entry["labels"][0] = first_label
        with open(folder / name, "wb") as f:
            Python2Pickler(f, protocol=2).dump(entry)


# ---- the probe: on torch, never on the lesson -------------------------------------------------
SYNCS = {"item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy"}
LESSON_FILES = ("ddp_training.py", "training_data.py")


class Probe(torch.overrides.TorchFunctionMode):
    """Counts the calls from the lesson's own lines that make the host wait for the device
    (.item(), .tolist(), float(t), ...) and the copies to a device that do not say non_blocking
    (each a wait per batch on a GPU); counts DDP's bucket all-reduces; and moves the clock on
    1000 s whenever a model is put in eval mode."""

    def __init__(self):
        super().__init__()
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.counts = dict.fromkeys(["syncs", "blocking_copies", "allreduces"], 0)
        self.clock = 0.0
        real_init, real_eval, real_time = DDP.__init__, torch.nn.Module.eval, time.perf_counter

        def counting_init(ddp_model, *args, **kwargs):
            real_init(ddp_model, *args, **kwargs)

            def hook(state, bucket):
                self.counts["allreduces"] += 1
                return default_hooks.allreduce_hook(state, bucket)

            ddp_model.register_comm_hook(None, hook)

        def slow_eval(module):
            self.clock += 1000.0
            return real_eval(module)

        DDP.__init__ = counting_init
        torch.nn.Module.eval = slow_eval
        time.perf_counter = lambda: real_time() + self.clock

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if sys._getframe(1).f_code.co_filename.endswith(LESSON_FILES):
            name = getattr(func, "__name__", "")
            moves = name == "to" and any(isinstance(a, (torch.device, str)) for a in args[1:])
            copies = name in ("tensor", "as_tensor") and "device" in kwargs
            self.counts["syncs"] += name in SYNCS
            self.counts["blocking_copies"] += (moves and not kwargs.get("non_blocking")) or copies
        return func(*args, **kwargs)


def run_main(rank, world_size, port, argv, probe=None):
    """The lesson's main() on this rank as under torchrun: exit code, stdout, stderr, counts."""
    torchrun_env(rank, world_size, port)
    os.environ.update(DDP_TIMEOUT="180", https_proxy="http://127.0.0.1:9")
    os.environ["http_proxy"] = os.environ["https_proxy"]
    sys.argv = ["ddp_training.py", *map(str, argv)]
    if probe:
        probe.counts = dict.fromkeys(probe.counts, 0)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            ddp_training.main()
        except SystemExit as e:
            code = e.code
        except Exception:
            # A traceback is a failure of the run, not of the other runs: record it.
            traceback.print_exc()
            code = "traceback"
    # A run that stopped with an error leaves the group here (main's own cleanup never ran).
    import ddp_common

    ddp_common.cleanup()
    counts = dict(probe.counts) if probe else {}
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), **counts}


GRAD_SCALER_INIT = torch.amp.GradScaler.__init__


def _training_worker(rank, world_size, port, out, ports):
    from pathlib import Path

    out = Path(out)
    where = {"HALF": out / "half_w2" / "last.pt", "AMP_OFF": out / "amp_off" / "last.pt"}
    results = {}
    with Probe() as probe:
        for name, (size, flags) in TRAINING.items():
            if rank < size:
                argv = [where.get(f, f) for f in flags]
                argv += ["--data-dir", out / "data", "--checkpoint-dir", out / name]
                init = functools.partialmethod(
                    GRAD_SCALER_INIT, init_scale=FIRST_SCALE.get(name, 2.0**16)
                )
                with mock.patch.object(torch.amp.GradScaler, "__init__", init):
                    results[name] = run_main(rank, size, ports[name], argv, probe)
    torch.save(results, out / f"training{rank}.pt")


def _failure_worker(rank, world_size, port, out, cases, ports):
    results = {name: run_main(rank, 2, ports[name], argv) for name, argv in cases.items()}
    torch.save(results, os.path.join(out, f"failures{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every training run above, on 4 forked processes; results[name][rank]."""
    out = tmp_path_factory.mktemp("training")
    write_tiny_cifar(out / "data")
    spawn(_training_worker, 4, str(out), {name: free_port() for name in TRAINING})
    results = {}
    for rank in range(4):
        for name, result in torch.load(out / f"training{rank}.pt", weights_only=False).items():
            results.setdefault(name, {})[rank] = result
    return out, results


def fields(stdout, keyword):
    """The `key value` fields of every line that starts with keyword."""
    found = []
    for line in stdout.splitlines():
        if line.startswith(keyword):
            pairs = [part.split(" ", 1) for part in line.split(" | ")[1:]]
            # `123 samples/s`: the unit is the key.
            found.append({v if k[0].isdigit() else k: k if k[0].isdigit() else v for k, v in pairs})
    return found


def ckpt(out, name, file="last.pt"):
    return torch.load(out / name / file, weights_only=True)


# ---- one global batch: the same run on any world size, and resumed on any ----------------------
def reference_run(data_dir, epochs=2, reshuffle=True):
    """What the lesson promises, computed here without DDP, in one piece: step s of epoch e
    trains positions s*G .. (s+1)*G - 1 of the epoch's shuffle (DistributedSampler's: randperm
    seeded with seed + epoch), each sample augmented as the lesson does, with SGD (momentum 0.9,
    weight decay 5e-4) at lr x G/256, warmed up linearly over the warm-up steps, then cosine to
    0. Returns the model and the optimizer."""
    files = training_data.read_cifar(data_dir)
    x = torch.cat([images for images, _ in files[:5]])
    y = torch.cat([labels for _, labels in files[:5]])
    # The lesson's fixed 10% validation split (seed 0); the rest trains.
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train = order[len(order) // 10 :].sort().values
    x, y = x[train], y[train]
    steps_per_epoch = len(x) // GLOBAL_BATCH
    total = epochs * steps_per_epoch
    warmup = round(WARMUP_EPOCHS * steps_per_epoch)
    peak = LR * GLOBAL_BATCH / 256
    torch.manual_seed(SEED)
    model = training_data.build_model("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9, weight_decay=5e-4)
    step = 0
    for epoch in range(epochs):
        shuffle_epoch = epoch if reshuffle else 0
        shuffle = torch.randperm(
            len(x), generator=torch.Generator().manual_seed(SEED + shuffle_epoch)
        )
        for s in range(steps_per_epoch):
            index = shuffle[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]
            if step < warmup:
                lr = peak * (step + 1) / warmup
            else:
                lr = peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            inputs = training_data.to_input(x[index], torch.device("cpu"), (index, epoch, SEED))
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), y[index]).backward()
            optimizer.step()
            step += 1
    return model, optimizer


@pytest.fixture(scope="module")
def reference(runs):
    out, _ = runs
    return reference_run(out / "data")


def distance(run, reference_model, reference_optimizer):
    """How far a run's checkpoint ended from the reference, relative to how far training moved
    the weights: the largest over the tensors, for the weights and for the momentum."""
    torch.manual_seed(SEED)
    init = training_data.build_model("cnn").state_dict()
    worst = 0.0
    for key, weight in reference_model.state_dict().items():
        moved = float((weight - init[key]).norm())
        assert moved > 1e-3, f"{key} did not train"
        worst = max(worst, float((run["model"][key] - weight).norm()) / moved)
    momentum = flat_tensors(run["optimizer"]["state"])
    for i, param in enumerate(reference_model.parameters()):
        expected = reference_optimizer.state[param]["momentum_buffer"]
        got = momentum[f".{i}.momentum_buffer"]
        worst = max(worst, float((got - expected).norm()) / float(expected.norm()))
    return worst


@pytest.mark.parametrize("name", ["full_w2", "rest_w4", "rest_w3", "rest_w1"])
def test_one_global_batch_is_the_same_run_on_any_world_size(runs, reference, name):
    """The central claim: a global batch of 16 trains as one process training 16 at once would,
    whether 2 ranks take 8 each in two micro-batches, or a run stopped on 2 ranks resumes with
    the same command on 4 ranks (4 each), on 3 (6, 5 and 5: shares that differ by one) or on 1
    (4 micro-batches). Float sums in another order leave ~1e-6 of how far training moved the
    weights; a wrong sample, a missing average, a wrong LR or a repeated shuffle is of order 1."""
    out, results = runs
    for result in results[name].values():
        assert result["code"] == 0, result["stderr"][-2000:]
    checkpoint = ckpt(out, name)
    assert checkpoint["step"] == 10 and checkpoint["epoch"] == 2
    assert distance(checkpoint, *reference) < 1e-4


def test_every_epoch_trains_a_new_shuffle(runs, reference):
    """DistributedSampler deals the same order every epoch unless set_epoch(epoch) is called:
    the run that trained epoch 0's order again would end elsewhere than the one the lesson ran."""
    out, _ = runs
    repeated = reference_run(out / "data", reshuffle=False)
    assert distance(ckpt(out, "full_w2"), *repeated) > 1e-2


@pytest.mark.parametrize("name", ["rest_w4", "rest_w3", "rest_w1"])
def test_the_same_command_resumes_on_another_world_size(runs, name):
    out, results = runs
    size = len(results[name])
    stdout = results[name][0]["stdout"]
    assert f"resumed: {out / 'half_w2' / 'last.pt'} | step 7 | world 2 -> {size}" in stdout
    start = fields(stdout, "start:")[0]
    assert start["world"] == str(size) and start["batch"] == "4/micro-batch, 16 global"
    assert start["steps"] == "7->10 of 10" and start["lr"] == f"{LR * GLOBAL_BATCH / 256:g}"


def test_a_resume_on_the_same_world_size_continues_bitwise(runs):
    """10 steps straight == 7 steps (stopped inside epoch 2) + a resume: bitwise-equal weights,
    momentum, counters, best-k list, and every rank's random state."""
    out, _ = runs
    straight, resumed = ckpt(out, "full_w2"), ckpt(out, "rest_w2")
    assert ckpt(out, "half_w2")["step"] == 7
    for key in ("step", "epoch", "global_batch", "world_size", "best"):
        assert straight[key] == resumed[key], key
    a, b = flat_tensors(straight), flat_tensors(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(straight["rng"]) == 2 and "cpu" in straight["rng"][1]
    # Each rank a random stream of its own (a model with dropout: other masks on each rank).
    assert not torch.equal(straight["rng"][0]["cpu"], straight["rng"][1]["cpu"])


def test_only_the_last_micro_batch_of_a_step_all_reduces(runs):
    """Counted with a communication hook (one call per bucket all-reduce): every rank
    all-reduces once per bucket per optimizer step, whether the step was 1, 2 or 4 micro-batches.
    Without no_sync around forward and backward, each micro-batch would all-reduce."""
    _, results = runs
    per_step = {
        result["allreduces"] / 3
        for name in ("rest_w4", "rest_w2", "rest_w1")
        for result in results[name].values()
    }
    per_step |= {result["allreduces"] / 10 for result in results["full_w2"].values()}
    assert len(per_step) == 1 and per_step.pop() >= 1


def test_the_loop_waits_for_the_device_once_per_log_line_and_evaluation(runs):
    """The lesson's own lines read a value from the device (.item(), .tolist()) only for a log
    line or an evaluation, and copy to the device only non_blocking: none of it per batch."""
    _, results = runs
    for name in ("full_w2", "rest_w1", "amp_fp16"):
        for result in results[name].values():
            stdout = results[name][0]["stdout"]
            lines = fields(stdout, "epoch")
            # Every rank reads each log line's loss and each evaluation's sums; +1: the test set.
            assert result["syncs"] == len(lines) + 1, (name, result["syncs"], stdout)
            assert result["blocking_copies"] == 0


def test_samples_per_second_leaves_out_evaluation(runs):
    """The clock jumps 1000 s in every evaluation: epoch 2's log line still reports the
    training rate (16 x 5 samples / 1000 s would print 0)."""
    _, results = runs
    line = [f for f in fields(results["full_w2"][0]["stdout"], "epoch 2/2") if "step" in f][0]
    assert float(line["samples/s"]) > 1, line


def test_the_learning_rate_is_scaled_to_the_global_batch_and_warmed_up(runs):
    """--lr is for a global batch of 256: 16 samples get 0.8 x 16/256, reached after the warm-up
    (2 steps) and decayed along a cosine towards 0; each log line shows the rate of its step."""
    _, results = runs
    stdout = results["full_w2"][0]["stdout"]
    assert fields(stdout, "start:")[0]["lr"] == "0.05"
    lrs = [float(f["lr"]) for f in fields(stdout, "epoch") if "lr" in f]
    # The rate the logged step used: step 5 (index 4) and step 10 (index 9) of 10, after 2 warm-up.
    cosine = [0.05 * 0.5 * (1 + math.cos(math.pi * done / 8)) for done in (2, 7)]
    assert lrs == [pytest.approx(lr, rel=1e-3) for lr in cosine]


def test_checkpoint_contents_and_best_k(runs):
    """last.pt holds the course's schema; best-epochNNN.pt files are the --keep-best (1) best
    validation accuracies, named from their epochs; every test sample counted once."""
    out, results = runs
    last = ckpt(out, "full_w2")
    assert set(last) == {
        "model",
        "optimizer",
        "scaler",
        "step",
        "epoch",
        "global_batch",
        "world_size",
        "data",
        "rng",
        "best",
    }
    assert last["global_batch"] == 16 and last["world_size"] == 2 and last["scaler"] == {}
    assert last["data"] == f"cifar10 (105 images, seed {SEED})"
    assert not any(k.startswith("module.") for k in last["model"])
    assert len(last["best"]) == 1
    accuracy, epoch = last["best"][0]
    vals = fields(results["full_w2"][0]["stdout"], "epoch")
    accuracies = [float(f["val_acc"].split("%")[0]) for f in vals if "val_acc" in f]
    assert accuracy * 100 == pytest.approx(max(accuracies), abs=0.01)
    files = {f.name for f in (out / "full_w2").iterdir()}
    assert files == {"last.pt", f"best-epoch{epoch:03d}.pt"}
    assert ckpt(out, "full_w2", f"best-epoch{epoch:03d}.pt")["step"] == 5 * epoch
    done = fields(results["full_w2"][0]["stdout"], "done:")[0]
    assert done["test_acc"].endswith("/17)") and done["steps"] == "10"


# ---- BatchNorm, mixed precision ---------------------------------------------------------------
def test_batchnorm_statistics_are_rank_0s_when_evaluated(runs):
    """Each rank updates BatchNorm's running statistics from its own micro-batches. The test
    loss the run printed is exactly that of the model in its checkpoint (rank 0's): every rank
    evaluated its half of the test set with rank 0's statistics (rank 1's own ones, after 20
    steps, move it by ~0.07)."""
    out, results = runs
    assert results["amp_off"][0]["code"] == 0, results["amp_off"][0]["stderr"][-2000:]
    done = fields(results["amp_off"][0]["stdout"], "done:")[0]
    model = training_data.build_model("cnn-bn")
    model.load_state_dict(ckpt(out, "amp_off")["model"])
    _, (images, labels) = training_data.synthetic_cifar(0, 400, 80)
    with torch.no_grad():
        logits = model.eval()(training_data.to_input(images, torch.device("cpu")))
    assert float(done["test_loss"]) == pytest.approx(
        float(F.cross_entropy(logits, labels)), abs=2e-4
    )


@pytest.mark.parametrize("name", ["amp_fp16", "bf16"])
def test_mixed_precision_on_cpu_learns(runs, name):
    """fp16 with a GradScaler and clipping (resumed from a checkpoint saved without a scaler:
    before the fix, `error: ... The source state dict is empty`), and bf16."""
    out, results = runs
    for result in results[name].values():
        assert result["code"] == 0, result["stderr"][-2000:]
    stdout = results[name][0]["stdout"]
    assert fields(stdout, "start:")[0]["amp"] == name.split("_")[-1]
    last = [f for f in fields(stdout, "epoch 2/2") if "val_acc" in f][0]
    # From chance (10%, a loss of ln 10) to most of the 40 validation images.
    assert float(last["val_acc"].split("%")[0]) > 50, stdout
    losses = [float(f["loss"]) for f in fields(stdout, "epoch") if "loss" in f]
    assert losses[-1] < math.log(10), stdout
    scaler = ckpt(out, name)["scaler"]
    assert ("scale" in scaler) == (name == "amp_fp16")


def test_fp16_steps_the_scaler_skips_first_leave_the_weights_as_they_were(runs):
    """Fused SGD's first step takes new, unwritten memory as its momentum, and keeps it when the
    scaler skips that step (an fp16 overflow); the next step adds it to the weights. Before the
    fix (no zeroed momentum): weights of 1e36 and `test_loss nan` within these 15 steps."""
    out, results = runs
    for result in results["fp16_skips"].values():
        assert result["code"] == 0, result["stderr"][-2000:]
    state = ckpt(out, "fp16_skips")
    assert state["scaler"]["scale"] <= 2.0**16, state["scaler"]  # it skipped 14 steps or more
    weights = [v for v in state["model"].values() if v.is_floating_point()]
    assert max(v.abs().max().item() for v in weights) < 100
    (done,) = fields(results["fp16_skips"][0]["stdout"], "done:")
    assert math.isfinite(float(done["test_loss"])), done


# ---- failures: one error line, the right exit code, no traceback -------------------------------
class RunsCode:
    """What a crafted data_batch_1 could hold: unpickling it calls open(marker, "w")."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def failures(runs):
    """Runs that must stop (and one that has nothing left to do), on 2 forked processes, from
    files made out of the training runs' checkpoints; results[name][rank]."""
    out, _ = runs
    last = out / "full_w2" / "last.pt"
    data = last.read_bytes()
    (out / "truncated.pt").write_bytes(data[: len(data) // 2])
    crafted = ckpt(out, "full_w2")
    # A stranger's best-k list: a file two levels up, in the old layout [accuracy, epoch, name]
    # and where an epoch belongs.
    for name, entry in (
        ("name", [-1.0, 1, "../../victim.txt"]),
        ("epoch", [-1.0, "../../victim.txt"]),
    ):
        crafted["best"] = [entry]
        torch.save(crafted, out / f"crafted_{name}.pt")
    # ... and one with no best-k list at all (handed over from a program that keeps none).
    del crafted["best"]
    torch.save(crafted, out / "crafted_none.pt")
    (out / "victim.txt").write_text("keep me")
    # CIFAR-10 whose first file, unpickled by pickle.load, would run code.
    evil = out / "evil" / "cifar-10-batches-py"
    evil.mkdir(parents=True)
    for name in training_data.CIFAR_FILES:
        (evil / name).write_bytes((out / "data" / "cifar-10-batches-py" / name).read_bytes())
    marker = out / "evil" / "code-ran"
    (evil / "data_batch_1").write_bytes(pickle.dumps({"data": RunsCode(str(marker)), "labels": []}))
    # CIFAR-10 with a label 10 (ten classes: 0..9), which cross_entropy would fail on mid-run.
    write_tiny_cifar(out / "bad_labels", first_label=10)
    common = SAME + ["--data-dir", out / "data", "--checkpoint-dir", out / "a" / "b"]
    cases = {
        "finished": common + ["--resume", last],
        "crafted_name": common + ["--epochs", "3", "--resume", out / "crafted_name.pt"],
        "crafted_epoch": common + ["--epochs", "3", "--resume", out / "crafted_epoch.pt"],
        "crafted_none": common + ["--epochs", "3", "--resume", out / "crafted_none.pt"],
        "truncated": common + ["--resume", out / "truncated.pt"],
        "missing": common + ["--resume", out / "nope.pt"],
        "other_global_batch": common + ["--resume", last, "--global-batch-size", "32"],
        "too_few_samples": common + ["--global-batch-size", "128"],
        "too_many_ranks": common + ["--global-batch-size", "1"],
        "offline": common + ["--data-dir", out / "nodata"],
        "crafted_pickle": common + ["--data-dir", out / "evil"],
        "bad_labels": common + ["--data-dir", out / "bad_labels"],
        "no_validation": common + ["--subset", "9"],
        # A requeued job whose --data auto found no CIFAR-10 would train on synthetic images.
        "other_data": common + ["--resume", last, "--data", "synthetic", "--subset", "400"],
        # The same set, but another part of it, or shuffled by another seed.
        "other_subset": common + ["--resume", last, "--subset", "50"],
        "other_seed": common + ["--resume", last, "--seed", str(SEED + 1)],
    }
    cases = {name: [str(a) for a in argv] for name, argv in cases.items()}
    spawn(_failure_worker, 2, str(out), cases, {name: free_port() for name in cases})
    results = {}
    for rank in range(2):
        for name, result in torch.load(out / f"failures{rank}.pt", weights_only=False).items():
            results.setdefault(name, {})[rank] = result
    return out, results, marker


def one_error_line(results, name, code):
    """Every rank stopped with `code`; the ranks printed one distinct `error:` line, no
    traceback. Returns it."""
    outcomes = results[name].values()
    assert all(r["code"] == code for r in outcomes), [(r["code"], r["stderr"]) for r in outcomes]
    errors = {line for r in outcomes for line in r["stderr"].splitlines() if "error:" in line}
    assert len(errors) == 1 and all("Traceback" not in r["stderr"] for r in outcomes), errors
    return errors.pop()


def test_resuming_a_finished_run_evaluates_and_ends_cleanly(failures):
    _, results, _ = failures
    assert all(r["code"] == 0 for r in results["finished"].values())
    assert fields(results["finished"][0]["stdout"], "done:")[0]["steps"] == "10"


@pytest.mark.parametrize("layout", ["name", "epoch", "none"])
def test_a_crafted_checkpoint_cannot_delete_files_outside_its_dir(failures, layout):
    """A last.pt whose best-k list names "../../victim.txt": the old code trained an epoch, then
    os.remove()d that path as an evicted best checkpoint. The names a run deletes now come from
    epoch numbers, and a list that holds anything else is refused; so is a file without one
    (before: a KeyError traceback)."""
    out, results, _ = failures
    assert str(out / f"crafted_{layout}.pt") in one_error_line(results, f"crafted_{layout}", 1)
    assert (out / "victim.txt").read_text() == "keep me"


def test_a_truncated_or_missing_checkpoint_is_one_error_line(failures):
    out, results, _ = failures
    assert str(out / "truncated.pt") in one_error_line(results, "truncated", code=1)
    assert str(out / "nope.pt") in one_error_line(results, "missing", code=1)


def test_a_resume_with_another_global_batch_is_refused(failures):
    """A step is one global batch: with another one, step counts and the schedule would mean
    other samples. (Another world size is fine: above.)"""
    _, results, _ = failures
    assert "--global-batch-size 16" in one_error_line(results, "other_global_batch", code=2)


def test_a_global_batch_the_data_or_the_ranks_cannot_fill_is_refused(failures):
    _, results, _ = failures
    assert "95 training samples" in one_error_line(results, "too_few_samples", code=2)
    assert "without a sample" in one_error_line(results, "too_many_ranks", code=2)


def test_cifar10_unavailable_offline_is_one_error_line(failures):
    """The line says why the download failed (here: the proxy refuses), not only that the files
    are missing: offline, or a certificate the machine does not trust, read differently."""
    _, results, _ = failures
    error = one_error_line(results, "offline", code=1)
    assert "--data synthetic" in error and "the download failed: <urlopen error" in error, error


def test_data_a_run_cannot_use_is_refused_before_training(failures):
    """Labels outside CIFAR-10's ten classes, a subset with nothing to validate on, and a resume
    on other data than the checkpoint's (--data auto falls back to synthetic where CIFAR-10 is
    missing; another --subset; another --seed, which shuffles the epochs otherwise): one line
    each, before any step."""
    _, results, _ = failures
    assert "labels outside 0..9" in one_error_line(results, "bad_labels", code=1)
    assert "9 training images" in one_error_line(results, "no_validation", code=2)
    error = one_error_line(results, "other_data", code=1)
    assert f"trained on cifar10 (105 images, seed {SEED}), not synthetic (400 images" in error
    error = one_error_line(results, "other_subset", code=1)
    assert f"trained on cifar10 (105 images, seed {SEED}), not cifar10 (50 images" in error
    error = one_error_line(results, "other_seed", code=1)
    assert f"(105 images, seed {SEED}), not cifar10 (105 images, seed {SEED + 1})" in error


def test_a_cifar_file_that_would_run_code_is_refused(failures):
    """pickle.load runs whatever a pickle names (here open(marker, "w")); the lesson's reader
    builds numpy arrays only and refuses the file in one line, and no code ran."""
    out, results, marker = failures
    assert "refused io.open" in one_error_line(results, "crafted_pickle", code=1)
    assert not marker.exists()
    with open(out / "evil" / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        pickle.load(f)
    assert marker.exists()


@pytest.mark.parametrize(
    "flags", [["--batch-size", "0"], ["--amp", "fp8"], ["--lr", "fast"], ["--epochs", "-1"]]
)
def test_bad_flags_are_one_error_line(flags, monkeypatch, capsys):
    """Parsed before the group forms: one `error:` line naming the flag, exit 2."""
    monkeypatch.setattr(sys, "argv", ["ddp_training.py", *flags])
    with pytest.raises(SystemExit) as e:
        ddp_training.parse_args()
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert e.value.code == 2 and len(errors) == 1 and flags[0] in errors[0], errors


def test_a_bad_flag_in_a_real_process_is_one_error_line():
    errors = assert_clean_failure(run_python("ddp_training.py", "--global-batch-size", "0"), 2)
    assert len(errors) == 1 and "--global-batch-size" in errors[0]


def test_amp_auto_takes_bf16_only_where_the_gpu_has_it(monkeypatch):
    """A T4 or V100 (is_bf16_supported() says yes, emulated; including_emulation=False says no)
    gets fp16 with a GradScaler; an A100/H100 bf16; a CPU neither unless asked."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    emulated = lambda including_emulation=True: including_emulation  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated)
    assert ddp_training.pick_amp("auto", gpu) == "fp16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert ddp_training.pick_amp("auto", gpu) == "bf16"
    assert (
        ddp_training.pick_amp("auto", cpu) == "off" and ddp_training.pick_amp("bf16", cpu) == "bf16"
    )


# ---- a kill during a save --------------------------------------------------------------------
@pytest.mark.slow
def test_kill_during_save_leaves_last_checkpoint_loadable(tmp_path):
    """SIGKILL the whole job while rank 0 is writing last.pt (its temp file exists): last.pt is
    still a complete checkpoint, and --resume auto continues from it to the end."""
    folder = tmp_path / "ckpt"
    flags = ["--model", "cnn", "--data", "synthetic", "--subset", "200", "--epochs", "2"]
    flags += ["--batch-size", "8", "--lr", "1.6", "--save-every", "1", "--checkpoint-dir", folder]
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
                if (folder / "last.pt").exists() and any(".tmp" in f for f in os.listdir(folder)):
                    kill_tree(proc.pid)
                    killed_mid_save = True
                    break
                time.sleep(0.0005)
        finally:
            kill_tree(proc.pid)
            proc.wait()
        if killed_mid_save:
            break
        for f in folder.iterdir():
            f.unlink()
    assert killed_mid_save, "never caught a save in progress"
    assert torch.load(folder / "last.pt", weights_only=True)["step"] >= 1
    # The resume: the same command, in processes forked with torchrun's variables.
    result, other = run_spawned("ddp_training.py", *flags, "--resume", "auto")
    assert_ok(result)
    assert_ok(other)
    final = torch.load(folder / "last.pt", weights_only=True)
    # 200 images: 180 to train, 11 steps of 16 an epoch.
    assert final["epoch"] == 2 and final["step"] == 2 * 11
    assert fields(result.stdout, "done:")[0]["steps"] == "22"
