"""What lesson 2 (ddp_training.py) needs but does not teach: CIFAR-10 or a synthetic stand-in,
the models, and augmentation. To adapt the template to your own job, replace this file."""

import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ddp_common import fail, print0

# CIFAR-10's channel statistics, for normalising its images.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
# What a pickled numpy array needs, and nothing else (numpy 1 names and numpy 2 names).
ARRAY_PARTS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


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


class ArraysOnly(pickle.Unpickler):
    """CIFAR-10's files are pickles, and pickle.load runs whatever code a file names: a crafted
    data_batch_1 in a shared --data-dir would run on every rank. This one builds arrays only."""

    def find_class(self, module, name):
        if (module, name) not in ARRAY_PARTS:
            raise pickle.UnpicklingError(f"refused {module}.{name}: not part of a numpy array")
        return super().find_class(module, name)


def read_cifar(data_dir):
    """The python version of CIFAR-10 (cifar-10-batches-py/): pickled {"data": N x 3072 uint8,
    "labels": N ints}. Returns [(images, labels)] per file; raises if a file is unreadable."""
    files = []
    for name in CIFAR_FILES:
        with open(os.path.join(data_dir, "cifar-10-batches-py", name), "rb") as f:
            entry = ArraysOnly(f, encoding="latin1").load()
        images = torch.from_numpy(np.asarray(entry["data"], dtype=np.uint8)).view(-1, 3, 32, 32)
        labels = torch.tensor(entry["labels"], dtype=torch.int64)
        if len(images) != len(labels):
            raise ValueError(f"{name} holds {len(images)} images but {len(labels)} labels")
        if not set(entry["labels"]) <= set(range(10)):
            raise ValueError(f"{name} holds labels outside 0..9")
        files.append((images, labels))
    return files


def fetch_cifar(data_dir):
    """Download and unpack CIFAR-10 into data_dir, unless its files are there. Returns why the
    download failed, or None: it shows later, if the ranks cannot read the files."""
    paths = [os.path.join(data_dir, "cifar-10-batches-py", name) for name in CIFAR_FILES]
    if not all(os.path.isfile(path) for path in paths):
        from torchvision.datasets import CIFAR10
        from torchvision.datasets.utils import download_and_extract_archive

        # The archive's checksum is checked; nothing is unpickled here.
        try:
            download_and_extract_archive(CIFAR10.url, data_dir, md5=CIFAR10.tgz_md5)
        except Exception as e:
            return f"the download failed: {' '.join(str(e).split())[:200]}"
    return None


def get_data(args, ddp):
    """-> (name, train, val, test). train yields (image, label, index): the index seeds its
    augmentation. --data auto: CIFAR-10 if every rank can read it, else synthetic on all."""
    problem = None
    if args.data != "synthetic":
        # DDP: two rounds, a barrier after each: global rank 0 fetches, then each node's local
        # rank 0 fetches what its node still lacks (node-local disks: lesson 4 explains it). No
        # two processes write one folder at once, unless rank 0's fetch failed on a shared disk.
        failed = None
        if ddp.rank == 0:
            failed = fetch_cifar(args.data_dir)
        dist.barrier()
        if ddp.local_rank == 0:
            failed = fetch_cifar(args.data_dir) or failed
        dist.barrier()
        try:
            files = read_cifar(args.data_dir)
        except Exception as e:
            problem = f"rank {ddp.rank}: {' '.join(str(e).split())[:200]}"
            problem += f"; {failed}" if failed else ""
    problems = [None] * ddp.world_size
    # DDP: every rank reads its own --data-dir: all must train on the same data, or none.
    dist.all_gather_object(problems, problem)
    bad = [p for p in problems if p]
    if bad and args.data == "cifar10":
        why = f"no CIFAR-10 in {args.data_dir} on {len(bad)} of {ddp.world_size} ranks ({bad[0]})"
        fail(f"{why}; offline? --data synthetic needs no download", code=1, rank0_only=True)
    if bad:
        print0(f"warning: no CIFAR-10 on {len(bad)} rank(s) ({bad[0]}): synthetic data instead")
    n_train = args.subset or 50000
    n_test = max(1, args.subset // 5) if args.subset else 10000
    if bad or args.data == "synthetic":
        name = "synthetic"
        (x, y), (test_x, test_y) = synthetic_cifar(args.seed, n_train, n_test)
    else:
        name = "cifar10"
        x = torch.cat([images for images, _ in files[:5]])[:n_train]
        y = torch.cat([labels for _, labels in files[:5]])[:n_train]
        test_x, test_y = [t[:n_test] for t in files[5]]
    if len(x) < 10:
        fail(f"{len(x)} training images: a tenth of them validates, so at least 10", 2, True)
    # A fixed 10% held out for validation (seed 0, not --seed: every run validates on the same).
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train = order[len(order) // 10 :].sort().values
    val = order[: len(order) // 10].sort().values
    train_set = TensorDataset(x[train], y[train], torch.arange(len(train)))
    # What a checkpoint trained on: the set, its size and --seed (the shuffles follow it).
    name = f"{name} ({len(x)} images, seed {args.seed})"
    return name, train_set, TensorDataset(x[val], y[val]), TensorDataset(test_x, test_y)


def loader(dataset, batches, device, seed):
    """The batches of dataset that batches lists by index (lesson 2: a rank's share per step),
    read ahead by worker processes on GPUs and pinned, so their copies to the GPU overlap
    compute. The workers' seeds come from a generator of its own, not from the global one
    (dropout's, which a checkpoint holds)."""
    on_gpu = device.type == "cuda"
    return DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=4 if on_gpu else 0,
        pin_memory=on_gpu,
        generator=torch.Generator().manual_seed(seed),
    )


def to_input(images, device, augment=None):
    """uint8 images -> normalised floats on the device. augment = (index, epoch, seed): a random
    crop and flip per sample, hashed from them: the same on any number of ranks, after a resume."""
    x = images.to(device, non_blocking=True)
    if augment:
        index, epoch, seed = augment
        index = index.to(device, non_blocking=True)
        r = (index * 7919 + epoch * 104729 + seed * 1299709 + 1) % 2147483647
        # Lehmer steps: scramble neighbouring indices.
        for _ in range(3):
            r = r * 48271 % 2147483647
        # Every 32x32 window of the 4-pixel-padded image, as a view: (n, c, 9, 9, h, w).
        crops = F.pad(x, (4,) * 4).unfold(2, x.shape[2], 1).unfold(3, x.shape[3], 1)
        x = crops[torch.arange(len(x), device=device), :, r % 9, r // 9 % 9]
        flip = (r // 81 % 2).bool()[:, None, None, None]
        x = torch.where(flip, x.flip(3), x)
    x = x.contiguous(memory_format=torch.channels_last).float().div_(255)
    # Python numbers, not tensors: nothing is copied to the device per batch.
    for channel, (mean, std) in enumerate(zip(MEAN, STD, strict=True)):
        x[:, channel].sub_(mean).div_(std)
    return x
