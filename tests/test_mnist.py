"""Lesson 1, ddp_mnist.py: DDP keeps replicas identical, shards the data, evaluates exactly, and
runs end to end under torchrun on real-format MNIST files and on synthetic data."""
import os
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddp_common
import ddp_mnist
from conftest import assert_clean_failure, assert_ok, cpu_env, init_spawned, run_torchrun, spawn

DEAD_PROXY = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}


def write_idx(path, array):
    """The IDX format MNIST ships in: magic (0x0801 labels, 0x0803 images), sizes, raw bytes."""
    array = np.asarray(array, dtype=np.uint8)
    header = (0x0800 + array.ndim).to_bytes(4, "big") + b"".join(
        d.to_bytes(4, "big") for d in array.shape)
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
            images[i, 2 + 2 * y: 4 + 2 * y, 4:24] = 255
        write_idx(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), images)
        write_idx(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels)
    return labels


def done_fields(result):
    line = next(l for l in result.stdout.splitlines() if l.startswith("done:"))
    return dict(re.findall(r"(\w+) ([^|]+?)(?: \||$)", line[len("done: "):]))


def test_torchvision_reads_the_idx_files_we_write(tmp_path):
    test_labels = make_mnist(tmp_path)
    train, test = ddp_mnist.load_mnist(str(tmp_path), download=False)
    assert len(train) == 256 and len(test) == 17
    assert train[0][0].shape == (1, 28, 28)
    assert torch.equal(test.tensors[1], torch.as_tensor(test_labels))


def test_end_to_end_on_mnist_files_counts_every_test_sample_once(tmp_path):
    make_mnist(tmp_path)
    result = run_torchrun("ddp_mnist.py", "--data", "mnist", "--data-dir", tmp_path, "--epochs", 2,
                          "--batch-size", 16, "--lr", 3e-3, "--checkpoint-dir", tmp_path / "ck",
                          nproc=2)
    assert_ok(result)
    done = done_fields(result)
    assert done["data"] == "mnist" and done["world"] == "2"
    # 17 test samples over 2 ranks: exact evaluation counts 17, not 18 (padding) or 16.
    assert done["val_acc"].endswith("/17)"), done


def test_end_to_end_synthetic_fallback_learns_and_checkpoints(tmp_path):
    env = cpu_env(**DEAD_PROXY)  # no network: auto must fall back to synthetic data
    result = run_torchrun("ddp_mnist.py", "--data", "auto", "--data-dir", tmp_path / "data",
                          "--max-steps", 40, "--log-every", 10, "--checkpoint-dir", tmp_path / "ck",
                          nproc=2, env=env)
    assert_ok(result)
    done = done_fields(result)
    assert done["data"] == "synthetic" and done["steps"] == "40"
    assert float(done["val_acc"].split("%")[0]) > 30.0  # chance is 10%
    ckpt = torch.load(tmp_path / "ck" / "mnist.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in ckpt["model"])  # saved model.module
    ddp_mnist.Net().load_state_dict(ckpt["model"])
    assert ckpt["step"] == 40


def test_data_mnist_never_falls_back(tmp_path):
    result = run_torchrun("ddp_mnist.py", "--data", "mnist", "--data-dir", tmp_path, nproc=2,
                          env=cpu_env(**DEAD_PROXY))
    errs = assert_clean_failure(result, code=1)
    assert len(errs) == 1 and "--data synthetic" in errs[0]  # said once, not once per rank


@pytest.mark.parametrize("flag", [["--batch-size", "0"], ["--epochs", "-1"], ["--data", "cifar"]])
def test_bad_flags_are_usage_errors(flag):
    result = run_torchrun("ddp_mnist.py", *flag, nproc=1)
    assert_clean_failure(result)


# ---- what DDP guarantees, checked on the lesson's own model inside real processes ----

def _train_steps(rank, world_size, port, out_dir, batch):
    """Each rank trains the lesson's Net on ITS OWN slice of a fixed batch of 2*batch samples."""
    ddp = init_spawned(rank, world_size, port)
    ddp_common.set_seed(0)
    model = DDP(ddp_mnist.Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(2 * batch, 1, 28, 28, generator=g), torch.randint(0, 10, (2 * batch,), generator=g)
        per_rank = 2 * batch // world_size
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        torch.save(torch.stack(gathered), os.path.join(out_dir, f"params_w{world_size}.pt"))
    ddp_common.cleanup()


def test_ranks_stay_identical_and_match_one_process_with_the_global_batch(tmp_path):
    spawn(_train_steps, 2, str(tmp_path), 8)   # 2 ranks x batch 8
    spawn(_train_steps, 1, str(tmp_path), 8)   # 1 process x batch 16, same samples
    two, one = torch.load(tmp_path / "params_w2.pt"), torch.load(tmp_path / "params_w1.pt")
    assert torch.equal(two[0], two[1])  # every replica holds the same weights
    # ...and they are the weights one process reaches with the global batch
    torch.testing.assert_close(two[0], one[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(one[0], two[0] + 1e-2)  # the comparison can fail


def _evaluate(rank, world_size, port, out_dir):
    ddp = init_spawned(rank, world_size, port)
    ddp_common.set_seed(0)
    model = DDP(ddp_mnist.Net())
    g = torch.Generator().manual_seed(3)
    test_set = TensorDataset(torch.randn(17, 1, 28, 28, generator=g), torch.randint(0, 10, (17,), generator=g))
    result = ddp_mnist.evaluate(model, test_set, ddp, batch_size=2)
    if rank == 0:
        torch.save(torch.tensor(result[:3] + (result[3],), dtype=torch.float64),
                   os.path.join(out_dir, f"eval_w{world_size}.pt"))
    ddp_common.cleanup()


@pytest.mark.parametrize("world_size", [2, 3])
def test_evaluation_is_exact_when_the_test_set_does_not_divide(tmp_path, world_size):
    spawn(_evaluate, 1, str(tmp_path))
    spawn(_evaluate, world_size, str(tmp_path))
    single, multi = torch.load(tmp_path / "eval_w1.pt"), torch.load(tmp_path / f"eval_w{world_size}.pt")
    assert multi[3] == 17  # every sample counted once: no padding duplicates, none dropped
    torch.testing.assert_close(multi, single)  # same loss, accuracy, correct count as 1 process


@pytest.mark.parametrize("n,world", [(60, 2), (60, 4), (61, 4)])
def test_sampler_shards_are_disjoint_and_cover_the_dataset(n, world):
    data = list(range(n))
    shards = [list(DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0))
              for r in range(world)]
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


def _lesson_train(rank, world_size, port, out_dir):
    """Run the lesson's own train() for a few steps and gather every rank's parameters."""
    ddp = init_spawned(rank, world_size, port)
    args = ddp_mnist.parse_args(["--data", "synthetic", "--max-steps", "6", "--batch-size", "16",
                                 "--checkpoint-dir", out_dir])
    model = ddp_mnist.train(args, ddp)
    flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        torch.save(torch.stack(gathered), os.path.join(out_dir, "lesson_params.pt"))
    ddp_common.cleanup()


def test_lesson_training_leaves_every_rank_with_the_same_weights(tmp_path):
    spawn(_lesson_train, 2, str(tmp_path))
    params = torch.load(tmp_path / "lesson_params.pt")
    ddp_common.set_seed(0)
    init = torch.cat([p.detach().flatten() for p in ddp_mnist.Net().parameters()])
    assert not torch.equal(params[0], init)  # it trained
    assert torch.equal(params[0], params[1])  # and the replicas never drifted apart


def _lesson_shards(rank, world_size, port, out_dir):
    ddp = init_spawned(rank, world_size, port)
    data = TensorDataset(torch.zeros(101, 1), torch.arange(101))
    loader = ddp_mnist.make_train_loader(data, ddp, batch_size=8, seed=0)
    seen = [y for _, y in loader]
    seen = torch.cat(seen).tolist() if seen else []
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        torch.save(everyone, os.path.join(out_dir, "shards.pt"))
    ddp_common.cleanup()


def test_lesson_loader_gives_each_rank_its_own_shard(tmp_path):
    spawn(_lesson_shards, 3, str(tmp_path))
    shards = torch.load(tmp_path / "shards.pt")
    flat = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [34, 34, 34]  # ceil(101 / 3): equal steps on every rank
    assert set(flat) == set(range(101))  # every sample is seen in the epoch
    assert len(flat) - len(set(flat)) == 1  # only the one padding sample repeats
