"""What lesson 2 (ddp_training.py) needs but does not teach: CIFAR-10 or a synthetic stand-in,
the models, and augmentation. To adapt the template to your own job, replace this file."""

import contextlib
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ddp_common import fail, print0
from ddp_extras import folder_lock, long_barrier

# CIFAR-10's channel statistics, for normalising its images.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
CIFAR_DIR = "cifar-10-batches-py"
CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def build_model(name):
    """ResNet-18 with the CIFAR stem, or a small CNN (~0.03 M parameters) for CPUs. `cnn` has no
    BatchNorm (its steps do not depend on how the batch is split); `cnn-bn` has it."""
    if name == "resnet18":
        from torchvision.models import resnet18

        model = resnet18(weights=None, num_classes=10)
        # ImageNet's stem (7x7 stride-2 conv + max-pool) shrinks 32x32 to 8x8 before block one.
        model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model
    layers = []
    for c_in, c_out in [(3, 16), (16, 32), (32, 64)]:
        if name == "cnn-bn":
            # No conv bias before BatchNorm: BatchNorm subtracts the mean, bias and all.
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out)]
        else:
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1)]
        layers += [nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 10))


def synthetic_cifar(seed, n_train, n_test):
    """Learnable CIFAR-shaped images, the same on every rank: each class a smooth colour pattern."""
    generator = torch.Generator().manual_seed(seed + 12345)
    prototypes = F.interpolate(
        torch.rand(10, 3, 8, 8, generator=generator), size=32, mode="bilinear"
    )
    labels = torch.randint(0, 10, (n_train + n_test,), generator=generator)
    chunks = []
    # In chunks: 60,000 float images at once would take 700 MB.
    for chunk in labels.split(4096):
        noise = 0.25 * torch.randn(len(chunk), 3, 32, 32, generator=generator)
        chunks.append((prototypes[chunk] + noise).clamp(0, 1).mul(255).byte())
    images = torch.cat(chunks)
    return (images[:n_train], labels[:n_train]), (images[n_train:], labels[n_train:])


def read_cifar(data_dir):
    """The python version of CIFAR-10: pickled {"data": N x 3072 uint8, "labels": N ints}, five
    training files and one test file. Returns (images, labels) per file; raises if unreadable."""
    files = []
    for name in CIFAR_FILES:
        path = os.path.join(data_dir, CIFAR_DIR, name)
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        images = torch.from_numpy(np.asarray(entry["data"], dtype=np.uint8)).view(-1, 3, 32, 32)
        labels = torch.tensor(entry["labels"], dtype=torch.int64)
        if len(images) != len(labels):
            raise ValueError(f"{path} holds {len(images)} images but {len(labels)} labels")
        files.append((images, labels))
    return files


def load_data(data, data_dir, subset, seed, ddp):
    """-> (name, train, val, test). train yields (image, label, sample index): the index seeds
    augmentation. --data-dir may be node-local: local rank 0 of EVERY node downloads, each rank
    reads its own copy, and all ranks agree on one dataset."""
    files = None
    problem = None
    if data != "synthetic":
        paths = [os.path.join(data_dir, CIFAR_DIR, name) for name in CIFAR_FILES]
        # Once per node: several ranks downloading into one folder corrupt it.
        # Nodes that share one disk take turns (a lock file) rather than write the same files.
        if ddp.local_rank == 0 and not all(os.path.isfile(p) for p in paths):
            # Offline? Then the read below says what is missing.
            with folder_lock(data_dir), contextlib.suppress(Exception):
                from torchvision.datasets import CIFAR10

                CIFAR10(data_dir, train=True, download=True)
        # DDP: the node's other ranks wait for its download, longer than a collective may.
        long_barrier()
        try:
            files = read_cifar(data_dir)
        except Exception as e:
            # Missing, truncated, not CIFAR-10.
            reason = " ".join(str(e).split())[:150]
            problem = f"rank {ddp.rank} (node {ddp.node_rank}) in {data_dir}: {reason}"
    problems = [None] * ddp.world_size
    # DDP: every rank learns every rank's outcome
    dist.all_gather_object(problems, problem)
    bad = [p for p in problems if p]
    if bad:
        where = f"on {len(bad)} of {ddp.world_size} ranks ({bad[0]})"
        if data == "cifar10":
            fail(
                f"CIFAR-10 is not readable {where}: copy it to every node, or use --data synthetic",
                code=1,
            )
        print0(f"warning: no CIFAR-10 {where}; training on synthetic CIFAR-shaped data instead")
    n_train = subset or 50000
    n_test = 10000
    if subset:
        n_test = max(1, subset // 5)
    if bad or data == "synthetic":
        name = "synthetic"
        (x, y), (test_x, test_y) = synthetic_cifar(seed, n_train, n_test)
    else:
        name = "cifar10"
        x = torch.cat([images for images, _ in files[:5]])
        y = torch.cat([labels for _, labels in files[:5]])
        test_x, test_y = files[5]
    # A fixed 10% held out for validation (seed 0, not --seed: every run validates on the same).
    order = torch.randperm(min(n_train, len(x)), generator=torch.Generator().manual_seed(0))
    train = order[len(order) // 10 :].sort().values
    val = order[: len(order) // 10].sort().values
    return (
        name,
        TensorDataset(x[train], y[train], torch.arange(len(train))),
        TensorDataset(x[val], y[val]),
        TensorDataset(test_x[:n_test], test_y[:n_test]),
    )


def to_input(images, norm, augment=None):
    """uint8 images -> normalised floats on norm's device. augment = (index, epoch, seed): a random
    crop and flip per sample, hashed from them: the same on any number of ranks, after a resume."""
    x = images.to(norm[0].device, non_blocking=True)
    if augment:
        index, epoch, seed = augment
        index = index.to(x.device, non_blocking=True)
        r = (index * 7919 + epoch * 104729 + seed * 1299709 + 1) % 2147483647
        # Lehmer steps: scramble neighbouring indices.
        for _ in range(3):
            r = r * 48271 % 2147483647
        # Every 32x32 window of the 4-pixel-padded image, as a view: (n, c, 9, 9, h, w).
        crops = F.pad(x, (4,) * 4).unfold(2, x.shape[2], 1).unfold(3, x.shape[3], 1)
        x = crops[torch.arange(len(x), device=x.device), :, r % 9, r // 9 % 9]
        flip = (r // 81 % 2).bool()[:, None, None, None]
        x = torch.where(flip, x.flip(3), x)
    x = x.contiguous(memory_format=torch.channels_last).float().div_(255)
    return (x - norm[0]) / norm[1]
