"""Lesson 1, ddp_mnist.py (and its one-process twin, mnist_single.py): on MNIST in its real
on-disk format, two ranks (the processes torchrun starts, forked with its variables) train exactly
the model one process trains on the global batch, reshuffled every epoch, evaluate every test
sample once, and rank 0 saves the bare model. Under torchrun itself: a machine with one GPU, and
no data offline (and the README's commands, tests/test_readme.py). Node-local data (a download
per node) is lesson 4's: tests/test_multinode.py."""

import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ROOT,
    assert_clean_failure,
    assert_ok,
    cpu_env,
    run_python,
    run_spawned,
    run_torchrun,
)

import ddp_mnist

DEAD_PROXY = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}
N_TRAIN, N_TEST = 256, 17


def write_idx(path, array):
    """The IDX format MNIST ships in: magic (0x0801 labels, 0x0803 images), sizes, raw bytes."""
    array = np.asarray(array, dtype=np.uint8)
    header = (0x0800 + array.ndim).to_bytes(4, "big") + b"".join(
        d.to_bytes(4, "big") for d in array.shape
    )
    with open(path, "wb") as f:
        f.write(header + array.tobytes())


def make_mnist(root, n_train=N_TRAIN, n_test=N_TEST, seed=0):
    """A tiny MNIST in the real on-disk layout: root/MNIST/raw/*-idx?-ubyte (uncompressed).
    Each class is a bright horizontal bar at its own height, so it can be learned."""
    rng = np.random.default_rng(seed)
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 60, (n, 28, 28))
        for i, y in enumerate(labels):
            images[i, 2 + 2 * y : 4 + 2 * y, 4:24] = 255
        write_idx(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), images)
        write_idx(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels)
    return labels


def fields(result, keyword):
    """The `key value` fields of the last line starting with `keyword:`."""
    line = [line for line in result.stdout.splitlines() if line.startswith(f"{keyword}:")][-1]
    return dict(re.findall(r"(\w+) ([^|]+?)(?: \||$)", line[len(keyword) + 2 :]))


def one_process_reference(data_dir, epochs, batch, lr=1e-3):
    """What DDP promises, computed here without it: one process, the lesson's Net, Adam, and
    the global batch: step i of epoch e takes positions i*B .. (i+1)*B of that epoch's shuffle
    (DistributedSampler's: randperm seeded with 0 + epoch), which 2 ranks split between them."""
    train, test = ddp_mnist.load_mnist(str(data_dir), download=False)
    torch.manual_seed(0)
    model = ddp_mnist.Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(epochs):
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))
        for i in range(len(train) // batch):
            x, y = train[order[i * batch : (i + 1) * batch]]
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    with torch.no_grad():
        correct = int((model(test.tensors[0]).argmax(1) == test.tensors[1]).sum())
    return model.state_dict(), correct


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The lesson on 2 ranks x 8 samples, 2 epochs, offline, on MNIST files in the real format,
    in processes forked with the variables torchrun sets (conftest.run_spawned; the README's
    torchrun commands launch it for real); the tests below read rank 0's output, and the
    checkpoint. Rank 1 prints nothing."""
    tmp = tmp_path_factory.mktemp("mnist")
    make_mnist(tmp / "data")
    rank0, rank1 = run_spawned(
        "ddp_mnist.py",
        *("--data-dir", tmp / "data", "--checkpoint-dir", tmp / "ck"),
        *("--epochs", 2, "--batch-size", 8, "--log-every", 8),
        env=DEAD_PROXY,
    )
    assert_ok(rank1)
    assert rank1.stdout == "", rank1.stdout
    rank0.tmp = tmp
    return rank0


def test_torchvision_reads_the_idx_files_we_write(tmp_path):
    test_labels = make_mnist(tmp_path)
    train, test = ddp_mnist.load_mnist(str(tmp_path), download=False)
    assert len(train) == N_TRAIN and len(test) == N_TEST
    assert train[0][0].shape == (1, 28, 28)
    assert torch.equal(test.tensors[1], torch.as_tensor(test_labels))


def test_two_ranks_train_the_model_one_process_trains_on_the_global_batch(two_ranks):
    """The central claim: 2 ranks x batch 8, reshuffled each epoch (set_epoch), take the steps
    one process takes with batch 16. Without set_epoch, without the sampler, or with a rank's
    gradients left out of the average, the weights part."""
    assert_ok(two_ranks)
    ckpt = torch.load(two_ranks.tmp / "ck" / "last.pt", weights_only=True)
    expected, _ = one_process_reference(two_ranks.tmp / "data", epochs=2, batch=16)
    # Rank 0 saved the bare model: no "module." prefix, and it loads into Net.
    assert list(ckpt["model"]) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(ckpt["model"][name], tensor, rtol=1e-4, atol=1e-5)
    assert ckpt["step"] == 2 * N_TRAIN // 16 and ckpt["epoch"] == 2
    assert set(ckpt) == {"model", "optimizer", "step", "epoch"}
    # The comparison can fail: one epoch's steps are far from two epochs'.
    one_epoch, _ = one_process_reference(two_ranks.tmp / "data", epochs=1, batch=16)
    assert not torch.allclose(one_epoch["fc2.weight"], ckpt["model"]["fc2.weight"], atol=1e-3)


def test_every_test_sample_is_counted_once_and_the_output_is_rank_0s(two_ranks):
    """17 test samples over 2 ranks: 9 + 8, not 18 (DistributedSampler's padding) or 16."""
    assert_ok(two_ranks)
    done = fields(two_ranks, "done")
    _, correct = one_process_reference(two_ranks.tmp / "data", epochs=2, batch=16)
    assert done["val_acc"].endswith(f"({correct}/{N_TEST})"), done
    assert done["world"] == "2" and done["steps"] == "32"
    start = fields(two_ranks, "start")
    assert start["batch"] == "8/process, 16 global" and start["backend"] == "gloo"
    # One copy of each line (rank 0 prints; rank 1's output is empty), one log line per 8 steps.
    lines = two_ranks.stdout.splitlines()
    assert sum(line.startswith("start:") for line in lines) == 1
    assert [line.split(" | ")[1] for line in lines if " samples/s" in line] == [
        f"step {s}/32" for s in (8, 16, 24, 32)
    ]


def test_the_one_process_script_learns_the_same_task(tmp_path):
    """mnist_single.py, lesson 1 before DDP, runs on its own and learns."""
    make_mnist(tmp_path / "data")
    result = run_python(
        "mnist_single.py",
        *("--data-dir", tmp_path / "data", "--checkpoint-dir", tmp_path / "ck"),
        *("--epochs", 3, "--batch-size", 16, "--lr", 3e-3),
        env=cpu_env(**DEAD_PROXY),
    )
    assert_ok(result)
    assert int(fields(result, "done")["val_acc"].split("(")[1].split("/")[0]) >= 12
    ckpt = torch.load(tmp_path / "ck" / "last.pt", weights_only=True)
    ddp_mnist.Net().load_state_dict(ckpt["model"])


def test_offline_without_mnist_is_one_error_line_on_every_rank(tmp_path):
    """No files, no network: the download fails on local rank 0, every rank leaves the barrier
    and stops; rank 0 says why in one line (no hang, no traceback)."""
    result = run_torchrun(
        "ddp_mnist.py",
        *("--data-dir", tmp_path / "empty", "--checkpoint-dir", tmp_path / "ck"),
        env=cpu_env(**DEAD_PROXY),
        timeout=120,
    )
    errors = assert_clean_failure(result)
    assert len(errors) == 1 and "--data synthetic" in errors[0], errors


def test_first_command_runs_on_a_machine_with_one_gpu(tmp_path):
    """The README's first command (2 processes) on a laptop with one GPU, faked: torch tells the
    course's device choice (ddp_common, not torch's own internals) that there is one CUDA device.
    One warning, then both ranks train on the CPU with gloo."""
    fake = tmp_path / "fake_one_gpu"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(
        "import sys\n"
        "import torch\n"
        "real_is_available, real_device_count = torch.cuda.is_available, torch.cuda.device_count\n"
        "def asked_by_the_course():\n"
        "    return sys._getframe(2).f_globals.get('__name__') == 'ddp_common'\n"
        "def is_available():\n"
        "    return True if asked_by_the_course() else real_is_available()\n"
        "def device_count():\n"
        "    return 1 if asked_by_the_course() else real_device_count()\n"
        "torch.cuda.is_available, torch.cuda.device_count = is_available, device_count\n"
    )
    env = cpu_env(PYTHONPATH=f"{fake}{os.pathsep}{ROOT}", CUDA_VISIBLE_DEVICES="0")
    result = run_torchrun(
        ROOT / "ddp_mnist.py",
        *("--data", "synthetic", "--max-steps", 2, "--log-every", 1),
        *("--checkpoint-dir", tmp_path / "ck"),
        env=env,
    )
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "1 GPU" in warnings[0], result.stderr[-2000:]
    start = fields(result, "start")
    assert start["device"] == "cpu" and start["backend"] == "gloo" and start["world"] == "2"


@pytest.mark.parametrize("flag", [["--batch-size", "0"], ["--epochs", "x"], ["--data", "cifar"]])
def test_bad_flags_are_one_error_line(flag):
    """Parsed before the group forms: one `error:` line, exit 2, even without a launcher."""
    result = run_python("ddp_mnist.py", *flag)
    errors = assert_clean_failure(result, code=2)
    assert len(errors) == 1 and flag[0] in errors[0], errors
