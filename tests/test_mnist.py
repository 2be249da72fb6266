"""Lesson 1, ddp_mnist.py: DDP keeps replicas identical, shards the data, evaluates exactly, and
runs end to end under torchrun on real-format MNIST files and on synthetic data."""

import os
import re
import subprocess

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import (
    ROOT,
    assert_clean_failure,
    assert_ok,
    cpu_env,
    free_port,
    init_spawned,
    run_torchrun,
    run_torchrun_nodes,
    spawn,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddp_common
import ddp_mnist

DEAD_PROXY = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}


def write_idx(path, array):
    """The IDX format MNIST ships in: magic (0x0801 labels, 0x0803 images), sizes, raw bytes."""
    array = np.asarray(array, dtype=np.uint8)
    header = (0x0800 + array.ndim).to_bytes(4, "big") + b"".join(
        d.to_bytes(4, "big") for d in array.shape
    )
    with open(path, "wb") as f:
        f.write(header + array.tobytes())


def make_mnist(root, n_train=256, n_test=17, seed=0):
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


def done_fields(result):
    line = next(line for line in result.stdout.splitlines() if line.startswith("done:"))
    return dict(re.findall(r"(\w+) ([^|]+?)(?: \||$)", line[len("done: ") :]))


def test_torchvision_reads_the_idx_files_we_write(tmp_path):
    test_labels = make_mnist(tmp_path)
    train, test = ddp_mnist.load_mnist(str(tmp_path), download=False)
    assert len(train) == 256 and len(test) == 17
    assert train[0][0].shape == (1, 28, 28)
    assert torch.equal(test.tensors[1], torch.as_tensor(test_labels))


# ---- node-local disks: two torchrun "nodes" on this machine, each with its own --data-dir ----


def two_nodes(tmp_path, data, have, *args):
    """Launch 2 nodes x 1 rank offline; node i reads tmp_path/n<i>, which holds MNIST iff have[i].
    Returns (exit code of the job, stdout, stderr) over both nodes."""
    for i, h in enumerate(have):
        if h:
            make_mnist(tmp_path / f"n{i}")
    r0, r1 = run_torchrun_nodes(
        "ddp_mnist.py",
        [
            [
                "--data",
                data,
                "--data-dir",
                tmp_path / f"n{i}",
                "--checkpoint-dir",
                tmp_path / "ck",
                *args,
            ]
            for i in range(2)
        ],
        env=cpu_env(**DEAD_PROXY),
    )
    return subprocess.CompletedProcess(
        r0.args, r0.returncode or r1.returncode, r0.stdout + r1.stdout, r0.stderr + r1.stderr
    )


def test_two_nodes_data_mnist_on_node_0_only_is_one_error_line(tmp_path):
    result = two_nodes(tmp_path, "mnist", [True, False])  # node 1 cannot download: offline
    errs = assert_clean_failure(result, code=1)  # never falls back to synthetic data
    # Said once for the job (not once per rank), naming the rank and what to do.
    assert len(errs) == 1 and "rank 1: " in errs[0] and "--data synthetic" in errs[0], errs
    assert "rank 0: " not in errs[0]  # node 0 had its files


def test_two_nodes_auto_agree_on_synthetic_learn_and_checkpoint(tmp_path):
    """Node 0 has MNIST, node 1 has not: training on two different datasets would be wrong, so
    auto falls back to synthetic data on every rank, with a warning."""
    result = two_nodes(
        tmp_path, "auto", [True, False], "--max-steps", 40, "--log-every", 10, "--batch-size", 16
    )
    assert_ok(result)
    assert any(
        line.startswith("warning: ") and "rank 1: " in line for line in result.stdout.splitlines()
    )
    done = done_fields(result)
    assert done["data"] == "synthetic" and done["world"] == "2" and done["steps"] == "40"
    assert float(done["val_acc"].split("%")[0]) > 30.0  # chance is 10%
    ckpt = torch.load(tmp_path / "ck" / "mnist.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in ckpt["model"])  # saved model.module
    ddp_mnist.Net().load_state_dict(ckpt["model"])
    assert ckpt["step"] == 40


def test_two_nodes_each_read_their_own_copy_and_count_every_test_sample_once(tmp_path):
    result = two_nodes(
        tmp_path, "auto", [True, True], "--epochs", 2, "--batch-size", 16, "--lr", 3e-3
    )
    assert_ok(result)
    assert "warning" not in result.stdout
    done = done_fields(result)
    assert done["data"] == "mnist" and done["world"] == "2"
    # 17 test samples over 2 ranks: exact evaluation counts 17, not 18 (padding) or 16.
    assert done["val_acc"].endswith("/17)"), done


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
    env = cpu_env(PYTHONPATH=f"{fake}{os.pathsep}{ROOT}")
    result = run_torchrun(
        ROOT / "ddp_mnist.py",
        *("--data", "synthetic", "--max-steps", 2, "--log-every", 1),
        *("--checkpoint-dir", tmp_path / "ck"),
        env=env,
    )
    assert_ok(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "1 GPU" in warnings[0], result.stderr[-2000:]
    done = done_fields(result)
    assert done["device"] == "cpu" and done["backend"] == "gloo" and done["world"] == "2"


@pytest.mark.parametrize("flag", [["--batch-size", "0"], ["--epochs", "-1"], ["--data", "cifar"]])
def test_bad_flags_are_usage_errors(flag, capsys):
    with pytest.raises(SystemExit) as e:
        ddp_mnist.parse_args(flag)
    assert e.value.code == 2 and re.search(r"^(\S+: )?error: ", capsys.readouterr().err, re.M)


# ---- what DDP guarantees, checked on the lesson's own code inside real processes ----
# One spawn per world size (1, 2, 3) runs every check and saves what it saw; the tests read it.


def _train_steps(rank, world_size, batch=8):
    """Each rank trains the lesson's Net on ITS OWN slice of a fixed batch of 2*batch samples."""
    ddp_common.set_seed(0)
    model = DDP(ddp_mnist.Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = (
            torch.randn(2 * batch, 1, 28, 28, generator=g),
            torch.randint(0, 10, (2 * batch,), generator=g),
        )
        per_rank = 2 * batch // world_size
        xs, ys = (
            x[rank * per_rank : (rank + 1) * per_rank],
            y[rank * per_rank : (rank + 1) * per_rank],
        )
        opt.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
    return model.module


def _evaluate(ddp):
    ddp_common.set_seed(0)
    g = torch.Generator().manual_seed(3)
    test_set = TensorDataset(
        torch.randn(17, 1, 28, 28, generator=g), torch.randint(0, 10, (17,), generator=g)
    )
    result = ddp_mnist.evaluate(ddp_mnist.Net(), test_set, ddp, batch_size=2)
    return torch.tensor(result[:3] + (result[3],), dtype=torch.float64)


def _shard(ddp):
    data = TensorDataset(torch.zeros(101, 1), torch.arange(101))
    seen = [y for _, y in ddp_mnist.make_train_loader(data, ddp, batch_size=8, seed=0)]
    return torch.cat(seen).tolist() if seen else []


def _gather(tensor, world_size):
    out = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(out, tensor)
    return torch.stack(out)


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _checks(rank, world_size, port, out_dir):
    ddp = init_spawned(rank, world_size, port)
    seen = {
        "params": _gather(flat(_train_steps(rank, world_size)), world_size),
        "eval": _evaluate(ddp),
        "shard": _shard(ddp),
    }
    if world_size == 2:
        # get_data on one node: local rank 0 loads (a download if missing), rank 1 waits, loads.
        args = ddp_mnist.parse_args(
            [
                "--data",
                "mnist",
                "--data-dir",
                os.path.join(out_dir, "mnist"),
                "--max-steps",
                "6",
                "--batch-size",
                "16",
                "--checkpoint-dir",
                out_dir,
            ]
        )
        name, train, test = ddp_mnist.get_data(args, ddp)
        seen["data"] = (name, len(train), len(test))
        # The lesson's own train() for a few steps: every rank must end with the same weights.
        model = ddp_mnist.train(args, ddp)
        seen["lesson_params"] = _gather(flat(model.module), world_size)
        del model
    shards = [None] * world_size
    dist.all_gather_object(shards, seen.pop("shard"))
    seen["shards"] = shards
    if rank == 0:
        torch.save(seen, os.path.join(out_dir, f"seen_w{world_size}.pt"))
    ddp_common.cleanup()


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("spawned")
    make_mnist(out / "mnist")
    with pytest.MonkeyPatch.context() as mp:  # world size 1 runs in this process: restore its env
        for k in ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "DDP_TIMEOUT"):
            mp.setenv(k, "")
        _checks(0, 1, free_port(), str(out))
    for world_size in (2, 3):
        spawn(_checks, world_size, str(out))
    return {w: torch.load(out / f"seen_w{w}.pt") for w in (1, 2, 3)}


def test_ranks_stay_identical_and_match_one_process_with_the_global_batch(seen):
    two, one = seen[2]["params"], seen[1]["params"]  # 2 ranks x batch 8; 1 process x batch 16
    assert torch.equal(two[0], two[1])  # every replica holds the same weights
    # ...and they are the weights one process reaches with the global batch
    torch.testing.assert_close(two[0], one[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(one[0], two[0] + 1e-2)  # the comparison can fail


@pytest.mark.parametrize("world_size", [2, 3])
def test_evaluation_is_exact_when_the_test_set_does_not_divide(seen, world_size):
    single, multi = seen[1]["eval"], seen[world_size]["eval"]
    assert multi[3] == 17  # every sample counted once: no padding duplicates, none dropped
    assert torch.equal(multi[2:], single[2:])  # the same correct count as 1 process, exactly
    # The loss is a float32 sum whose grouping depends on the shards: equal up to rounding (seen:
    # 1.9e-7 relative on one CPU), not to the last bit.
    torch.testing.assert_close(multi[:2], single[:2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,world", [(60, 2), (60, 4), (61, 4)])
def test_sampler_shards_are_disjoint_and_cover_the_dataset(n, world):
    data = list(range(n))
    shards = [
        list(DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0))
        for r in range(world)
    ]
    assert len({len(s) for s in shards}) == 1  # equal length: no rank waits at a collective
    flat = [i for s in shards for i in s]
    assert set(flat) == set(data)  # together they cover every sample
    pad = -n % world
    assert len(flat) == n + pad  # disjoint, except the padding DistributedSampler adds
    # set_epoch reshuffles: a different order each epoch (what ddp_mnist calls every epoch)
    s = DistributedSampler(data, num_replicas=world, rank=0, shuffle=True, seed=0)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0


def test_lesson_training_leaves_every_rank_with_the_same_weights(seen):
    params = seen[2]["lesson_params"]
    ddp_common.set_seed(0)
    init = flat(ddp_mnist.Net())
    assert not torch.equal(params[0], init)  # it trained
    assert torch.equal(params[0], params[1])  # and the replicas never drifted apart


def test_lesson_get_data_loads_on_every_local_rank(seen):
    assert seen[2]["data"] == ("mnist", 256, 17)


def test_lesson_loader_gives_each_rank_its_own_shard(seen):
    shards = seen[3]["shards"]
    flat = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [34, 34, 34]  # ceil(101 / 3): equal steps on every rank
    assert set(flat) == set(range(101))  # every sample is seen in the epoch
    assert len(flat) - len(set(flat)) == 1  # only the one padding sample repeats
